-- 007_device_ledger: what a request cost, from the engine's device-time ledger, apart from how long it took.
-- The engine times every forward on the device and splits its seconds among the rows it served in proportion
-- to their tokens in it (sidecar/runtime/ledger.py). Each request_stats row stores its share per phase:
-- tokens, forwards and attributed device seconds of its prefill and decode forwards; a sidecar row also the
-- masked instruction tokens it put into its main row's draft prefill and their share of that prefill (what
-- sidecar mode adds to the main phase, charged to the sidecar; 0 for a standalone tagger); and its latency
-- (queue, first token). Rows written before this migration, or by an engine without the ledger, keep NULL.
--
-- `throughput.tokens_per_s` is now new tokens per attributed device second, over the rows that have a
-- ledger; NULL where none has one, never a wall-clock rate. The wall clock of a batch or stream (005's
-- "from the stream's start", main steps included, for a stream's sidecar phase) feeds no rate any more: it
-- stays in wall_s, prefill_s and decode_s, latency only. The view's columns keep their order and meaning
-- but tokens_per_s; the new ones come last.
--
-- `cost_estimates.timed_by` says what a line's tokens/s divides by: the ledger's device seconds or the
-- roofline. Measured lines stored before this migration divided by wall time: `costs` shows them without
-- tokens/s and $ (and the cost report rewrites them from the ledger where there is one).

ALTER TABLE request_stats ADD COLUMN prefill_tokens INTEGER;
ALTER TABLE request_stats ADD COLUMN prefill_forwards INTEGER;
ALTER TABLE request_stats ADD COLUMN prefill_device_s DOUBLE;
ALTER TABLE request_stats ADD COLUMN decode_tokens INTEGER;
ALTER TABLE request_stats ADD COLUMN decode_forwards INTEGER;
ALTER TABLE request_stats ADD COLUMN decode_device_s DOUBLE;
ALTER TABLE request_stats ADD COLUMN instruction_tokens INTEGER;
ALTER TABLE request_stats ADD COLUMN instruction_device_s DOUBLE;
ALTER TABLE request_stats ADD COLUMN queue_s DOUBLE;
ALTER TABLE request_stats ADD COLUMN first_token_s DOUBLE;

-- DuckDB cannot add a column with a CHECK in place: the table is rebuilt with its rows, timed_by NULL.
DROP VIEW costs;
CREATE TEMPORARY TABLE cost_estimates_006 AS SELECT * FROM cost_estimates;
DROP TABLE cost_estimates;
CREATE TABLE cost_estimates (
    gpu_type         VARCHAR NOT NULL,
    pair             VARCHAR NOT NULL,
    mode             VARCHAR NOT NULL,
    batch_size       INTEGER NOT NULL,
    tokens_per_s     DOUBLE NOT NULL CHECK (tokens_per_s >= 0),
    ms_per_step      DOUBLE,
    usd_per_gpu_hour DOUBLE,
    usd_per_mtok     DOUBLE,
    source           VARCHAR NOT NULL CHECK (source IN ('measured', 'projected')),
    run_id           VARCHAR,
    note             VARCHAR,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT current_timestamp,
    timed_by         VARCHAR CHECK (timed_by IN ('device_ledger', 'roofline'))
);
INSERT INTO cost_estimates BY NAME SELECT * FROM cost_estimates_006;
DROP TABLE cost_estimates_006;

CREATE OR REPLACE VIEW throughput AS
WITH ledgered AS (
    SELECT
        s.*,
        coalesce(s.gpu_type, r.gpu_type) AS ran_on_gpu_type,
        coalesce(s.device, r.device) AS ran_on_device,
        -- a row's attributed device seconds: prefill + decode (+ the instruction line of a sidecar row)
        CASE WHEN s.prefill_device_s IS NOT NULL AND s.decode_device_s IS NOT NULL
             THEN s.prefill_device_s + s.decode_device_s + coalesce(s.instruction_device_s, 0) END AS device_s
    FROM request_stats AS s
    JOIN runs AS r ON r.run_id = s.run_id
),
per_batch AS (
    SELECT
        run_id, mode, phase,
        ran_on_gpu_type AS gpu_type,
        ran_on_device AS device,
        launch_id,
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
        max(batch_size) AS batch_size,
        count(device_s) AS ledger_requests,
        sum(new_tokens) FILTER (WHERE device_s IS NOT NULL) AS ledger_new_tokens,
        sum(device_s) AS device_s,
        sum(prefill_device_s) FILTER (WHERE device_s IS NOT NULL) AS prefill_device_s,
        sum(decode_device_s) FILTER (WHERE device_s IS NOT NULL) AS decode_device_s,
        sum(coalesce(instruction_device_s, 0)) FILTER (WHERE device_s IS NOT NULL) AS instruction_device_s,
        sum(prefill_tokens) FILTER (WHERE device_s IS NOT NULL) AS prefill_tokens,
        sum(decode_tokens) FILTER (WHERE device_s IS NOT NULL) AS decode_tokens,
        sum(coalesce(instruction_tokens, 0)) FILTER (WHERE device_s IS NOT NULL) AS instruction_tokens,
        sum(prefill_forwards) FILTER (WHERE device_s IS NOT NULL) AS prefill_forwards,
        sum(decode_forwards) FILTER (WHERE device_s IS NOT NULL) AS decode_forwards,
        sum(queue_s) AS queue_s,
        count(queue_s) AS queue_rows,
        sum(first_token_s) AS first_token_s,
        count(first_token_s) AS first_token_rows
    FROM ledgered
    GROUP BY run_id, mode, phase, ran_on_gpu_type, ran_on_device, launch_id, batch_key
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
    sum(b.ledger_new_tokens) / nullif(sum(b.device_s), 0) AS tokens_per_s,
    sum(b.accepted) / nullif(sum(b.drafted), 0) AS acceptance_rate,
    sum(b.new_tokens) / nullif(sum(b.target_forwards), 0) AS tokens_per_target_forward,
    sum(b.kv_bytes) / nullif(sum(b.kv_rows), 0) AS mean_kv_bytes,
    sum(b.prompt_tokens) / nullif(sum(b.prompt_rows), 0) AS prompt_tokens,
    sum(b.prefill_s) AS prefill_s,
    sum(b.decode_s) AS decode_s,
    sum(b.longest_row_tokens) AS longest_row_tokens,
    sum(b.ledger_requests) AS ledger_requests,
    sum(b.ledger_new_tokens) AS ledger_new_tokens,
    sum(b.device_s) AS device_s,
    sum(b.prefill_device_s) AS prefill_device_s,
    sum(b.decode_device_s) AS decode_device_s,
    sum(b.instruction_device_s) AS instruction_device_s,
    sum(b.prefill_tokens) AS prefill_tokens,
    sum(b.decode_tokens) AS decode_tokens,
    sum(b.instruction_tokens) AS instruction_tokens,
    sum(b.prefill_forwards) AS prefill_forwards,
    sum(b.decode_forwards) AS decode_forwards,
    sum(b.queue_s) / nullif(sum(b.queue_rows), 0) AS mean_queue_s,
    sum(b.first_token_s) / nullif(sum(b.first_token_rows), 0) AS mean_first_token_s
FROM per_batch AS b
JOIN runs AS r ON r.run_id = b.run_id
GROUP BY b.run_id, r.pair, b.gpu_type, r.gamma, r.batch_size, b.mode, b.phase;

-- The cost report's lines: usd_per_mtok as given, else from the GPU's hourly rent and the throughput. A
-- measured line without timed_by was stored before the ledger, from wall time: it has no rate here.
CREATE VIEW costs AS
WITH timed AS (
    SELECT *, source = 'measured' AND timed_by IS NULL AS wall_clock_rate
    FROM cost_estimates
)
SELECT
    gpu_type, pair, mode, batch_size,
    CASE WHEN wall_clock_rate THEN NULL ELSE tokens_per_s END AS tokens_per_s,
    ms_per_step, usd_per_gpu_hour,
    CASE WHEN wall_clock_rate THEN NULL
         ELSE coalesce(usd_per_mtok, usd_per_gpu_hour / nullif(tokens_per_s * 3600, 0) * 1e6) END AS usd_per_mtok,
    source, run_id, note, created_at, timed_by
FROM timed;
