-- 003_judge_controls: the judge's games gain their kind and probabilities, and every judged run gains
-- the settings its verdicts are read with. A game is `main` (sidecar against standalone tags), `control`
-- (a document's own sidecar tags against another document's: the right answer is known) or `null` (a tag
-- set against itself in reversed order: the true preference is 0.5, so what the judge shows is noise).
-- In the probability mode `p_a` and `p_b` are the judge's probabilities of answering A and B as the
-- endpoint gave them; the views normalise them over the two letters. The key gains `kind`, which DuckDB
-- cannot add to a primary key in place: the table is rebuilt with its rows, all of them `main` games.

DROP VIEW judgements;

CREATE TEMPORARY TABLE judgement_games_002 AS SELECT * FROM judgement_games;
DROP TABLE judgement_games;

CREATE TABLE judgement_games (
    run_id         VARCHAR NOT NULL,
    doc_id         VARCHAR NOT NULL,
    judge_model    VARCHAR NOT NULL,
    prompt_version VARCHAR NOT NULL,
    kind           VARCHAR NOT NULL DEFAULT 'main' CHECK (kind IN ('main', 'control', 'null')),
    game           INTEGER NOT NULL CHECK (game IN (1, 2)),
    -- the sides shown first and second: modes in a main game, 'own'/'other' in a control,
    -- 'original'/'reversed' in a null game
    mode_a         VARCHAR NOT NULL,
    mode_b         VARCHAR NOT NULL,
    raw_answer     VARCHAR,
    winner         VARCHAR,
    error          VARCHAR,
    p_a            DOUBLE CHECK (p_a BETWEEN 0 AND 1),
    p_b            DOUBLE CHECK (p_b BETWEEN 0 AND 1),
    -- the document whose sidecar tags a control game shows as 'other'
    foil_doc_id    VARCHAR,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK (winner IS NULL OR winner IN (mode_a, mode_b, 'tie')),
    CHECK ((kind = 'control') = (foil_doc_id IS NOT NULL)),
    PRIMARY KEY (run_id, doc_id, judge_model, prompt_version, kind, game)
);

INSERT INTO judgement_games (run_id, doc_id, judge_model, prompt_version, kind, game, mode_a, mode_b, raw_answer,
                             winner, error, created_at)
SELECT run_id, doc_id, judge_model, prompt_version, 'main', game, mode_a, mode_b, raw_answer, winner, error,
       created_at
FROM judgement_games_002;
DROP TABLE judgement_games_002;

-- What a judge flow read its run's verdicts with: the answer mode, the control accuracy below which the
-- verdicts are unreliable, and the least margin a probability verdict needs (NULL in the text mode).
CREATE TABLE judge_settings (
    run_id         VARCHAR NOT NULL,
    judge_model    VARCHAR NOT NULL,
    prompt_version VARCHAR NOT NULL,
    mode           VARCHAR NOT NULL CHECK (mode IN ('probability', 'text')),
    threshold      DOUBLE NOT NULL CHECK (threshold BETWEEN 0 AND 1),
    margin_floor   DOUBLE CHECK (margin_floor BETWEEN 0 AND 0.5),
    created_at     TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK ((mode = 'probability') = (margin_floor IS NOT NULL)),
    PRIMARY KEY (run_id, judge_model, prompt_version)
);

-- Per run, document, judge, prompt version and game kind: the preference for the kind's subject side
-- (the sidecar's tags, a document's own tags, the original order), averaged over the two position-swapped
-- games, which cancels a position bias. Probability mode: the mean of the subject's normalised
-- probability; text mode: the mean of 1 (subject won), 0.5 (tie) and 0 (other side won). NULL until
-- both games have an answer.
CREATE VIEW judge_documents AS
WITH games AS (
    SELECT
        *,
        CASE kind WHEN 'main' THEN 'sidecar' WHEN 'control' THEN 'own' ELSE 'original' END AS subject,
        p_a / nullif(p_a + p_b, 0) AS p_first
    FROM judgement_games
),
scored AS (
    SELECT
        *,
        CASE WHEN mode_a = subject THEN p_first ELSE 1 - p_first END AS p_subject,
        CASE WHEN winner = subject THEN 1.0 WHEN winner = 'tie' THEN 0.5 WHEN winner IS NOT NULL THEN 0.0
        END AS text_subject,
        coalesce(p_first, CASE WHEN winner = mode_a THEN 1.0 WHEN winner = 'tie' THEN 0.5
                               WHEN winner = mode_b THEN 0.0 END) AS first_shown
    FROM games
)
SELECT
    run_id, doc_id, judge_model, prompt_version, kind,
    any_value(foil_doc_id) AS foil_doc_id,
    CASE WHEN count(p_subject) = 2 THEN avg(p_subject) END AS preference,
    CASE WHEN count(text_subject) = 2 THEN avg(text_subject) END AS text_preference,
    count(first_shown) AS answered_games,
    sum(first_shown) AS first_shown
