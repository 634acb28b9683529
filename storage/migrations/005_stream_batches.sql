-- 005_stream_batches: batches that rows join and leave while they run (the engine's streams).
-- `request_stats.ended_s` is the seconds from the start of the row's batch until this phase of the row was
-- done. In a stream a row may start long after its batch did, so its own wall_s says nothing about the
-- batch's time; the batch's time is its latest ended_s. Rows without ended_s (written before this migration,
-- or by batches whose rows all start together) keep the longest wall_s of their batch. A stream's sidecar
-- rows share its steps with the main rows, so its sidecar phase counts from the stream's start, main steps
-- included. Every other column of the view keeps its order and meaning.

ALTER TABLE request_stats ADD COLUMN ended_s DOUBLE;

CREATE OR REPLACE VIEW throughput AS
WITH per_batch AS (
    SELECT
        run_id, mode, phase,
        coalesce(CAST(batch_id AS VARCHAR), 'doc:' || doc_id) AS batch_key,
        count(*) AS requests,
        sum(new_tokens) AS new_tokens,
        max(new_tokens) AS longest_row_tokens,
        coalesce(max(ended_s), max(wall_s)) AS wall_s,
        max(prefill_s) AS prefill_s,
        max(decode_s) AS decode_s,
        sum(prompt_tokens) AS prompt_tokens,
        count(prompt_tokens) AS prompt_rows,
        sum(drafted) AS drafted,
        sum(accepted) AS accepted,
        sum(target_forwards) AS target_forwards,
        sum(draft_forwards) AS draft_forwards,
        sum(kv_bytes) AS kv_bytes,
        count(kv_bytes) AS kv_rows,
        max(batch_size) AS batch_size
    FROM request_stats
    GROUP BY run_id, mode, phase, batch_key
)
SELECT
    b.run_id,
    r.pair,
    r.device,
    r.gpu_type,
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
GROUP BY b.run_id, r.pair, r.device, r.gpu_type, r.gamma, r.batch_size, b.mode, b.phase;
