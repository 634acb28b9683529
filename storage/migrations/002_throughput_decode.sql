-- 002_throughput_decode: the `throughput` view gains what a per-step cost needs. A batch decodes until its
-- longest row finishes and shares its prefill and decode clocks, so per batch the decode time is the
-- longest of its rows' and the positions it stepped through are its longest row's new tokens; both are
-- summed over batches like wall_s. prompt_tokens is the mean per request, for projecting the same
-- workload. The columns of 001 keep their order and meaning; the new ones come last.

CREATE OR REPLACE VIEW throughput AS
WITH per_batch AS (
    SELECT
        run_id, mode, phase,
        coalesce(CAST(batch_id AS VARCHAR), 'doc:' || doc_id) AS batch_key,
        count(*) AS requests,
        sum(new_tokens) AS new_tokens,
        max(new_tokens) AS longest_row_tokens,
        max(wall_s) AS wall_s,
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
