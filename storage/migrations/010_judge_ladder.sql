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
-- A second method, likelihood (study.judge.likelihood_run), stores its scores in judgement_scores; the
-- views carry each row's `method` ('pairwise' for the games, 'likelihood' for the scores), and
-- judge_settings gains the mode 'likelihood' and a `note` (why a mode was chosen, or why a method gave no
-- scores), rebuilt for its CHECKs as judgement_games is.

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

CREATE TEMPORARY TABLE judge_settings_009 AS SELECT * FROM judge_settings;
DROP TABLE judge_settings;

-- What a judge flow read its run's verdicts with. mode: 'probability' or 'text' (the pairwise method's
-- answers) or 'likelihood'; threshold: the share of easy controls clearing the margin and of null
-- controls tying below which the verdicts are UNRELIABLE; margin_floor: the least margin (probability: of
-- a preference from 0.5; likelihood: nats per token), NULL in the text mode; note: why.
CREATE TABLE judge_settings (
    run_id         VARCHAR NOT NULL,
    judge_model    VARCHAR NOT NULL,
    prompt_version VARCHAR NOT NULL,
    mode           VARCHAR NOT NULL CHECK (mode IN ('probability', 'text', 'likelihood')),
    threshold      DOUBLE NOT NULL CHECK (threshold BETWEEN 0 AND 1),
    margin_floor   DOUBLE CHECK (margin_floor >= 0),
    note           VARCHAR,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    CHECK ((mode = 'text') = (margin_floor IS NULL)),
    PRIMARY KEY (run_id, judge_model, prompt_version)
);

INSERT INTO judge_settings (run_id, judge_model, prompt_version, mode, threshold, margin_floor, created_at)
SELECT run_id, judge_model, prompt_version, mode, threshold, margin_floor, created_at FROM judge_settings_009;
DROP TABLE judge_settings_009;

-- One tag set of a document scored by the likelihood method (study.judge.likelihood): the mean log
-- probability per token of its tags after the scorer prompt `prompt_version` holding the document's
-- summary (given_own) and holding baseline_doc_id's summary (given_baseline), by judge_model; their
-- difference is the set's pointwise mutual information with the summary. side: the kind's subject or
-- other side, named as in a game ('sidecar'/'standalone', 'own'/'other', 'own'/'mixed',
-- 'original'/'reversed'); foil_doc_id as in a game.
CREATE TABLE judgement_scores (
    run_id          VARCHAR NOT NULL,
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
    PRIMARY KEY (run_id, doc_id, judge_model, prompt_version, kind, side)
);

-- Per run, document, judge, prompt version and kind, in both methods. pairwise (as in 003, the hard rung's
-- subject being the own tags): `preference` for the kind's subject side averaged over the two
-- position-swapped games (probability mode; `text_preference` in the text mode), NULL until both games
-- have an answer. likelihood: `subject_score` and `other_score`, the two sides' PMI (given_own less
-- given_baseline), NULL until both sides are scored. For both: `difference`, the preference less 0.5 or
-- the subject's score less the other's, and `own_score` / `foil_score`, what an AUC ranks (pairwise: the
-- preference and 1 - preference).
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
),
pairwise AS (
    SELECT
        run_id, doc_id, judge_model, prompt_version, kind,
        any_value(foil_doc_id) AS foil_doc_id,
        CASE WHEN count(p_subject) = 2 THEN avg(p_subject) END AS preference,
        CASE WHEN count(text_subject) = 2 THEN avg(text_subject) END AS text_preference,
        count(first_shown) AS answered_games,
        sum(first_shown) AS first_shown
    FROM scored
    GROUP BY run_id, doc_id, judge_model, prompt_version, kind
),
likelihood AS (
    SELECT
        run_id, doc_id, judge_model, prompt_version, kind,
        any_value(foil_doc_id) AS foil_doc_id,
        any_value(given_own - given_baseline) FILTER (WHERE side IN ('sidecar', 'own', 'original')) AS subject_score,
        any_value(given_own - given_baseline) FILTER (WHERE side NOT IN ('sidecar', 'own', 'original')) AS other_score
    FROM judgement_scores
    GROUP BY run_id, doc_id, judge_model, prompt_version, kind
)
SELECT
    run_id, doc_id, judge_model, prompt_version, 'pairwise' AS method, kind, foil_doc_id,
    preference, text_preference, answered_games, first_shown,
    NULL::DOUBLE AS subject_score, NULL::DOUBLE AS other_score,
    coalesce(preference, text_preference) - 0.5 AS difference,
    coalesce(preference, text_preference) AS own_score,
    1 - coalesce(preference, text_preference) AS foil_score
