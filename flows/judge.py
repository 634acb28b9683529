"""The ``judge`` flow: an LLM judge compares a run's sidecar outputs with its standalone outputs, per sidecar task.

Every sidecar task of the run is judged on its own (games, scores, ladder and verdict per task): tag lists by the
hashtag prompts, any other task by the prompts' task form, which names the task's instruction (from the run's
``sidecar_tasks`` parameter). A task whose outputs give no control ladder (``study.judge.tasks``: one output for
every document, nothing to reorder) is not judged, with the reason, stored in ``judge_tasks``: no verdict, not an
unreliable one. Documents come from the run's ``results`` (both modes written); those the same judge model and
prompt version already judged for the task are skipped, so a rerun asks only for what is missing. Each document
is played twice with positions swapped (``study.judge``). The probability mode (prompt ``tags-p1``) is used where
the endpoint returns log probabilities, probed once per run; otherwise the text mode (``tags-v1``), and
the artifact says so. Up to ``controls`` documents also get control games (their own tags against
another document's, in both orders) and, in the probability mode, null games that calibrate the margin of
a verdict. A document's games are committed to DuckDB as soon as it is judged, so a judge killed mid-run
loses only the documents in flight and its rerun skips the rest. The likelihood method resumes on its own:
a rerun scores every document whose main scores are not both stored, even when every game is, with
baselines from the whole run. There the ``judgements`` view derives
the verdict and ``judge_quality`` the control ladder; below ``threshold`` the run is marked UNRELIABLE
there and in the markdown artifact, which summarises wins, ties, losses, the mean preference and the
controls.

The judge is any OpenAI-compatible endpoint (``base_url``). Without one, the flow starts the project's
own server on loopback (``sidecar serve``) with ``judge_pair`` and a throwaway key, holding the
accelerator while it runs as a nightly run does (``flows.accelerator``). The key of an
external endpoint comes from the Prefect Secret block ``api_key_secret_block``, else from
``SIDECAR_JUDGE_API_KEY`` / ``OPENAI_API_KEY``; it is never a parameter and never logged.

Every game that has no winner is stored with its error. Answers the judge gives but that cannot be
parsed also keep their raw text and count as judged (asking again would give the same); failed calls
and replies that hold no answer are asked again on the next run. Either way the flow completes and the
artifact and the ``judgements`` view count them as errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import secrets

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import SecretStr

from flows.accelerator import holding_accelerator
from flows.progress import RunProgress
from sidecar.tasks.task import HASHTAGS, SidecarTask
from storage import (
    Database,
    JudgementRecord,
    JudgementScoreRecord,
    JudgeSettingsRecord,
    JudgeTaskRecord,
    UnknownRunError,
)
from storage.run_keys import check_run_id
from study.judge import (
    DEFAULT_PROMPT_VERSION,
    Detection,
    JudgeConfig,
    JudgeItem,
    JudgeResult,
    JudgeSummary,
    LikelihoodPart,
    LikelihoodResult,
    detect_prompt_version,
    judge_pairs,
    score_by_likelihood,
    summarize_judgements,
    summarize_likelihood,
)
from study.judge.likelihood import stored_output
from study.judge.prompts import DEFAULT_SCORER_PROMPTS, SCORER_PROMPTS
from study.judge.tasks import not_judged_reason

DEFAULT_JUDGE_PAIR = "qwen-coder-small"


@task(name="pending-documents", cache_policy=NO_CACHE)
def pending_documents(db: Database, run_id: str, judge_model: str, prompt_version: str,
                      everything: list[JudgeItem]) -> tuple[list[JudgeItem], int]:
    """(documents of ``everything``, one task's, not yet judged by this model and prompt, how many were judged
    before)."""
    task = everything[0].task if everything else "hashtags"
    judged = db.judged_doc_ids(run_id, judge_model, prompt_version, task)
    items = [item for item in everything if item.doc_id not in judged]
    return items, len(everything) - len(items)


def run_items(db: Database, run_id: str, task: str = "hashtags", instruction: str | None = None) -> list[JudgeItem]:
    """Every document of the run with its summary and ``task``'s output in both modes."""
    if db.get_run(run_id) is None:
        raise UnknownRunError(f"run {run_id!r} does not exist in {db.path}")
    return [JudgeItem(doc_id=row["doc_id"], summary=row["summary"], sidecar_tags=row["sidecar"],
                      standalone_tags=row["standalone"], task=task, instruction=instruction)
            for row in db.judge_outputs(run_id, task)]


