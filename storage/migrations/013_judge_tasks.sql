-- 013_judge_tasks: the judge scores every sidecar task of a run, not only the one the `results` view shows
-- (study.judge, docs/judge.md). Games, likelihood scores and settings gain the `task` they judged, part of
-- their keys, so one judge model and prompt version keep a ladder and a verdict per task; the views
-- judge_documents, judge_quality, judge_headline and judgements carry it and group by it. DuckDB cannot
-- change a primary key in place: the tables are rebuilt with their rows, each given the task the judge read
-- before this migration, the run's `results` task (`hashtags` when the run has it, else its first task by
-- name: 011), `hashtags` for a run without sidecar outputs.
-- judge_tasks holds, per run and task, what the judge asked about (the task's instruction) and, for a task it
-- cannot score, why (`not_judged`): no verdict, which is not an unreliable one. judge_verdicts reads both per
-- run and task: judged (with the verdict), not judged (with why) or unreliable (with the failed rungs).

DROP VIEW judgements;
DROP VIEW judge_headline;
DROP VIEW judge_quality;
DROP VIEW judge_documents;

CREATE TEMPORARY TABLE judged_task_012 AS
SELECT run_id, coalesce(any_value(task) FILTER (WHERE task = 'hashtags'), min(task)) AS task
FROM sidecar_outputs
GROUP BY run_id;

CREATE TEMPORARY TABLE judgement_games_012 AS SELECT * FROM judgement_games;
DROP TABLE judgement_games;

CREATE TABLE judgement_games (
    run_id         VARCHAR NOT NULL,
    task           VARCHAR NOT NULL DEFAULT 'hashtags',
    doc_id         VARCHAR NOT NULL,
    judge_model    VARCHAR NOT NULL,
    prompt_version VARCHAR NOT NULL,
    kind           VARCHAR NOT NULL DEFAULT 'main' CHECK (kind IN ('main', 'control', 'hard', 'null')),
    game           INTEGER NOT NULL CHECK (game IN (1, 2)),
    -- the sides shown first and second: modes in a main game, 'own'/'other' in a control, 'own'/'mixed'
    -- in a hard control, 'original'/'reversed' in a null game
    mode_a         VARCHAR NOT NULL,
    mode_b         VARCHAR NOT NULL,
    raw_answer     VARCHAR,
    winner         VARCHAR,
    error          VARCHAR,
    p_a            DOUBLE CHECK (p_a BETWEEN 0 AND 1),
    p_b            DOUBLE CHECK (p_b BETWEEN 0 AND 1),
    -- the document whose output of the task a control game shows as 'other', or mixes in as 'mixed'
    foil_doc_id    VARCHAR,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK (winner IS NULL OR winner IN (mode_a, mode_b, 'tie')),
    CHECK ((kind IN ('control', 'hard')) = (foil_doc_id IS NOT NULL)),
    PRIMARY KEY (run_id, task, doc_id, judge_model, prompt_version, kind, game)
);

INSERT INTO judgement_games BY NAME
SELECT g.*, coalesce(t.task, 'hashtags') AS task
FROM judgement_games_012 AS g
LEFT JOIN judged_task_012 AS t ON t.run_id = g.run_id;
DROP TABLE judgement_games_012;

CREATE TEMPORARY TABLE judgement_scores_012 AS SELECT * FROM judgement_scores;
DROP TABLE judgement_scores;

-- tags: the scored output as the scorer saw it: a tag list's tags, any other output as its one element (a
-- string as it is, any other JSON value as JSON).
CREATE TABLE judgement_scores (
    run_id          VARCHAR NOT NULL,
    task            VARCHAR NOT NULL DEFAULT 'hashtags',
    doc_id          VARCHAR NOT NULL,
    judge_model     VARCHAR NOT NULL,
    prompt_version  VARCHAR NOT NULL,
    kind            VARCHAR NOT NULL CHECK (kind IN ('main', 'control', 'hard', 'null')),
    side            VARCHAR NOT NULL CHECK (side IN ('sidecar', 'standalone', 'own', 'other', 'mixed', 'original',
                                                     'reversed')),
    tags            VARCHAR[] NOT NULL,
    baseline_doc_id VARCHAR NOT NULL,
    given_own       DOUBLE CHECK (given_own <= 1e-6),
    given_baseline  DOUBLE CHECK (given_baseline <= 1e-6),
    tokens          INTEGER CHECK (tokens > 0),
    error           VARCHAR,
    foil_doc_id     VARCHAR,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK ((kind IN ('control', 'hard')) = (foil_doc_id IS NOT NULL)),
    PRIMARY KEY (run_id, task, doc_id, judge_model, prompt_version, kind, side)
);