FROM pairwise
UNION ALL
SELECT
    run_id, doc_id, judge_model, prompt_version, 'likelihood' AS method, kind, foil_doc_id,
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
    SELECT run_id, judge_model, prompt_version, method FROM judge_documents
    UNION
    SELECT run_id, judge_model, prompt_version, CASE mode WHEN 'likelihood' THEN 'likelihood' ELSE 'pairwise' END
    FROM judge_settings
),
noise AS (
    SELECT
        k.run_id, k.judge_model, k.prompt_version, k.method,
        sum(d.answered_games) FILTER (WHERE d.kind = 'control') AS control_games,
        sum(d.first_shown) / nullif(sum(d.answered_games), 0) AS position_bias,
        max(abs(d.difference)) FILTER (WHERE d.kind = 'null') AS null_deviation,
        sqrt(avg(d.difference * d.difference) FILTER (WHERE d.kind = 'null')) AS null_rms,
        avg(d.difference) FILTER (WHERE d.kind = 'main') AS mean_difference,
        stddev_samp(d.difference) FILTER (WHERE d.kind = 'main')
            / sqrt(count(d.difference) FILTER (WHERE d.kind = 'main')) AS standard_error
    FROM keys AS k
    LEFT JOIN judge_documents AS d
        ON d.run_id = k.run_id AND d.judge_model = k.judge_model AND d.prompt_version = k.prompt_version
        AND d.method = k.method
    GROUP BY k.run_id, k.judge_model, k.prompt_version, k.method
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
        ON s.run_id = n.run_id AND s.judge_model = n.judge_model AND s.prompt_version = n.prompt_version
),
rungs AS (
    SELECT
        m.run_id, m.judge_model, m.prompt_version,
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
        ON d.run_id = m.run_id AND d.judge_model = m.judge_model AND d.prompt_version = m.prompt_version
        AND d.method = m.method
    WHERE d.difference IS NOT NULL
    GROUP BY m.run_id, m.judge_model, m.prompt_version
),
controls AS (
    SELECT run_id, judge_model, prompt_version, own_score, foil_score
    FROM judge_documents
    WHERE kind = 'control' AND difference IS NOT NULL
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
    LEFT JOIN rungs AS r ON r.run_id = m.run_id AND r.judge_model = m.judge_model AND r.prompt_version = m.prompt_version
    LEFT JOIN ranked AS q ON q.run_id = m.run_id AND q.judge_model = m.judge_model AND q.prompt_version = m.prompt_version
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

-- One row per run that has games or scores: its headline verdict, only from the methods judge_quality
-- trusts. trusted: those (method, judge model and prompt version); verdict: theirs when they agree, 'split'
-- when they do not, 'UNRELIABLE' when none is trusted.
CREATE VIEW judge_headline AS
SELECT
    run_id,
    coalesce(list(method || ' ' || judge_model || ' ' || prompt_version ORDER BY method, judge_model, prompt_version)
             FILTER (WHERE reliable), []) AS trusted,
    CASE
        WHEN NOT bool_or(reliable) THEN 'UNRELIABLE'
        WHEN count(DISTINCT verdict) FILTER (WHERE reliable) = 1 THEN any_value(verdict) FILTER (WHERE reliable)
        ELSE 'split'
    END AS verdict
FROM judge_quality
GROUP BY run_id;

-- Final verdict per run, document, judge and prompt version. pairwise, from the two position-swapped main
-- games as in 003: text mode, a win only when both games agree, any disagreement a tie; probability mode,
-- `preference` decides, a tie within the run's calibrated `margin` of 0.5. likelihood: `difference` (the
-- sidecar's score less the standalone's, nats per token) decides, a tie within the margin; the game
-- columns are NULL. The verdict stays NULL until the document is fully answered or scored; `reliable` is
-- the run's judge_quality.reliable, false when the method failed its controls.
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
),
scores AS (
    SELECT run_id, doc_id, judge_model, prompt_version, count(error) AS errors, max(created_at) AS judged_at
    FROM judgement_scores
    WHERE kind = 'main'
    GROUP BY run_id, doc_id, judge_model, prompt_version
)
SELECT
    g.run_id, g.doc_id, g.judge_model, g.prompt_version, 'pairwise' AS method,
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
    ON d.run_id = g.run_id AND d.doc_id = g.doc_id AND d.judge_model = g.judge_model
    AND d.prompt_version = g.prompt_version AND d.kind = 'main' AND d.method = 'pairwise'
LEFT JOIN judge_quality AS q
    ON q.run_id = g.run_id AND q.judge_model = g.judge_model AND q.prompt_version = g.prompt_version
UNION ALL
SELECT
    s.run_id, s.doc_id, s.judge_model, s.prompt_version, 'likelihood' AS method,
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
    ON d.run_id = s.run_id AND d.doc_id = s.doc_id AND d.judge_model = s.judge_model
    AND d.prompt_version = s.prompt_version AND d.kind = 'main' AND d.method = 'likelihood'
LEFT JOIN judge_quality AS q
    ON q.run_id = s.run_id AND q.judge_model = s.judge_model AND q.prompt_version = s.prompt_version;
