-- 001_init: sidecar's results database. Tables hold what the flows write; the views below them are the
-- public SQL API (documented in storage/README.md). There are no foreign keys: DuckDB refuses updates of
-- referenced rows, and storage.Database checks that a run exists before writing anything under it.

CREATE TABLE runs (
    run_id       VARCHAR PRIMARY KEY,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    finished_at  TIMESTAMPTZ,
    status       VARCHAR NOT NULL CHECK (status IN ('running', 'completed', 'failed')),
    params       JSON NOT NULL,
    -- the modes every document of the run gets; `results` shows a document once all are written
    modes        VARCHAR[] NOT NULL,
    code_version VARCHAR,
    pair         VARCHAR NOT NULL,
    device       VARCHAR,
    gpu_type     VARCHAR,
    gamma        INTEGER,
    batch_size   INTEGER,
    error        VARCHAR
);

-- Every input row, usable or not. Keyed by row: a duplicate id is a second row with the same doc_id.
CREATE TABLE documents (
    run_id        VARCHAR NOT NULL,
    row_index     INTEGER NOT NULL,
    doc_id        VARCHAR NOT NULL,
    title         VARCHAR,
    text          VARCHAR,
    n_chars       INTEGER,
    status        VARCHAR NOT NULL CHECK (status IN ('ok', 'rejected')),
    reject_reason VARCHAR,
    reject_detail VARCHAR,
    CHECK ((status = 'ok') = (reject_reason IS NULL)),
    PRIMARY KEY (run_id, row_index)
);

CREATE TABLE outputs (
    run_id                VARCHAR NOT NULL,
    doc_id                VARCHAR NOT NULL,
    mode                  VARCHAR NOT NULL CHECK (mode IN ('sidecar', 'sidecar_attended', 'standalone')),
    summary               VARCHAR NOT NULL,
    main_tokens           INTEGER,
    sidecar_name          VARCHAR NOT NULL,
    sidecar_text          VARCHAR NOT NULL,
    tags                  VARCHAR[],
    parse_error           VARCHAR,
    finish_reason         VARCHAR,
    sidecar_finish_reason VARCHAR,
    batch_id              INTEGER,
    written_at            TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, doc_id, mode)
);

CREATE TABLE request_stats (
    run_id          VARCHAR NOT NULL,
    doc_id          VARCHAR NOT NULL,
    mode            VARCHAR NOT NULL CHECK (mode IN ('sidecar', 'sidecar_attended', 'standalone')),
    phase           VARCHAR NOT NULL CHECK (phase IN ('main', 'sidecar')),
    batch_id        INTEGER,
    batch_size      INTEGER,
    drafted         INTEGER NOT NULL,
    accepted        INTEGER NOT NULL,
    target_forwards INTEGER NOT NULL,
    draft_forwards  INTEGER NOT NULL,
    new_tokens      INTEGER NOT NULL,
    prompt_tokens   INTEGER,
    prefill_s       DOUBLE,
    decode_s        DOUBLE,
    wall_s          DOUBLE,
    kv_bytes        BIGINT,
    PRIMARY KEY (run_id, doc_id, mode, phase)
);

CREATE TABLE judgement_games (
    run_id         VARCHAR NOT NULL,
    doc_id         VARCHAR NOT NULL,
    judge_model    VARCHAR NOT NULL,
    prompt_version VARCHAR NOT NULL,
    game           INTEGER NOT NULL CHECK (game IN (1, 2)),
    mode_a         VARCHAR NOT NULL,
    mode_b         VARCHAR NOT NULL,
    raw_answer     VARCHAR,
    winner         VARCHAR,
    error          VARCHAR,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK (winner IS NULL OR winner IN (mode_a, mode_b, 'tie')),
    PRIMARY KEY (run_id, doc_id, judge_model, prompt_version, game)
);

CREATE TABLE cost_estimates (
    gpu_type         VARCHAR NOT NULL,
    pair             VARCHAR NOT NULL,
    mode             VARCHAR NOT NULL,
    batch_size       INTEGER NOT NULL,
    tokens_per_s     DOUBLE NOT NULL CHECK (tokens_per_s >= 0),
    ms_per_step      DOUBLE,
    usd_per_gpu_hour DOUBLE,
    usd_per_mtok     DOUBLE,
    source           VARCHAR NOT NULL CHECK (source IN ('measured', 'projected')),
    run_id           VARCHAR,
    note             VARCHAR,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT current_timestamp
);

