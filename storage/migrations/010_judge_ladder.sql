-- 010_judge_ladder: a control counts as right only when it clears the run's margin (003 counted any
-- preference above 0.5 + 1e-9, so a judge whose controls all sat inside its own noise was called reliable),
-- and the controls become a ladder (study.judge.controls): easy (kind `control`, another document's tags),
-- `hard` (the own tags with about half replaced by another document's: sides 'own' and 'mixed', the foil
-- in foil_doc_id) and `null` (the same tags reversed: it must tie). A method is trusted for a run when its
-- easy rung cleared the margin and its null rung tied, each in at least the run's threshold of documents;
-- the run's verdict comes only from a trusted method, else it is UNRELIABLE. judge_quality also gains the
-- controls' separation, the AUC of own against foil scores and the smallest detectable difference. A
-- document's difference is its preference less 0.5. `kind` gains 'hard' in a CHECK, which DuckDB cannot
-- change in place: the table is rebuilt with its rows.

DROP VIEW judgements;
DROP VIEW judge_quality;
DROP VIEW judge_documents;

CREATE TEMPORARY TABLE judgement_games_009 AS SELECT * FROM judgement_games;
DROP TABLE judgement_games;

CREATE TABLE judgement_games (
    run_id         VARCHAR NOT NULL,
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
    -- the document whose sidecar tags a control game shows as 'other', or mixes in as 'mixed'
    foil_doc_id    VARCHAR,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK (winner IS NULL OR winner IN (mode_a, mode_b, 'tie')),
    CHECK ((kind IN ('control', 'hard')) = (foil_doc_id IS NOT NULL)),
    PRIMARY KEY (run_id, doc_id, judge_model, prompt_version, kind, game)
);

INSERT INTO judgement_games SELECT * FROM judgement_games_009;
DROP TABLE judgement_games_009;

-- As in 003, with the hard rung's subject: the own tags.
CREATE VIEW judge_documents AS
WITH games AS (
    SELECT
        *,
        CASE kind WHEN 'main' THEN 'sidecar' WHEN 'null' THEN 'original' ELSE 'own' END AS subject,
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

-- One row per run, judge model and prompt version that has games.
-- margin: how far from 0.5 a verdict or a control must be: probability mode, the largest deviation from
-- 0.5 among the null documents, at least the run's margin_floor; text mode 0.25 (only both games agreeing
-- is a verdict, study.judge.scoring.TEXT_MARGIN); NULL without the run's settings. floor: the null rung's
-- tie band: margin_floor, text mode 0.25 (the null games calibrate the margin, so judging them against it
-- would pass them all by construction).
-- control_*: the easy rung; hard_*: the hard rung: documents answered and those whose difference exceeds
-- the margin. null_*: the null documents and those within the floor. control_accuracy, hard_accuracy,
-- null_ties: the shares. separation, separation_spread: the mean and sample standard deviation of the easy
-- differences. auc: over every pair of an own score (an easy control's preference) and a foil score
-- (1 - preference), the share where the own one is higher, a tie counting half.
-- mean_difference, difference_low, difference_high: the mean main difference and its normal 95% interval
-- (± 1.96 standard errors). detectable: (1.96 + 0.84) standard errors, the smallest mean difference a run
-- of this size finds in 80% of runs at a two-sided 5% level (study.judge.reliability).
-- reliable: control_accuracy and null_ties both reached the run's threshold.
-- verdict: 'UNRELIABLE' unless reliable; then 'sidecar' or 'standalone' when the interval excludes 0, else
-- 'tie'.
CREATE VIEW judge_quality AS
WITH per_doc AS (
    SELECT *, coalesce(preference, text_preference) AS score_basis FROM judge_documents
),
noise AS (
    SELECT
        run_id, judge_model, prompt_version,
        sum(answered_games) FILTER (WHERE kind = 'control') AS control_games,
        sum(first_shown) / nullif(sum(answered_games), 0) AS position_bias,
        max(abs(preference - 0.5)) FILTER (WHERE kind = 'null') AS null_deviation,
        avg(score_basis - 0.5) FILTER (WHERE kind = 'main') AS mean_difference,
        stddev_samp(score_basis - 0.5) FILTER (WHERE kind = 'main')
            / sqrt(count(score_basis) FILTER (WHERE kind = 'main')) AS standard_error
    FROM per_doc
    GROUP BY run_id, judge_model, prompt_version
),
margins AS (
    SELECT
        n.*, s.mode, s.threshold,
        CASE s.mode WHEN 'probability' THEN greatest(s.margin_floor, coalesce(n.null_deviation, 0))
                    WHEN 'text' THEN 0.25 END AS margin,
        CASE s.mode WHEN 'probability' THEN s.margin_floor WHEN 'text' THEN 0.25 END AS floor
    FROM noise AS n
    LEFT JOIN judge_settings AS s
        ON s.run_id = n.run_id AND s.judge_model = n.judge_model AND s.prompt_version = n.prompt_version
),
rungs AS (
    SELECT
        m.run_id, m.judge_model, m.prompt_version,
        count(d.score_basis) FILTER (WHERE d.kind = 'control') AS control_documents,
        count(*) FILTER (WHERE d.kind = 'control' AND d.score_basis - 0.5 > m.margin) AS control_cleared,
        count(d.score_basis) FILTER (WHERE d.kind = 'hard') AS hard_documents,
        count(*) FILTER (WHERE d.kind = 'hard' AND d.score_basis - 0.5 > m.margin) AS hard_cleared,
        count(d.score_basis) FILTER (WHERE d.kind = 'null') AS null_documents,
        count(*) FILTER (WHERE d.kind = 'null' AND abs(d.score_basis - 0.5) <= m.floor) AS null_tied,
        avg(d.score_basis - 0.5) FILTER (WHERE d.kind = 'control') AS separation,
        stddev_samp(d.score_basis - 0.5) FILTER (WHERE d.kind = 'control') AS separation_spread
    FROM margins AS m
    JOIN per_doc AS d ON d.run_id = m.run_id AND d.judge_model = m.judge_model AND d.prompt_version = m.prompt_version
    WHERE d.score_basis IS NOT NULL
    GROUP BY m.run_id, m.judge_model, m.prompt_version
),
controls AS (
    SELECT run_id, judge_model, prompt_version, score_basis AS own_score, 1 - score_basis AS foil_score
    FROM per_doc
    WHERE kind = 'control' AND score_basis IS NOT NULL
),
ranked AS (
    SELECT
        a.run_id, a.judge_model, a.prompt_version,
        avg(CASE WHEN a.own_score > b.foil_score THEN 1.0 WHEN a.own_score = b.foil_score THEN 0.5 ELSE 0.0 END)
            AS auc
    FROM controls AS a
    JOIN controls AS b ON b.run_id = a.run_id AND b.judge_model = a.judge_model AND b.prompt_version = a.prompt_version
    GROUP BY a.run_id, a.judge_model, a.prompt_version
),
quality AS (
    SELECT
        m.run_id, m.judge_model, m.prompt_version,
        m.mode,
        coalesce(m.control_games, 0) AS control_games,
        coalesce(r.control_documents, 0) AS control_documents,
        CASE WHEN m.margin IS NOT NULL THEN r.control_cleared END AS control_cleared,
        CASE WHEN m.margin IS NOT NULL THEN r.control_cleared / nullif(r.control_documents, 0) END
            AS control_accuracy,
        coalesce(r.hard_documents, 0) AS hard_documents,
        CASE WHEN m.margin IS NOT NULL THEN r.hard_cleared END AS hard_cleared,
        CASE WHEN m.margin IS NOT NULL THEN r.hard_cleared / nullif(r.hard_documents, 0) END AS hard_accuracy,
        coalesce(r.null_documents, 0) AS null_documents,
        CASE WHEN m.margin IS NOT NULL THEN r.null_tied END AS null_tied,
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
        m.threshold
    FROM margins AS m
    LEFT JOIN rungs AS r ON r.run_id = m.run_id AND r.judge_model = m.judge_model AND r.prompt_version = m.prompt_version
    LEFT JOIN ranked AS q ON q.run_id = m.run_id AND q.judge_model = m.judge_model AND q.prompt_version = m.prompt_version
)
SELECT
    *,
    coalesce(control_accuracy >= threshold AND null_ties >= threshold, false) AS reliable,
    CASE
        WHEN NOT coalesce(control_accuracy >= threshold AND null_ties >= threshold, false)
            OR difference_low IS NULL THEN 'UNRELIABLE'
        WHEN difference_low > 0 THEN 'sidecar'
        WHEN difference_high < 0 THEN 'standalone'
        ELSE 'tie'
    END AS verdict
FROM quality;

-- One row per run that has games: its headline verdict, only from the methods judge_quality trusts.
-- trusted: those methods (judge model and prompt version); verdict: theirs when they agree, 'split' when
-- they do not, 'UNRELIABLE' when none is trusted.
CREATE VIEW judge_headline AS
SELECT
    run_id,
    coalesce(list(judge_model || ' ' || prompt_version ORDER BY judge_model, prompt_version)
             FILTER (WHERE reliable), []) AS trusted,
    CASE
        WHEN NOT bool_or(reliable) THEN 'UNRELIABLE'
        WHEN count(DISTINCT verdict) FILTER (WHERE reliable) = 1 THEN any_value(verdict) FILTER (WHERE reliable)
        ELSE 'split'
    END AS verdict
FROM judge_quality
GROUP BY run_id;

-- As in 003, reading the new judge_quality.
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
