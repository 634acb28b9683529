-- 014_run_capture: how a run's decode forwards ran (sidecar.runtime.capture), beside its dtype (009).
-- `capture` is the mode and why ("eager (auto: CPU, eager ...)", "hf (SIDECAR_CAPTURE=hf)";
-- ModelPair.capture_report), recorded at the run's first start like its dtype: NULL for a sharded run's
-- parent and for runs created before this migration. `capture_counters` is JSON, per model ("target",
-- "draft"; {} in hf mode, which keeps none): compiles, recompiles, graph_breaks, forwards, distinct_shapes,
-- compile_seconds, graph_bytes (sidecar.decoding.decoder.capture_stats). A run's own process records them
-- when its decoding ends; a resume adds its own process's (counts and seconds summed, distinct_shapes and
-- graph_bytes their largest), so no forward counts twice. A shard attempt's come from its part files, each
-- part carrying the attempt's mode and counters so far (`ingested_parts`, as its host and device): the attempt
-- keeps its latest part's. Parts written before this migration carry none (NULL).
--
-- `run_captures`: per run, its mode(s) and counters summed over its models, its own starts and its shard
-- attempts. Recompiles after warm-up and graph breaks must be 0: `faults` counts both.

ALTER TABLE runs ADD COLUMN capture VARCHAR;
ALTER TABLE runs ADD COLUMN capture_counters JSON;
ALTER TABLE shard_attempts ADD COLUMN capture VARCHAR;
ALTER TABLE shard_attempts ADD COLUMN capture_counters JSON;
ALTER TABLE ingested_parts ADD COLUMN capture VARCHAR;
ALTER TABLE ingested_parts ADD COLUMN capture_counters JSON;

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
),
summed AS (
    SELECT
        run_id,
        CAST(sum(CAST(c ->> 'compiles' AS BIGINT)) AS BIGINT) AS compiles,
        CAST(sum(CAST(c ->> 'recompiles' AS BIGINT)) AS BIGINT) AS recompiles,
        CAST(sum(CAST(c ->> 'graph_breaks' AS BIGINT)) AS BIGINT) AS graph_breaks,
        CAST(sum(CAST(c ->> 'forwards' AS BIGINT)) AS BIGINT) AS forwards,
        max(CAST(c ->> 'distinct_shapes' AS BIGINT)) AS distinct_shapes,
        sum(CAST(c ->> 'compile_seconds' AS DOUBLE)) AS compile_seconds,
        max(CAST(c ->> 'graph_bytes' AS BIGINT)) AS graph_bytes
    FROM per_model
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
    s.compiles, s.recompiles, s.graph_breaks, s.forwards, s.distinct_shapes, s.compile_seconds, s.graph_bytes,
    coalesce(s.recompiles, 0) + coalesce(s.graph_breaks, 0) AS faults
FROM runs AS r
LEFT JOIN modes AS m ON m.run_id = r.run_id
LEFT JOIN summed AS s ON s.run_id = r.run_id;
