-- 008_run_nonce: what binds a sharded run's part files to the start of the run that launched them. A run id
-- alone does not: a database deleted but not its parts, or another database sharing a results location,
-- starts the same run id afresh. Each run gets a random nonce when it is first created; manifests and parts
-- carry it, and the parent ingests only parts with its run's nonce (storage.ingest). Runs created before
-- this migration get one at their next start; their older parts carry none and are redone.

ALTER TABLE runs ADD COLUMN nonce VARCHAR;