INSERT INTO judgement_scores BY NAME
SELECT s.*, coalesce(t.task, 'hashtags') AS task
FROM judgement_scores_012 AS s
LEFT JOIN judged_task_012 AS t ON t.run_id = s.run_id;
DROP TABLE judgement_scores_012;

CREATE TEMPORARY TABLE judge_settings_012 AS SELECT * FROM judge_settings;
DROP TABLE judge_settings;

CREATE TABLE judge_settings (
    run_id         VARCHAR NOT NULL,
    task           VARCHAR NOT NULL DEFAULT 'hashtags',
    judge_model    VARCHAR NOT NULL,
    prompt_version VARCHAR NOT NULL,
    mode           VARCHAR NOT NULL CHECK (mode IN ('probability', 'text', 'likelihood')),
    threshold      DOUBLE NOT NULL CHECK (threshold BETWEEN 0 AND 1),
    margin_floor   DOUBLE CHECK (margin_floor >= 0),
    note           VARCHAR,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK ((mode = 'text') = (margin_floor IS NULL)),
    PRIMARY KEY (run_id, task, judge_model, prompt_version)
);

INSERT INTO judge_settings BY NAME
SELECT s.*, coalesce(t.task, 'hashtags') AS task
FROM judge_settings_012 AS s
LEFT JOIN judged_task_012 AS t ON t.run_id = s.run_id;
DROP TABLE judge_settings_012;
DROP TABLE judged_task_012;

-- Per run and sidecar task, what its last judge found it to be: the instruction the judge asked about (NULL:
-- the task's outputs are tag lists, judged by the hashtag prompts) and, for a task it cannot score, why
-- (`not_judged`; NULL when judged).
CREATE TABLE judge_tasks (
    run_id      VARCHAR NOT NULL,
    task        VARCHAR NOT NULL,
    instruction VARCHAR,
    not_judged  VARCHAR,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, task)
);

-- The views of 010 and 012 as they were, with `task` beside `run_id` in every key: each statement below is
-- per run and task where it says per run.
CREATE VIEW judge_documents AS
WITH games AS (
    SELECT
        *,
        CASE kind WHEN 'main' THEN 'sidecar' WHEN 'null' THEN 'original' ELSE 'own' END AS subject,
        CASE WHEN isfinite(p_a) AND isfinite(p_b) THEN p_a / nullif(p_a + p_b, 0) END AS p_first
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
),
pairwise AS (
    SELECT
        run_id, task, doc_id, judge_model, prompt_version, kind,
        any_value(foil_doc_id) AS foil_doc_id,
        CASE WHEN count(p_subject) = 2 THEN avg(p_subject) END AS preference,
        CASE WHEN count(text_subject) = 2 THEN avg(text_subject) END AS text_preference,
        count(first_shown) AS answered_games,
        sum(first_shown) AS first_shown
    FROM scored
    GROUP BY run_id, task, doc_id, judge_model, prompt_version, kind
),
likelihood AS (
    SELECT
        run_id, task, doc_id, judge_model, prompt_version, kind,
        any_value(foil_doc_id) AS foil_doc_id,
        any_value(given_own - given_baseline)
            FILTER (WHERE side IN ('sidecar', 'own', 'original') AND isfinite(given_own - given_baseline))
            AS subject_score,
        any_value(given_own - given_baseline)
            FILTER (WHERE side NOT IN ('sidecar', 'own', 'original') AND isfinite(given_own - given_baseline))
            AS other_score
    FROM judgement_scores
    GROUP BY run_id, task, doc_id, judge_model, prompt_version, kind
)
SELECT
    run_id, task, doc_id, judge_model, prompt_version, 'pairwise' AS method, kind, foil_doc_id,
    preference, text_preference, answered_games, first_shown,
    NULL::DOUBLE AS subject_score, NULL::DOUBLE AS other_score,
    coalesce(preference, text_preference) - 0.5 AS difference,
    coalesce(preference, text_preference) AS own_score,
    1 - coalesce(preference, text_preference) AS foil_score