FROM scored
GROUP BY run_id, doc_id, judge_model, prompt_version, kind;

-- One row per run, judge model and prompt version that has games. control_accuracy: each control document
-- scores 1 when its preference favours its own tags, 0 when it favours the other document's and 0.5 when
-- it is even (within 1e-9), so a judge blind to the tags scores 0.5. position_bias: the mean probability
-- (text mode: share) of choosing the set shown first, over every answered game. margin: how far from 0.5
-- a probability verdict must be; the largest deviation from 0.5 among the null documents, at least the
-- run's margin_floor (NULL in the text mode). reliable: control_accuracy reached the run's threshold; a
-- run without control games is never reliable.
CREATE VIEW judge_quality AS
WITH per_doc AS (
    SELECT *, coalesce(preference, text_preference) AS score_basis FROM judge_documents
),
aggregated AS (
    SELECT
        run_id, judge_model, prompt_version,
        sum(answered_games) FILTER (WHERE kind = 'control') AS control_games,
        count(score_basis) FILTER (WHERE kind = 'control') AS control_documents,
        avg(CASE WHEN score_basis > 0.5 + 1e-9 THEN 1.0 WHEN score_basis < 0.5 - 1e-9 THEN 0.0 ELSE 0.5 END)
            FILTER (WHERE kind = 'control' AND score_basis IS NOT NULL) AS control_accuracy,
        sum(first_shown) / nullif(sum(answered_games), 0) AS position_bias,
        count(preference) FILTER (WHERE kind = 'null') AS null_documents,
        max(abs(preference - 0.5)) FILTER (WHERE kind = 'null') AS null_deviation
    FROM per_doc
    GROUP BY run_id, judge_model, prompt_version
)
SELECT
    a.run_id, a.judge_model, a.prompt_version,
    s.mode,
    coalesce(a.control_games, 0) AS control_games,
    a.control_documents,
    a.control_accuracy,
    a.position_bias,
    a.null_documents,
    CASE WHEN s.mode = 'probability' THEN greatest(s.margin_floor, coalesce(a.null_deviation, 0)) END AS margin,
    s.threshold,
    coalesce(a.control_accuracy >= s.threshold, false) AS reliable
FROM aggregated AS a
LEFT JOIN judge_settings AS s
    ON s.run_id = a.run_id AND s.judge_model = a.judge_model AND s.prompt_version = a.prompt_version;

-- Final verdict per run, document, judge and prompt version, from the two position-swapped main games.
-- Text mode: a win counts only when both games agree on it, any disagreement is a tie. Probability mode:
-- `preference` (the debiased probability that the sidecar's tags are better) decides, a tie when it is
-- within the run's calibrated `margin` of 0.5. The verdict stays NULL until both games have an answer;
-- `reliable` is the run's judge_quality.reliable, false when the judge failed its controls.
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
    WHERE kind = 'main'
    GROUP BY run_id, doc_id, judge_model, prompt_version
)
SELECT
    g.run_id, g.doc_id, g.judge_model, g.prompt_version, g.mode_a, g.mode_b, g.game1_winner, g.game2_winner,
    CASE
        WHEN g.game1_winner IS NULL OR g.game2_winner IS NULL THEN NULL
        WHEN q.mode = 'probability' THEN CASE
            WHEN d.preference IS NULL THEN NULL
            WHEN d.preference > 0.5 + q.margin THEN 'sidecar'
            WHEN d.preference < 0.5 - q.margin THEN 'standalone'
            ELSE 'tie' END
        WHEN g.game1_winner = g.game2_winner THEN g.game1_winner
        ELSE 'tie'
    END AS verdict,
    coalesce(g.game1_winner = g.game2_winner, false) AS consistent,
    g.errors,
    g.judged_at,
    d.preference,
    coalesce(q.reliable, false) AS reliable
FROM games AS g
LEFT JOIN judge_documents AS d
    ON d.run_id = g.run_id AND d.doc_id = g.doc_id AND d.judge_model = g.judge_model
    AND d.prompt_version = g.prompt_version AND d.kind = 'main'
LEFT JOIN judge_quality AS q
    ON q.run_id = g.run_id AND q.judge_model = g.judge_model AND q.prompt_version = g.prompt_version;
