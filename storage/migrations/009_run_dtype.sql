-- 009_run_dtype: the dtype a run's pair loaded in, and why ("bf16 (auto: bf16 matmul 0.31 ms vs fp32 0.84 ms)",
-- "fp32 (SIDECAR_DTYPE=fp32)"; sidecar.models.dtype_choice), beside its device: as the first start recorded it,
-- NULL for a sharded run's parent and for runs created before this migration.

ALTER TABLE runs ADD COLUMN dtype VARCHAR;