FROM pairwise
UNION ALL
SELECT
    run_id, task, doc_id, judge_model, prompt_version, 'likelihood' AS method, kind, foil_doc_id,
    NULL, NULL, 0, NULL,
    subject_score, other_score,
    subject_score - other_score AS difference,
    CASE WHEN other_score IS NOT NULL THEN subject_score END AS own_score,
    CASE WHEN subject_score IS NOT NULL THEN other_score END AS foil_score
FROM likelihood;

-- One row per run, judge model and prompt version that has games, scores or settings (an unavailable
-- likelihood method has settings with its `note` and no scores).
-- method: 'pairwise' or 'likelihood'; mode: probability, text or likelihood (NULL without settings).
-- margin: how far from even a verdict or a control must be: the largest |difference| among the null
-- documents, at least the run's margin_floor; text mode 0.25 (only both games agreeing is a verdict,
-- study.judge.scoring.TEXT_MARGIN); likelihood: twice the null differences' root mean square, at least
-- margin_floor (study.judge.likelihood_run.likelihood_margin); NULL without the run's settings. floor: the
-- null rung's tie band: margin_floor, text mode 0.25 (the pairwise null games calibrate the margin, so
-- judging them against it would pass them all by construction); likelihood: the margin, which a null
-- document outside the others' noise exceeds.
-- control_*: the easy rung; hard_*: the hard rung: documents answered and those whose difference exceeds
-- the margin. null_*: the null documents and those within the floor. control_accuracy, hard_accuracy,
-- null_ties: the shares. separation, separation_spread: the mean and sample standard deviation of the easy
-- differences. auc: over every pair of an easy control's own score and a foil score, the share where the
-- own one is higher, a tie counting half.
-- mean_difference, difference_low, difference_high: the mean main difference and its normal 95% interval
-- (± 1.96 standard errors). detectable: (1.96 + 0.84) standard errors, the smallest mean difference a run
-- of this size finds in 80% of runs at a two-sided 5% level (study.judge.reliability).
-- reliable: control_accuracy and null_ties both reached the run's threshold.
-- verdict: 'UNRELIABLE' unless reliable; then 'sidecar' or 'standalone' when the interval excludes 0, else
-- 'tie'. note: the settings' note.
CREATE VIEW judge_quality AS
WITH keys AS (
    SELECT run_id, task, judge_model, prompt_version, method FROM judge_documents
    UNION
    SELECT run_id, task, judge_model, prompt_version, CASE mode WHEN 'likelihood' THEN 'likelihood' ELSE 'pairwise' END
    FROM judge_settings
),
noise AS (
    SELECT
        k.run_id, k.task, k.judge_model, k.prompt_version, k.method,
        sum(d.answered_games) FILTER (WHERE d.kind = 'control') AS control_games,
        sum(d.first_shown) / nullif(sum(d.answered_games), 0) AS position_bias,
        max(abs(d.difference)) FILTER (WHERE d.kind = 'null') AS null_deviation,
        sqrt(avg(d.difference * d.difference) FILTER (WHERE d.kind = 'null')) AS null_rms,
        avg(d.difference) FILTER (WHERE d.kind = 'main') AS mean_difference,
        stddev_samp(d.difference) FILTER (WHERE d.kind = 'main')
            / sqrt(count(d.difference) FILTER (WHERE d.kind = 'main')) AS standard_error
    FROM keys AS k
    LEFT JOIN judge_documents AS d
        ON d.run_id = k.run_id AND d.task = k.task
            AND d.judge_model = k.judge_model AND d.prompt_version = k.prompt_version
        AND d.method = k.method
    GROUP BY k.run_id, k.task, k.judge_model, k.prompt_version, k.method
),
margins AS (
    SELECT
        n.*, s.mode, s.threshold, s.note,
        CASE s.mode
            WHEN 'text' THEN 0.25
            WHEN 'likelihood' THEN greatest(s.margin_floor, 2 * coalesce(n.null_rms, 0))
            ELSE greatest(s.margin_floor, coalesce(n.null_deviation, 0))
        END AS margin,
        CASE s.mode
            WHEN 'text' THEN 0.25
            WHEN 'likelihood' THEN greatest(s.margin_floor, 2 * coalesce(n.null_rms, 0))
            ELSE s.margin_floor
        END AS floor
    FROM noise AS n
    LEFT JOIN judge_settings AS s
        ON s.run_id = n.run_id AND s.task = n.task
            AND s.judge_model = n.judge_model AND s.prompt_version = n.prompt_version
),
rungs AS (
    SELECT
        m.run_id, m.task, m.judge_model, m.prompt_version,
        count(*) FILTER (WHERE d.kind = 'control') AS control_documents,
        count(*) FILTER (WHERE d.kind = 'control' AND d.difference > m.margin) AS control_cleared,
        count(*) FILTER (WHERE d.kind = 'hard') AS hard_documents,
        count(*) FILTER (WHERE d.kind = 'hard' AND d.difference > m.margin) AS hard_cleared,
        count(*) FILTER (WHERE d.kind = 'null') AS null_documents,
        count(*) FILTER (WHERE d.kind = 'null' AND abs(d.difference) <= m.floor) AS null_tied,
        avg(d.difference) FILTER (WHERE d.kind = 'control') AS separation,
        stddev_samp(d.difference) FILTER (WHERE d.kind = 'control') AS separation_spread
    FROM margins AS m
    JOIN judge_documents AS d
        ON d.run_id = m.run_id AND d.task = m.task
            AND d.judge_model = m.judge_model AND d.prompt_version = m.prompt_version
        AND d.method = m.method
    WHERE d.difference IS NOT NULL
    GROUP BY m.run_id, m.task, m.judge_model, m.prompt_version
),
controls AS (
    SELECT run_id, task, judge_model, prompt_version, own_score, foil_score
    FROM judge_documents
    WHERE kind = 'control' AND difference IS NOT NULL
),
ranked AS (
    SELECT
        a.run_id, a.task, a.judge_model, a.prompt_version,
        avg(CASE WHEN a.own_score > b.foil_score THEN 1.0 WHEN a.own_score = b.foil_score THEN 0.5 ELSE 0.0 END)
            AS auc
    FROM controls AS a
    JOIN controls AS b ON b.run_id = a.run_id AND b.task = a.task
        AND b.judge_model = a.judge_model AND b.prompt_version = a.prompt_version
    GROUP BY a.run_id, a.task, a.judge_model, a.prompt_version
),
quality AS (
    SELECT
        m.run_id, m.task, m.judge_model, m.prompt_version,
        m.method,
        m.mode,
        coalesce(m.control_games, 0) AS control_games,
        coalesce(r.control_documents, 0) AS control_documents,
        CASE WHEN m.margin IS NOT NULL THEN coalesce(r.control_cleared, 0) END AS control_cleared,
        CASE WHEN m.margin IS NOT NULL THEN r.control_cleared / nullif(r.control_documents, 0) END
            AS control_accuracy,
        coalesce(r.hard_documents, 0) AS hard_documents,
        CASE WHEN m.margin IS NOT NULL THEN coalesce(r.hard_cleared, 0) END AS hard_cleared,
        CASE WHEN m.margin IS NOT NULL THEN r.hard_cleared / nullif(r.hard_documents, 0) END AS hard_accuracy,
        coalesce(r.null_documents, 0) AS null_documents,
        CASE WHEN m.margin IS NOT NULL THEN coalesce(r.null_tied, 0) END AS null_tied,
        CASE WHEN m.margin IS NOT NULL THEN r.null_tied / nullif(r.null_documents, 0) END AS null_ties,
        r.separation,
        r.separation_spread,
        q.auc,
        m.position_bias,
        m.margin,
        m.floor,
        m.mean_difference,
        m.mean_difference - 1.96 * m.standard_error AS difference_low,
        m.mean_difference + 1.96 * m.standard_error AS difference_high,
        (1.96 + 0.84) * m.standard_error AS detectable,
        m.threshold,
        m.note
    FROM margins AS m
    LEFT JOIN rungs AS r ON r.run_id = m.run_id AND r.task = m.task
        AND r.judge_model = m.judge_model AND r.prompt_version = m.prompt_version
    LEFT JOIN ranked AS q ON q.run_id = m.run_id AND q.task = m.task
        AND q.judge_model = m.judge_model AND q.prompt_version = m.prompt_version
)
SELECT
    * EXCLUDE (note),
    coalesce(control_accuracy >= threshold AND null_ties >= threshold, false) AS reliable,
    CASE
        WHEN NOT coalesce(control_accuracy >= threshold AND null_ties >= threshold, false)
            OR difference_low IS NULL THEN 'UNRELIABLE'
        WHEN difference_low > 0 THEN 'sidecar'
        WHEN difference_high < 0 THEN 'standalone'
        ELSE 'tie'
    END AS verdict,
    note
