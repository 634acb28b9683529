-- 015_run_steps: what a run's decoding steps cost the host (sidecar.runtime.step_counters), beside its capture
-- counters (014): `capture_counters` gains a "steps" entry, not a model, with steps, syncs (reads of device
-- values a step made: a GPU waits at each), step_seconds and read_seconds (host time = step less reads),
-- summed over a resume's starts like the forwards. Runs recorded before this migration have no entry: NULL.
--
-- Each model's counters gain graph_calls (calls of its compiled forward: a chain of draft forwards is one) and
-- chained_forwards (forwards run inside such chains), summed like its forwards.
--
-- `run_captures` is recreated: its model sums skip "steps" and add graph_calls and chained_forwards, and it gains
-- steps, syncs, syncs_per_step and host_ms_per_step (per step: step wall time less the time in reads, in ms).

DROP VIEW run_captures;

CREATE VIEW run_captures AS
WITH recorded AS (
    SELECT run_id, capture, capture_counters AS counters FROM runs
    UNION ALL
    SELECT run_id, capture, capture_counters FROM shard_attempts
),
models AS (
    SELECT run_id, counters, unnest(json_keys(counters)) AS model
    FROM recorded
    WHERE counters IS NOT NULL
),
per_model AS (
    SELECT run_id, CAST(json_extract(counters, '$."' || model || '"') AS JSON) AS c FROM models
    WHERE model <> 'steps'
),
summed AS (
    SELECT
        run_id,
        CAST(sum(CAST(c ->> 'compiles' AS BIGINT)) AS BIGINT) AS compiles,
        CAST(sum(CAST(c ->> 'recompiles' AS BIGINT)) AS BIGINT) AS recompiles,
        CAST(sum(CAST(c ->> 'graph_breaks' AS BIGINT)) AS BIGINT) AS graph_breaks,
        CAST(sum(CAST(c ->> 'forwards' AS BIGINT)) AS BIGINT) AS forwards,
        CAST(sum(CAST(c ->> 'graph_calls' AS BIGINT)) AS BIGINT) AS graph_calls,
        CAST(sum(CAST(c ->> 'chained_forwards' AS BIGINT)) AS BIGINT) AS chained_forwards,
        max(CAST(c ->> 'distinct_shapes' AS BIGINT)) AS distinct_shapes,
        sum(CAST(c ->> 'compile_seconds' AS DOUBLE)) AS compile_seconds,
        max(CAST(c ->> 'graph_bytes' AS BIGINT)) AS graph_bytes
    FROM per_model
    GROUP BY run_id
),
stepped AS (
    SELECT
        run_id,
        CAST(sum(CAST(json_extract_string(counters, '$.steps.steps') AS BIGINT)) AS BIGINT) AS steps,
        CAST(sum(CAST(json_extract_string(counters, '$.steps.syncs') AS BIGINT)) AS BIGINT) AS syncs,
        sum(CAST(json_extract_string(counters, '$.steps.step_seconds') AS DOUBLE)) AS step_seconds,
        sum(CAST(json_extract_string(counters, '$.steps.read_seconds') AS DOUBLE)) AS read_seconds
    FROM recorded
    WHERE json_extract(counters, '$.steps') IS NOT NULL
    GROUP BY run_id
),
modes AS (
    SELECT run_id, string_agg(DISTINCT capture, '; ' ORDER BY capture) AS capture,
           count(counters) AS recorded
    FROM recorded
    GROUP BY run_id
)
SELECT
    r.run_id,
    -- the run's own, else its shards' (several where attempts ran in different modes)
    coalesce(r.capture, m.capture) AS capture,
    m.recorded,
    s.compiles, s.recompiles, s.graph_breaks, s.forwards, s.graph_calls, s.chained_forwards, s.distinct_shapes,
    s.compile_seconds, s.graph_bytes,
    coalesce(s.recompiles, 0) + coalesce(s.graph_breaks, 0) AS faults,
    t.steps, t.syncs,
    CASE WHEN t.steps > 0 THEN t.syncs / t.steps END AS syncs_per_step,
    CASE WHEN t.steps > 0 THEN (t.step_seconds - t.read_seconds) * 1000 / t.steps END AS host_ms_per_step
FROM runs AS r
LEFT JOIN modes AS m ON m.run_id = r.run_id
LEFT JOIN summed AS s ON s.run_id = r.run_id
LEFT JOIN stepped AS t ON t.run_id = r.run_id;
