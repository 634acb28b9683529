-- 004_run_identity: what a resume must repeat, and input rows without an id.
-- `runs.identity` holds what the caller declares decides the run's outputs (JSON; NULL when it declared
-- nothing); starting the run id again with another identity is refused. `documents.doc_id` is NULL for a
-- rejected row whose id was null, so no placeholder can collide with a real id; usable rows always have one.
-- Rows stored before this migration keep their `row:<n>` placeholders: which of them were null ids cannot
-- be told apart from real ids of that form.

ALTER TABLE runs ADD COLUMN identity JSON;
ALTER TABLE documents ALTER COLUMN doc_id DROP NOT NULL;