FROM quality;

-- One row per run and task that has games or scores: its headline verdict, only from the methods judge_quality
-- trusts. trusted: those (method, judge model and prompt version); verdict: theirs when they agree, 'split'
-- when they do not, 'UNRELIABLE' when none is trusted.
CREATE VIEW judge_headline AS
SELECT
    run_id,
    task,
    coalesce(list(method || ' ' || judge_model || ' ' || prompt_version ORDER BY method, judge_model, prompt_version)
             FILTER (WHERE reliable), []) AS trusted,
    CASE
        WHEN NOT bool_or(reliable) THEN 'UNRELIABLE'
        WHEN count(DISTINCT verdict) FILTER (WHERE reliable) = 1 THEN any_value(verdict) FILTER (WHERE reliable)
        ELSE 'split'
    END AS verdict
FROM judge_quality
GROUP BY run_id, task;

-- Final verdict per run, document, judge and prompt version. pairwise, from the two position-swapped main
-- games as in 003: text mode, a win only when both games agree, any disagreement a tie; probability mode,
-- `preference` decides, a tie within the run's calibrated `margin` of 0.5. likelihood: `difference` (the
-- sidecar's score less the standalone's, nats per token) decides, a tie within the margin; the game
-- columns are NULL. The verdict stays NULL until the document is fully answered or scored; `reliable` is
-- the run's judge_quality.reliable, false when the method failed its controls.
CREATE VIEW judgements AS
WITH games AS (
    SELECT
        run_id, task, doc_id, judge_model, prompt_version,
        any_value(mode_a) FILTER (WHERE game = 1) AS mode_a,
        any_value(mode_b) FILTER (WHERE game = 1) AS mode_b,
        any_value(winner) FILTER (WHERE game = 1) AS game1_winner,
        any_value(winner) FILTER (WHERE game = 2) AS game2_winner,
        count(error) AS errors,
        max(created_at) AS judged_at
    FROM judgement_games
    WHERE kind = 'main'
    GROUP BY run_id, task, doc_id, judge_model, prompt_version
),
scores AS (
    SELECT run_id, task, doc_id, judge_model, prompt_version, count(error) AS errors, max(created_at) AS judged_at
    FROM judgement_scores
    WHERE kind = 'main'
    GROUP BY run_id, task, doc_id, judge_model, prompt_version
)
SELECT
    g.run_id, g.task, g.doc_id, g.judge_model, g.prompt_version, 'pairwise' AS method,
    g.mode_a, g.mode_b, g.game1_winner, g.game2_winner,
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
    d.difference,
    coalesce(q.reliable, false) AS reliable
