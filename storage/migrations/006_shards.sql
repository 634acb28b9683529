-- 006_shards: one run over many GPUs and machines. Shards never write this file: each attempt of a shard
-- writes Parquet part files, and the run's parent ingests them (storage.parts, Database.ingest_parts).
-- `ingested_parts` records every part ingested, in the transaction that wrote its rows, so a part is
-- ingested once however often the parent looks (who wrote it is kept for the attempt it belongs to).
-- `shard_attempts` is the parent's record of each launch of a shard; its host, device and GPU type come
-- from the attempt's ingested parts. `request_stats` rows from parts say where they ran, so the `throughput`
-- view reports one row per GPU type within a run (rows without, written by a run itself, take the run's
-- own device and GPU type as before). Batch ids are an attempt's own: a batch is now keyed by attempt too.
-- Every other column of the view keeps its order and meaning; `device` lists the devices of the row's
-- batches when they differ.

CREATE TABLE ingested_parts (
    run_id      VARCHAR NOT NULL,
    -- the part's path under the run's directory: <launch_id>/part-NNNNNN.parquet
    part        VARCHAR NOT NULL,
    launch_id   VARCHAR NOT NULL,
    rows        BIGINT NOT NULL,
    host        VARCHAR,
    device      VARCHAR,
    gpu_type    VARCHAR,
    ingested_at TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, part)
);

CREATE TABLE shard_attempts (
    run_id      VARCHAR NOT NULL,
    launch_id   VARCHAR NOT NULL,
    shard       INTEGER NOT NULL,
    attempt     INTEGER NOT NULL,
    flow_run_id VARCHAR,
    -- documents in the attempt's manifest
    docs        INTEGER NOT NULL,
    status      VARCHAR NOT NULL CHECK (status IN ('running', 'completed', 'failed', 'crashed', 'cancelled')),
    host        VARCHAR,
    device      VARCHAR,
    gpu_type    VARCHAR,
    started_at  TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    finished_at TIMESTAMPTZ,
    error       VARCHAR,
    PRIMARY KEY (run_id, launch_id)
);

ALTER TABLE request_stats ADD COLUMN launch_id VARCHAR;
ALTER TABLE request_stats ADD COLUMN host VARCHAR;
ALTER TABLE request_stats ADD COLUMN device VARCHAR;
ALTER TABLE request_stats ADD COLUMN gpu_type VARCHAR;

CREATE OR REPLACE VIEW throughput AS
WITH per_batch AS (
    SELECT
        s.run_id, s.mode, s.phase,
        coalesce(s.gpu_type, r.gpu_type) AS gpu_type,
        coalesce(s.device, r.device) AS device,
        s.launch_id,
        coalesce(CAST(s.batch_id AS VARCHAR), 'doc:' || s.doc_id) AS batch_key,
        count(*) AS requests,
        sum(s.new_tokens) AS new_tokens,
        max(s.new_tokens) AS longest_row_tokens,
        coalesce(max(s.ended_s), max(s.wall_s)) AS wall_s,
        max(s.prefill_s) AS prefill_s,
        max(s.decode_s) AS decode_s,
        sum(s.prompt_tokens) AS prompt_tokens,
        count(s.prompt_tokens) AS prompt_rows,
        sum(s.drafted) AS drafted,
        sum(s.accepted) AS accepted,
        sum(s.target_forwards) AS target_forwards,
        sum(s.draft_forwards) AS draft_forwards,
        sum(s.kv_bytes) AS kv_bytes,
        count(s.kv_bytes) AS kv_rows,
        max(s.batch_size) AS batch_size
    FROM request_stats AS s
    JOIN runs AS r ON r.run_id = s.run_id
    GROUP BY s.run_id, s.mode, s.phase, coalesce(s.gpu_type, r.gpu_type), coalesce(s.device, r.device),
             s.launch_id, batch_key
)
SELECT
    b.run_id,
    r.pair,
    string_agg(DISTINCT b.device, ', ' ORDER BY b.device) AS device,
    b.gpu_type,
    r.gamma,
    b.mode,
    b.phase,
    coalesce(max(b.batch_size), r.batch_size) AS batch_size,
    sum(b.requests) AS requests,
    count(*) AS batches,
    sum(b.new_tokens) AS new_tokens,
    sum(b.wall_s) AS wall_s,
    sum(b.new_tokens) / nullif(sum(b.wall_s), 0) AS tokens_per_s,
    sum(b.accepted) / nullif(sum(b.drafted), 0) AS acceptance_rate,
    sum(b.new_tokens) / nullif(sum(b.target_forwards), 0) AS tokens_per_target_forward,
    sum(b.kv_bytes) / nullif(sum(b.kv_rows), 0) AS mean_kv_bytes,
    sum(b.prompt_tokens) / nullif(sum(b.prompt_rows), 0) AS prompt_tokens,
    sum(b.prefill_s) AS prefill_s,
    sum(b.decode_s) AS decode_s,
    sum(b.longest_row_tokens) AS longest_row_tokens
FROM per_batch AS b
JOIN runs AS r ON r.run_id = b.run_id
GROUP BY b.run_id, r.pair, b.gpu_type, r.gamma, r.batch_size, b.mode, b.phase;