-- One row per run and document that has every mode of its run written (batches commit atomically, so
-- a document is either complete here or absent).
CREATE VIEW results AS
WITH complete AS (
    SELECT o.run_id, o.doc_id
    FROM outputs AS o
    JOIN runs AS r ON r.run_id = o.run_id
    WHERE list_contains(r.modes, o.mode)
    GROUP BY o.run_id, o.doc_id, r.modes
    HAVING count(DISTINCT o.mode) = len(list_distinct(r.modes))
)
SELECT
    c.run_id,
    c.doc_id,
    d.title,
    d.n_chars,
    coalesce(s.summary, a.summary, st.summary) AS summary,
    coalesce(s.main_tokens, a.main_tokens) AS summary_tokens,
    coalesce(s.finish_reason, a.finish_reason) AS summary_finish_reason,
    coalesce(s.sidecar_name, a.sidecar_name, st.sidecar_name) AS sidecar_name,
    s.tags AS sidecar_tags,
    s.sidecar_text AS sidecar_text,
    s.parse_error AS sidecar_parse_error,
    st.tags AS standalone_tags,
    st.sidecar_text AS standalone_text,
    st.parse_error AS standalone_parse_error,
    a.tags AS attended_tags,
    a.sidecar_text AS attended_text,
    a.parse_error AS attended_parse_error,
    r.pair,
    r.status AS run_status
FROM complete AS c
JOIN runs AS r ON r.run_id = c.run_id
LEFT JOIN documents AS d ON d.run_id = c.run_id AND d.doc_id = c.doc_id AND d.status = 'ok'
LEFT JOIN outputs AS s ON s.run_id = c.run_id AND s.doc_id = c.doc_id AND s.mode = 'sidecar'
LEFT JOIN outputs AS a ON a.run_id = c.run_id AND a.doc_id = c.doc_id AND a.mode = 'sidecar_attended'
LEFT JOIN outputs AS st ON st.run_id = c.run_id AND st.doc_id = c.doc_id AND st.mode = 'standalone';

-- Rows of one batch share the batch's wall clock, so a batch's time is the longest of its rows' and
-- tokens/s divides all new tokens by the summed batch times. Rows without batch_id count as batches of one.
CREATE VIEW throughput AS
WITH per_batch AS (
    SELECT
        run_id, mode, phase,
        coalesce(CAST(batch_id AS VARCHAR), 'doc:' || doc_id) AS batch_key,
        count(*) AS requests,
        sum(new_tokens) AS new_tokens,
        max(wall_s) AS wall_s,
        sum(drafted) AS drafted,
        sum(accepted) AS accepted,
        sum(target_forwards) AS target_forwards,
        sum(draft_forwards) AS draft_forwards,
        sum(kv_bytes) AS kv_bytes,
        count(kv_bytes) AS kv_rows,
        max(batch_size) AS batch_size
    FROM request_stats
    GROUP BY run_id, mode, phase, batch_key
)
SELECT
    b.run_id,
    r.pair,
    r.device,
    r.gpu_type,
    r.gamma,
    b.mode,
    b.phase,
    coalesce(max(b.batch_size), r.batch_size) AS batch_size,
    sum(b.requests) AS requests,
    count(*) AS batches,
    sum(b.new_tokens) AS new_tokens,
    sum(b.wall_s) AS wall_s,
    sum(b.new_tokens) / nullif(sum(b.wall_s), 0) AS tokens_per_s,
    sum(b.accepted) / nullif(sum(b.drafted), 0) AS acceptance_rate,
    sum(b.new_tokens) / nullif(sum(b.target_forwards), 0) AS tokens_per_target_forward,
    sum(b.kv_bytes) / nullif(sum(b.kv_rows), 0) AS mean_kv_bytes
FROM per_batch AS b
JOIN runs AS r ON r.run_id = b.run_id
GROUP BY b.run_id, r.pair, r.device, r.gpu_type, r.gamma, r.batch_size, b.mode, b.phase;

-- Final verdict per run, document, judge and prompt version from the two position-swapped games: a
-- win counts only when both games agree on it, any disagreement is a tie, and the verdict stays NULL
-- until both games have a parsed winner.
CREATE VIEW judgements AS
WITH games AS (
    SELECT
        run_id, doc_id, judge_model, prompt_version,
        any_value(mode_a) FILTER (WHERE game = 1) AS mode_a,
        any_value(mode_b) FILTER (WHERE game = 1) AS mode_b,
        any_value(winner) FILTER (WHERE game = 1) AS game1_winner,
        any_value(winner) FILTER (WHERE game = 2) AS game2_winner,
        count(error) AS errors,
        max(created_at) AS judged_at
    FROM judgement_games
    GROUP BY run_id, doc_id, judge_model, prompt_version
)
SELECT
    run_id, doc_id, judge_model, prompt_version, mode_a, mode_b, game1_winner, game2_winner,
    CASE
        WHEN game1_winner IS NULL OR game2_winner IS NULL THEN NULL
        WHEN game1_winner = game2_winner THEN game1_winner
        ELSE 'tie'
    END AS verdict,
    coalesce(game1_winner = game2_winner, false) AS consistent,
    errors,
    judged_at
FROM games;

-- The cost report: usd_per_mtok as given, else from the GPU's hourly rent and the throughput.
CREATE VIEW costs AS
SELECT
    gpu_type, pair, mode, batch_size, tokens_per_s, ms_per_step, usd_per_gpu_hour,
    coalesce(usd_per_mtok, usd_per_gpu_hour / nullif(tokens_per_s * 3600, 0) * 1e6) AS usd_per_mtok,
    source, run_id, note, created_at
FROM cost_estimates;