FROM games AS g
LEFT JOIN judge_documents AS d
    ON d.run_id = g.run_id AND d.task = g.task AND d.doc_id = g.doc_id AND d.judge_model = g.judge_model
    AND d.prompt_version = g.prompt_version AND d.kind = 'main' AND d.method = 'pairwise'
LEFT JOIN judge_quality AS q
    ON q.run_id = g.run_id AND q.task = g.task
        AND q.judge_model = g.judge_model AND q.prompt_version = g.prompt_version
UNION ALL
SELECT
    s.run_id, s.task, s.doc_id, s.judge_model, s.prompt_version, 'likelihood' AS method,
    NULL, NULL, NULL, NULL,
    CASE
        WHEN d.difference IS NULL OR q.margin IS NULL THEN NULL
        WHEN d.difference > q.margin THEN 'sidecar'
        WHEN d.difference < -q.margin THEN 'standalone'
        ELSE 'tie'
    END AS verdict,
    false AS consistent,
    s.errors,
    s.judged_at,
    NULL AS preference,
    d.difference,
    coalesce(q.reliable, false) AS reliable
FROM scores AS s
LEFT JOIN judge_documents AS d
    ON d.run_id = s.run_id AND d.task = s.task AND d.doc_id = s.doc_id AND d.judge_model = s.judge_model
    AND d.prompt_version = s.prompt_version AND d.kind = 'main' AND d.method = 'likelihood'
