-- 011_sidecar_outputs: any number of sidecar tasks per run, all decoded from one main output per document and
-- mode. `outputs` keeps the main output once; each task's output is a row of `sidecar_outputs`, keyed by
-- (run, document, mode, task): its raw text, its parsed value as JSON (a list of tags, a string; NULL when it
-- could not be parsed, and `parse_error` says why), its finish reason, its own new tokens and its share of the
-- device-time ledger (`device_s`: prefill, decode and masked instruction seconds; NULL without the ledger).
-- The request's `request_stats` row of phase 'sidecar' holds all its tasks together, so `throughput` keeps its
-- meaning.
--
-- Existing rows move over: each `outputs` row's sidecar columns become its one task's row, tokens and device
-- seconds from its sidecar stats row. `parsed` is its tags as JSON; an output without tags and without a parse
-- error (a `text` task) gets its text, trimmed, as a JSON string. DuckDB cannot drop columns that a view
-- reads: `results` is dropped and `outputs` rebuilt with its rows.
--
-- `results` keeps its columns, order and meaning for one task per run: `hashtags` when the run has it, else
-- the run's task first by name. Every task's outputs are in `sidecar_outputs`.

DROP VIEW results;

CREATE TABLE sidecar_outputs (
    run_id        VARCHAR NOT NULL,
    doc_id        VARCHAR NOT NULL,
    mode          VARCHAR NOT NULL CHECK (mode IN ('sidecar', 'sidecar_attended', 'standalone')),
    task          VARCHAR NOT NULL,
    text          VARCHAR NOT NULL,
    parsed        JSON,
    parse_error   VARCHAR,
    finish_reason VARCHAR,
    new_tokens    INTEGER,
    device_s      DOUBLE,
    written_at    TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, doc_id, mode, task)
);

INSERT INTO sidecar_outputs (run_id, doc_id, mode, task, text, parsed, parse_error, finish_reason, new_tokens,
                             device_s, written_at)
SELECT
    o.run_id, o.doc_id, o.mode, o.sidecar_name, o.sidecar_text,
    CASE
        WHEN o.tags IS NOT NULL THEN to_json(o.tags)
        WHEN o.parse_error IS NULL THEN to_json(trim(o.sidecar_text, E' \t\n\r'))
    END,
    o.parse_error, o.sidecar_finish_reason, s.new_tokens,
    s.prefill_device_s + s.decode_device_s + coalesce(s.instruction_device_s, 0),
    o.written_at
FROM outputs AS o
LEFT JOIN request_stats AS s ON s.run_id = o.run_id AND s.doc_id = o.doc_id AND s.mode = o.mode AND s.phase = 'sidecar';

CREATE TEMPORARY TABLE outputs_010 AS SELECT * FROM outputs;
DROP TABLE outputs;

CREATE TABLE outputs (
    run_id        VARCHAR NOT NULL,
    doc_id        VARCHAR NOT NULL,
    mode          VARCHAR NOT NULL CHECK (mode IN ('sidecar', 'sidecar_attended', 'standalone')),
    summary       VARCHAR NOT NULL,
    main_tokens   INTEGER,
    finish_reason VARCHAR,
    batch_id      INTEGER,
    written_at    TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, doc_id, mode)
);

INSERT INTO outputs (run_id, doc_id, mode, summary, main_tokens, finish_reason, batch_id, written_at)
SELECT run_id, doc_id, mode, summary, main_tokens, finish_reason, batch_id, written_at FROM outputs_010;
DROP TABLE outputs_010;

-- One row per run and document that has every mode of its run written (batches commit atomically, so a
-- document is either complete here or absent), with its shown task's output in each mode.
CREATE VIEW results AS
WITH complete AS (
    SELECT o.run_id, o.doc_id
    FROM outputs AS o
    JOIN runs AS r ON r.run_id = o.run_id
    WHERE list_contains(r.modes, o.mode)
    GROUP BY o.run_id, o.doc_id, r.modes
    HAVING count(DISTINCT o.mode) = len(list_distinct(r.modes))
),
shown AS (
    SELECT run_id, coalesce(any_value(task) FILTER (WHERE task = 'hashtags'), min(task)) AS task
    FROM sidecar_outputs
    GROUP BY run_id
),
task_outputs AS (
    SELECT
        t.run_id, t.doc_id, t.mode, t.task, t.text, t.parse_error,
        CASE WHEN json_type(t.parsed) = 'ARRAY' THEN CAST(t.parsed AS VARCHAR[]) END AS tags
    FROM sidecar_outputs AS t
    JOIN shown AS w ON w.run_id = t.run_id AND w.task = t.task
)
SELECT
    c.run_id,
    c.doc_id,
    d.title,
    d.n_chars,
    coalesce(s.summary, a.summary, st.summary) AS summary,
    coalesce(s.main_tokens, a.main_tokens) AS summary_tokens,
    coalesce(s.finish_reason, a.finish_reason) AS summary_finish_reason,
    coalesce(ts.task, ta.task, tst.task) AS sidecar_name,
    ts.tags AS sidecar_tags,
    ts.text AS sidecar_text,
    ts.parse_error AS sidecar_parse_error,
    tst.tags AS standalone_tags,
    tst.text AS standalone_text,
    tst.parse_error AS standalone_parse_error,
    ta.tags AS attended_tags,
    ta.text AS attended_text,
    ta.parse_error AS attended_parse_error,
    r.pair,
    r.status AS run_status
FROM complete AS c
JOIN runs AS r ON r.run_id = c.run_id
LEFT JOIN documents AS d ON d.run_id = c.run_id AND d.doc_id = c.doc_id AND d.status = 'ok'
LEFT JOIN outputs AS s ON s.run_id = c.run_id AND s.doc_id = c.doc_id AND s.mode = 'sidecar'
LEFT JOIN outputs AS a ON a.run_id = c.run_id AND a.doc_id = c.doc_id AND a.mode = 'sidecar_attended'
LEFT JOIN outputs AS st ON st.run_id = c.run_id AND st.doc_id = c.doc_id AND st.mode = 'standalone'
LEFT JOIN task_outputs AS ts ON ts.run_id = c.run_id AND ts.doc_id = c.doc_id AND ts.mode = 'sidecar'
LEFT JOIN task_outputs AS ta ON ta.run_id = c.run_id AND ta.doc_id = c.doc_id AND ta.mode = 'sidecar_attended'
LEFT JOIN task_outputs AS tst ON tst.run_id = c.run_id AND tst.doc_id = c.doc_id AND tst.mode = 'standalone';