def run_tasks(db: Database, run_id: str) -> dict[str, SidecarTask | None]:
    """The run's sidecar tasks (those with outputs; ``hashtags`` first, the rest by name), each with its definition
    from the run's ``sidecar_tasks`` parameter, None where the run does not record it (``hashtags`` is then the
    built-in task)."""
    run = db.get_run(run_id)
    if run is None:
        raise UnknownRunError(f"run {run_id!r} does not exist in {db.path}")
    # stored by a run that validated them: built without validating again (which compiles constraints)
    defined = {str(t.get("name")): SidecarTask.model_construct(**t) for t in run["params"].get("sidecar_tasks") or []
               if isinstance(t, dict)}
    names = sorted(db.sidecar_tasks(run_id), key=lambda name: (name != "hashtags", name))
    return {name: defined.get(name, HASHTAGS if name == "hashtags" else None) for name in names}


def judged_instruction(task: SidecarTask) -> str | None:
    """What the judge asks about a task: None for tag lists (the hashtag prompts), else its instruction as a
    tagger that sees only the main output reads it."""
    return None if task.parser == "hashtags" else task.standalone_instruction


def task_records(tasks: dict[str, SidecarTask | None], everything: dict[str, list[JudgeItem]],
                 controls: int) -> list[JudgeTaskRecord]:
    """Per task of the run, what the judge asks about it and, for one it cannot score, why."""
    records = []
    for name, defined in tasks.items():
        if defined is None:
            records.append(JudgeTaskRecord(name, None, "its instruction is not among the run's parameters "
                                                       "(sidecar_tasks), so the judge cannot ask about it"))
            continue
        records.append(JudgeTaskRecord(name, judged_instruction(defined),
                                       not_judged_reason(everything[name], controls)))
    return records


@task(name="judge-documents", cache_policy=NO_CACHE)
def judge_documents(db: Database, items: list[JudgeItem], config: JudgeConfig, run_id: str,
                    task: str = "hashtags") -> list[JudgeResult]:
    """Judge ``items`` (one task's), committing each document's games as soon as it is judged (see
    ``judgement_records``)."""
    logger = get_run_logger()
    settings = judge_settings(config, task)

    def judged(result: JudgeResult) -> None:
        records = judgement_records(result, config, task)
        if records:
            db.write_judgements(run_id, records, settings)
        progress.advance()
        preference = "" if result.preference is None else f" (preference {result.preference:.3f})"
        logger.info("task %s document %s judged (%d of %d): %s%s; %d games stored", task, result.doc_id,
                    progress.done, progress.total, result.verdict, preference, len(records))

    with RunProgress(f"{_artifact_key(run_id)}-progress", f"Documents of run {run_id} judged (task {task})",
                     len(items), "doc") as progress:
        return judge_pairs(items, config, on_result=judged)


@task(name="detect-judge-mode", cache_policy=NO_CACHE)
def detect_mode(items: list[JudgeItem], config: JudgeConfig) -> Detection:
    """The prompt version this run uses: the probability prompt where the endpoint returns log probabilities."""
    probe = next((item for item in items if item.comparable), None)
    if probe is None:
        return Detection(config.prompt_version, "Nothing to judge: the endpoint was not asked.")
    return detect_prompt_version(probe, config)


@task(name="likelihood-scores", cache_policy=NO_CACHE)
def likelihood_scores(db: Database, items: list[JudgeItem], config: JudgeConfig, run_id: str, model: str,
                      prompt_version: str, task: str = "hashtags") -> LikelihoodPart:
    """Score the documents of ``items`` (every document of the run) not yet scored by ``model`` with
    ``prompt_version``, baselines drawn from all of them, committing each document's scores as it is done; an
    endpoint without prompt log probabilities stores its settings with the reason instead."""
    logger = get_run_logger()
    pending = likelihood_pending(db, items, run_id, model, prompt_version)
    settings = JudgeSettingsRecord(judge_model=model, prompt_version=prompt_version, mode="likelihood",
                                   threshold=config.threshold, margin_floor=config.likelihood_floor,
                                   note=f"scorer prompt {prompt_version}: {SCORER_PROMPTS[prompt_version].note}",
                                   task=task)
    logger.info("run %s task %s: %d documents to score by likelihood with %s (%s), %d scored before", run_id, task,
                len(pending), model, prompt_version, len(items) - len(pending))

    def done(result: LikelihoodResult) -> None:
        if result.scores:
            db.write_judgements(run_id, [], settings, score_records(result, model, prompt_version, task))
        outcome = (f"difference {result.difference('main')}" if result.skip_reason is None
                   else f"skipped: {result.skip_reason}")
        logger.info("task %s document %s scored by likelihood (%s, %s): %s", task, result.doc_id, model,
                    prompt_version, outcome)

    outcome = score_by_likelihood(pending, config, model, prompt_version, on_result=done, run=items)
    if outcome.unavailable is not None:
        note = f"unavailable, the pairwise method's verdict stands: {outcome.unavailable}"
        db.write_judgements(run_id, [], dataclasses.replace(settings, note=note))
    return summarize_likelihood(outcome, config)