LEFT JOIN judge_quality AS q
    ON q.run_id = s.run_id AND q.task = s.task
        AND q.judge_model = s.judge_model AND q.prompt_version = s.prompt_version;

-- One row per run and sidecar task the judge looked at (judge_tasks) or has games, scores or settings for.
-- status: 'not judged' (reason: why the judge cannot score it, or that nothing of it is stored yet),
-- 'unreliable' (no method is trusted; reason: each method's easy and null rungs against its threshold, or its
-- note) or 'judged' (verdict: judge_headline's, from the trusted methods: 'sidecar', 'standalone', 'tie' or
-- 'split'; trusted: those methods). A task not judged is no verdict, and not an unreliable one.
CREATE VIEW judge_verdicts AS
WITH tasks AS (
    SELECT run_id, task FROM judge_tasks
    UNION
    SELECT run_id, task FROM judge_quality
),
failures AS (
    SELECT
        run_id, task,
        string_agg(method || ' ' || judge_model || ' ' || prompt_version || ': ' || CASE
            WHEN control_documents = 0 AND note IS NOT NULL THEN note
            WHEN control_documents = 0 THEN 'no control answered'
            ELSE 'easy ' || coalesce(control_cleared, 0) || '/' || control_documents || ', null '
                 || coalesce(null_tied, 0) || '/' || null_documents || ' (threshold ' || threshold || ')'
        END, '; ' ORDER BY method, judge_model, prompt_version) AS reasons
    FROM judge_quality
    WHERE NOT reliable
    GROUP BY run_id, task
)
SELECT
    t.run_id,
    t.task,
    CASE
        WHEN j.not_judged IS NOT NULL OR h.verdict IS NULL THEN 'not judged'
        WHEN h.verdict = 'UNRELIABLE' THEN 'unreliable'
        ELSE 'judged'
    END AS status,
    CASE WHEN j.not_judged IS NULL AND h.verdict <> 'UNRELIABLE' THEN h.verdict END AS verdict,
    coalesce(h.trusted, []) AS trusted,
    CASE
        WHEN j.not_judged IS NOT NULL THEN j.not_judged
        WHEN h.verdict IS NULL THEN 'nothing of it is judged yet'
        WHEN h.verdict = 'UNRELIABLE' THEN f.reasons
    END AS reason,
    j.instruction
FROM tasks AS t
LEFT JOIN judge_tasks AS j ON j.run_id = t.run_id AND j.task = t.task
LEFT JOIN judge_headline AS h ON h.run_id = t.run_id AND h.task = t.task
LEFT JOIN failures AS f ON f.run_id = t.run_id AND f.task = t.task;
