-- 016_cudagraph_skips: each model's capture counters gain cudagraph_skips (sidecar.runtime.capture): in cudagraph
-- mode, graphs inductor compiled but left uncaptured (an input mutated without a static address, a CPU tensor, a
-- re-record limit), which run at compile mode's speed under cudagraph's name. Summed over a resume's starts like
-- the forwards; counters recorded before this migration have none (NULL in the view).
--
-- `run_captures` is recreated with `cudagraph_skips`, and `faults` counts them beside recompiles and graph breaks:
-- all three must be 0.

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
        CAST(sum(CAST(c ->> 'cudagraph_skips' AS BIGINT)) AS BIGINT) AS cudagraph_skips,
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
    s.compile_seconds, s.graph_bytes, s.cudagraph_skips,
    coalesce(s.recompiles, 0) + coalesce(s.graph_breaks, 0) + coalesce(s.cudagraph_skips, 0) AS faults,
    t.steps, t.syncs,
    CASE WHEN t.steps > 0 THEN t.syncs / t.steps END AS syncs_per_step,
    CASE WHEN t.steps > 0 THEN (t.step_seconds - t.read_seconds) * 1000 / t.steps END AS host_ms_per_step
FROM runs AS r
LEFT JOIN modes AS m ON m.run_id = r.run_id
LEFT JOIN summed AS s ON s.run_id = r.run_id
LEFT JOIN stepped AS t ON t.run_id = r.run_id;