def likelihood_pending(db: Database, items: list[JudgeItem], run_id: str, model: str,
                       prompt_version: str) -> list[JudgeItem]:
    """The documents of ``items`` (one task's) with both outputs not yet done by ``model`` and ``prompt_version``:
    a document is done only once its main scores are both stored and none of its scores failed
    (``scored_doc_ids``)."""
    task = items[0].task if items else "hashtags"
    scored = db.scored_doc_ids(run_id, model, prompt_version, task)
    return [item for item in items if item.comparable and item.doc_id not in scored]


def score_records(result: LikelihoodResult, model: str, prompt_version: str,
                  task: str = "hashtags") -> list[JudgementScoreRecord]:
    """Every scored output of a document, controls included, with the scorer and prompt that scored it."""
    return [
        JudgementScoreRecord(
            doc_id=result.doc_id, judge_model=model, prompt_version=prompt_version, kind=score.kind, side=score.side,
            tags=stored_output(score.tags), baseline_doc_id=result.baseline_doc_id or "", given_own=score.given_own,
            given_baseline=score.given_baseline, tokens=score.tokens, error=score.error,
            foil_doc_id=result.foil_doc_id if score.kind in ("control", "hard") else None, task=task)
        for score in result.scores]


def judgement_records(result: JudgeResult, config: JudgeConfig, task: str = "hashtags") -> list[JudgementRecord]:
    """Every game of a judged document, controls included (a skipped document has none)."""
    return [
        JudgementRecord(
            doc_id=result.doc_id, judge_model=config.model, prompt_version=config.prompt_version, game=game.game,
            mode_a=game.sides[0], mode_b=game.sides[1], raw_answer=game.raw_answer, winner=game.winner,
            error=game.error, kind=game.kind, p_a=game.p_a, p_b=game.p_b,
            foil_doc_id=result.foil_doc_id if game.kind in ("control", "hard") else None, task=task)
        for game in (*result.games, *result.controls)]


def judge_settings(config: JudgeConfig, task: str = "hashtags") -> JudgeSettingsRecord:
    """What the run's verdicts are read with, stored beside its games."""
    return JudgeSettingsRecord(
        judge_model=config.model, prompt_version=config.prompt_version, mode=config.mode,
        threshold=config.threshold, margin_floor=config.margin_floor if config.mode == "probability" else None,
        task=task)


def api_key_from_block(name: str | None) -> SecretStr | None:
    """The key held by the Prefect ``Secret`` block ``name``; None without a block (the judge client then
    reads ``SIDECAR_JUDGE_API_KEY`` / ``OPENAI_API_KEY``)."""
    if not name:
        return None
    from prefect.blocks.system import Secret

    return SecretStr(str(Secret.load(name).get()))


