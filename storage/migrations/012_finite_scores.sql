-- 012_finite_scores: a likelihood score or a game's probability that is not finite counts as missing in
-- judge_documents (and so in judge_quality, judge_headline and judgements), never as a number. The judge
-- refuses such values where it reads them (vocab.numbers, study.judge.answers.Logprob) and the records
-- refuse them before they are stored, but a file written by another client, or before this check, may
-- hold an infinite given_own (CHECK given_own <= 1e-6 lets -Infinity in): -Infinity less -Infinity is
-- NaN, and NaN compared with a margin in SQL marked documents standalone-preferred. Only the view changes:
-- the views built on it read it by name.

CREATE OR REPLACE VIEW judge_documents AS
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
        any_value(given_own - given_baseline)
            FILTER (WHERE side IN ('sidecar', 'own', 'original') AND isfinite(given_own - given_baseline))
            AS subject_score,
        any_value(given_own - given_baseline)
            FILTER (WHERE side NOT IN ('sidecar', 'own', 'original') AND isfinite(given_own - given_baseline))
            AS other_score
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
