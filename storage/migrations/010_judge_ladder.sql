-- 010_judge_ladder: a control counts as right only when it clears the run's margin (003 counted any
-- preference above 0.5 + 1e-9, so a judge whose controls all sat inside its own noise was called reliable).
-- judge_quality gains the controls' separation (mean and spread of their differences), the share that
-- cleared the margin, the AUC of own against foil scores and the smallest mean sidecar-vs-standalone
-- difference the run could detect. A document's difference is its preference less 0.5.

DROP VIEW judgements;
DROP VIEW judge_quality;

-- One row per run, judge model and prompt version that has games.
-- margin: how far from 0.5 a verdict or a control must be: probability mode, the largest deviation from
-- 0.5 among the null documents, at least the run's margin_floor; text mode 0.25 (only both games agreeing
-- is a verdict, study.judge.scoring.TEXT_MARGIN); NULL without the run's settings.
-- control_cleared / control_accuracy: the control documents whose difference exceeds the margin, and their
-- share of the answered controls. separation, separation_spread: the mean and sample standard deviation
-- of the control differences. auc: over every pair of an own score (the control's preference) and a foil
-- score (1 - preference), the share where the own one is higher, a tie counting half.
-- detectable: (1.96 + 0.84) * the standard error of the mean main difference, the smallest mean difference
-- a run of this size finds in 80% of runs at a two-sided 5% level (study.judge.reliability).
-- reliable: control_accuracy reached the run's threshold; a run without control games is never reliable.
CREATE VIEW judge_quality AS
WITH per_doc AS (
    SELECT *, coalesce(preference, text_preference) AS score_basis FROM judge_documents
),
noise AS (
    SELECT
        run_id, judge_model, prompt_version,
        sum(answered_games) FILTER (WHERE kind = 'control') AS control_games,
        sum(first_shown) / nullif(sum(answered_games), 0) AS position_bias,
        count(preference) FILTER (WHERE kind = 'null') AS null_documents,
        max(abs(preference - 0.5)) FILTER (WHERE kind = 'null') AS null_deviation,
        (1.96 + 0.84) * stddev_samp(score_basis - 0.5) FILTER (WHERE kind = 'main')
            / sqrt(count(score_basis) FILTER (WHERE kind = 'main')) AS detectable
    FROM per_doc
    GROUP BY run_id, judge_model, prompt_version
),
margins AS (
    SELECT
        n.*, s.mode, s.threshold,
        CASE s.mode WHEN 'probability' THEN greatest(s.margin_floor, coalesce(n.null_deviation, 0))
                    WHEN 'text' THEN 0.25 END AS margin
    FROM noise AS n
    LEFT JOIN judge_settings AS s
        ON s.run_id = n.run_id AND s.judge_model = n.judge_model AND s.prompt_version = n.prompt_version
),
controls AS (
    SELECT run_id, judge_model, prompt_version, score_basis AS own_score, 1 - score_basis AS foil_score
    FROM per_doc
    WHERE kind = 'control' AND score_basis IS NOT NULL
),
cleared AS (
    SELECT
        m.run_id, m.judge_model, m.prompt_version,
        count(c.own_score) AS control_documents,
        count(*) FILTER (WHERE c.own_score - 0.5 > m.margin) AS control_cleared,
        avg(c.own_score - 0.5) AS separation,
        stddev_samp(c.own_score - 0.5) AS separation_spread
    FROM margins AS m
    JOIN controls AS c ON c.run_id = m.run_id AND c.judge_model = m.judge_model AND c.prompt_version = m.prompt_version
    GROUP BY m.run_id, m.judge_model, m.prompt_version
),
ranked AS (
    SELECT
        a.run_id, a.judge_model, a.prompt_version,
        avg(CASE WHEN a.own_score > b.foil_score THEN 1.0 WHEN a.own_score = b.foil_score THEN 0.5 ELSE 0.0 END)
            AS auc
    FROM controls AS a
    JOIN controls AS b ON b.run_id = a.run_id AND b.judge_model = a.judge_model AND b.prompt_version = a.prompt_version
    GROUP BY a.run_id, a.judge_model, a.prompt_version
)
SELECT
    m.run_id, m.judge_model, m.prompt_version,
    m.mode,
    coalesce(m.control_games, 0) AS control_games,
    coalesce(c.control_documents, 0) AS control_documents,
    CASE WHEN m.margin IS NOT NULL THEN c.control_cleared END AS control_cleared,
    CASE WHEN m.margin IS NOT NULL THEN c.control_cleared / c.control_documents END AS control_accuracy,
    c.separation,
    c.separation_spread,
    r.auc,
    m.position_bias,
    m.null_documents,
    m.margin,
    m.detectable,
    m.threshold,
    coalesce(c.control_cleared / c.control_documents >= m.threshold AND m.margin IS NOT NULL, false) AS reliable
FROM margins AS m
LEFT JOIN cleared AS c ON c.run_id = m.run_id AND c.judge_model = m.judge_model AND c.prompt_version = m.prompt_version
LEFT JOIN ranked AS r ON r.run_id = m.run_id AND r.judge_model = m.judge_model AND r.prompt_version = m.prompt_version;

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