def _artifact_key(run_id: str) -> str:
    # artifact keys allow lowercase letters, digits and dashes only
    return "judge-" + (re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") or "run")


@flow(name="judge", flow_run_name="judge-{run_id}")
def judge(run_id: str, judge_model: str | None = None, base_url: str | None = None,
          judge_pair: str = DEFAULT_JUDGE_PAIR, api_key_secret_block: str | None = None, concurrency: int = 4,
          retries: int = 2, db_path: str | None = None, prompt_version: str = DEFAULT_PROMPT_VERSION,
          timeout_s: float = 600.0, controls: int = 20, threshold: float = 0.9,
          device_wait_s: float | None = None, likelihood_prompts: tuple[str, ...] = DEFAULT_SCORER_PROMPTS,
          likelihood_model: str | None = None) -> JudgeSummary:
    """Judge the run's sidecar vs standalone outputs of each task; ``base_url`` None serves ``judge_pair`` locally.

    ``controls`` documents at most climb the control ladder; a method whose easy rung clears the margin, or whose
    null rung ties, in fewer than ``threshold`` of them is UNRELIABLE. A locally served judge holds the accelerator
    as a nightly run does (``flows.accelerator``), waiting up to ``device_wait_s`` for it (None: as long as it
    takes)."""
    check_run_id(run_id)
    logger = get_run_logger()
    if base_url is not None and not judge_model:
        raise ValueError("judge_model is required with base_url (the endpoint's model id)")
    model = judge_model or judge_pair
    db = Database(db_path)
    tasks = run_tasks(db, run_id)
    everything = {name: run_items(db, run_id, name, None if defined is None else judged_instruction(defined))
                  for name, defined in tasks.items()}
    records = task_records(tasks, everything, controls)
    db.write_judge_tasks(run_id, records)
    not_judged = {record.task: record.not_judged for record in records if record.not_judged is not None}
    judged_tasks = [record.task for record in records if record.not_judged is None]
    for name, reason in not_judged.items():
        logger.info("run %s: task %s is not judged: %s", run_id, name, reason)
    pending = {name: pending_documents(db, run_id, model, prompt_version, everything[name]) for name in judged_tasks}
    for name, (items, judged_before) in pending.items():
        logger.info("run %s task %s: %d documents to judge with %s, %d judged before", run_id, name, len(items), model,
                    judged_before)

    with contextlib.ExitStack() as stack:
        # a CPU-served judge answers in minutes, not seconds: the demo's judge games timed out at 60 s
        settings = {"model": model, "concurrency": concurrency, "retries": retries, "prompt_version": prompt_version,
                    "timeout_s": timeout_s, "controls": controls, "threshold": threshold,
                    "likelihood_prompts": tuple(likelihood_prompts), "likelihood_model": likelihood_model}
        # each method resumes on its own pending work: a rerun after a failed likelihood pass scores what it
        # left even when every pairwise game is stored
        scorers = JudgeConfig(**settings).scorers
        needs_judge = any(item.comparable for items, _ in pending.values() for item in items) or any(
            likelihood_pending(db, everything[name], run_id, scorer, version)
            for name in judged_tasks for scorer, version in scorers)
        if base_url is None:
            key = secrets.token_urlsafe(32)
            if needs_judge:  # the embedded server loads a model pair: only when there is something to ask
                from server.launcher import running_server

                stack.enter_context(holding_accelerator(f"judge of run {run_id}", device_wait_s))
                logger.info("starting the embedded judge: sidecar serve --pair %s on loopback", judge_pair)
                url = stack.enter_context(running_server(judge_pair, api_key=key, model_name=model))
            else:
                url = None
            config = JudgeConfig(base_url=url, api_key=SecretStr(key), **settings)
        else:
            config = JudgeConfig(base_url=base_url, api_key=api_key_from_block(api_key_secret_block), **settings)
        detection = detect_mode([item for items, _ in pending.values() for item in items], config)
        logger.info("run %s: %s", run_id, detection.note)
        if detection.prompt_version != config.prompt_version:
            config = config.model_copy(update={"prompt_version": detection.prompt_version})
            pending = {name: pending_documents(db, run_id, model, config.prompt_version, everything[name])
                       for name in judged_tasks}
        summaries = []
        for name in judged_tasks:
            results = judge_documents(db, pending[name][0], config, run_id, name)
            likelihood = [likelihood_scores(db, everything[name], config, run_id, scorer, version, name)
                          for scorer, version in config.scorers if needs_judge]
            summary = summarize_judgements(results, config, mode_note=detection.note, likelihood=likelihood)
            summaries.append(summary.model_copy(update={"task": name, "instruction": everything[name][0].instruction
                                                        if everything[name] else None}))
            games = sum(len(result.games) + len(result.controls) for result in results)
            logger.info("run %s task %s: %d judged, %d sidecar wins, %d losses, %d ties, %d errors, %d skipped; %d "
                        "games stored. %s", run_id, name, summary.judged, summary.wins, summary.losses, summary.ties,
                        summary.errors, summary.skipped, games, summary.reliability_line())

    first, *others = summaries or [summarize_judgements([], config, mode_note=detection.note)]
    summary = first.model_copy(update={"tasks": others, "not_judged": not_judged})
    considered = "; ".join(f"task {name} {len(pending[name][0])} considered now, {pending[name][1]} judged before"
                           for name in judged_tasks) or "no task judged"
    note = (f"\nRun `{run_id}`: {considered} (documents this judge and prompt version judged before were not asked "
            "again).\n")
    create_markdown_artifact(summary.to_markdown() + note, key=_artifact_key(run_id),
                             description=f"LLM judge of run {run_id}: sidecar vs standalone outputs per task")
    return summary
