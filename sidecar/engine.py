"""Sidecar engine: speculative main output, then the draft continues alone with each sidecar task.

Per request the target sees the bare prompt (system, document, main instruction); the draft sees the
compound prompt with every sidecar instruction appended, prefilled once, those instructions hidden while
it drafts the main output. When a row's main output is final, its draft cache holds document and main
output already. For each sidecar task the row's cache is snapshotted: the task's instruction is shown,
the other sidecars' instructions are dropped, and the document's columns are evicted unless the task
attends to it. The snapshots of all rows and tasks then decode together as one batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from sidecar.errors import InputError
from sidecar.kv_cache import RowKVCache, RowSnapshot
from sidecar.logprobs import TokenLogprob
from sidecar.models import ModelPair
from sidecar.plain import PlainResult, decode_plain
from sidecar.progress import SIDECAR_TASKS, STANDALONE, ProgressCallback
from sidecar.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION, SpannedPrompt, build_prompt, encode
from sidecar.speculative import (
    CancelCheck,
    DecodeRow,
    GenerationOutput,
    Sampling,
    SpeculativeDecoder,
    TokenCallback,
    forward,
    pad_rows,
)
from sidecar.tasks import SidecarTask


@dataclass
class SidecarRequest:
    document: str
    instruction: str = SUMMARIZE_INSTRUCTION
    system: str | None = DEFAULT_SYSTEM
    sidecars: list[SidecarTask] = field(default_factory=list)


@dataclass
class SidecarStats:
    new_tokens: int = 0
    context_tokens: int = 0  # KV columns the row attends to when its decoding starts
    feed_tokens: int = 0  # tokens fed before decoding: catch-up + bridge (sidecar) or whole prompt (standalone)
    feed_seconds: float = 0.0
    decode_seconds: float = 0.0
    seconds: float = 0.0
    kv_bytes: int = 0
    attended_document: bool = False
    batch_size: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SidecarOutput:
    name: str
    text: str
    token_ids: list[int]
    parsed: list[str] | str | None
    parse_error: str | None
    finish_reason: str
    stats: SidecarStats
    logprobs: list[TokenLogprob] | None = None  # the draft's, one per token id, when asked for


@dataclass
class DocumentResult:
    main: GenerationOutput
    sidecars: dict[str, SidecarOutput]


@dataclass
class _Pending:
    """A (request, task) row waiting for the sidecar phase."""

    request: int
    task: SidecarTask
    snapshot: RowSnapshot
    catch_up: list[int]  # main-output tokens the draft cache lacks, fed as while drafting
    document: range  # snapshot columns of the document and of the task's instruction
    instruction: range
    bridge: list[int]


class SidecarEngine:
    def __init__(self, pair: ModelPair, gamma: int = 4, adaptive: bool = True) -> None:
        self.pair = pair
        self.decoder = SpeculativeDecoder(pair, gamma=gamma, adaptive=adaptive)
        self.eos = set(pair.eos_token_ids)

    def prompts(self, request: SidecarRequest) -> tuple[SpannedPrompt, SpannedPrompt]:
        """(target's bare prompt, draft's compound prompt)."""
        if not request.document.strip():
            raise InputError("empty document")
        names = [t.name for t in request.sidecars]
        if len(set(names)) != len(names):
            raise InputError(f"sidecar task names must be unique, got {names}")
        tok = self.pair.tokenizer
        bare = build_prompt(tok, request.document, request.instruction, request.system)
        compound = build_prompt(tok, request.document, request.instruction, request.system,
                                {t.name: t.instruction for t in request.sidecars})
        return bare, compound

    def run(self, requests: list[SidecarRequest], max_new_tokens: int | list[int] = 128, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None, batch_size: int = 8, stop: list[str] | None = None,
            on_tokens: TokenCallback | None = None, sidecar_sampling: Sampling | None = None,
            on_progress: ProgressCallback | None = None, top_logprobs: int | None = None,
            cancelled: CancelCheck | None = None) -> list[DocumentResult]:
        """Main outputs by speculative decoding, then every request's sidecar tasks by the draft alone.

        ``sidecar_sampling`` decodes the sidecar phase differently from the main output (for example a
        greedy summary with sampled tags); by default both use ``temperature``/``top_p``/``seed``.
        ``on_progress`` hears each phase's progress (``sidecar.progress``). ``top_logprobs`` (None: off)
        gives every output its tokens' log-probabilities and that many alternatives (``sidecar.logprobs``):
        the main output's under the target, each sidecar output's under the draft that wrote it.
        A request that ``cancelled`` reports leaves the main batch at the next step and gets no sidecars.
        """
        sampling = Sampling(temperature, top_p, seed)
        sidecar_sampling = sidecar_sampling or sampling
        limits = [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        built = [self.prompts(r) for r in requests]
        draft_context = int(self.pair.draft.config.max_position_embeddings)
        for i, (request, limit, (_, compound)) in enumerate(zip(requests, limits, built, strict=True)):
            longest_task = max((len(encode(self.pair.tokenizer, t.bridge)) + t.max_new_tokens
                                for t in request.sidecars), default=0)
            if len(compound.token_ids) + limit + longest_task + self.decoder.gamma + 1 > draft_context:
                raise InputError(f"request {i}: document, main output and sidecar outputs exceed the draft's context "
                                 f"of {draft_context} tokens; shorten the document")
        rows = [
            DecodeRow(bare.token_ids, limit, compound.token_ids,
                      [compound.spans[f"sidecar:{t.name}"] for t in r.sidecars])
            for r, limit, (bare, compound) in zip(requests, limits, built, strict=True)
        ]
        pending: list[_Pending] = []

        def on_finish(index: int, output: GenerationOutput, cache: RowKVCache, slot: int) -> None:
            request, compound = requests[index], built[index][1]
            main = output.token_ids[:-1] if output.token_ids and output.token_ids[-1] in self.eos else output.token_ids
            covered = min(int(cache.lengths[slot]) - len(compound.token_ids), len(main))
            main_columns = list(range(len(compound.token_ids), len(compound.token_ids) + covered))
            for task in request.sidecars:
                # the document stays in the snapshot until the catch-up below has been fed
                keep = ["prefix", "document", "instruction", f"sidecar:{task.name}", "suffix"]
                columns = compound.columns(*keep) + main_columns
                snapshot = cache.snapshot(slot, columns)
                start = len(compound.columns(*keep[:3]))
                pending.append(_Pending(
                    index, task, snapshot, main[covered:],
                    document=range(len(compound.columns("prefix")), len(compound.columns(*keep[:2]))),
                    instruction=range(start, start + len(compound.columns(f"sidecar:{task.name}"))),
                    bridge=encode(self.pair.tokenizer, task.bridge)))

        # without sidecar tasks nobody needs the draft's cache afterwards, so the decoder may skip the draft
        has_sidecars = any(r.sidecars for r in requests)
        mains = self.decoder.decode(rows, sampling, batch_size, stop=stop, on_tokens=on_tokens,
                                    on_finish=on_finish if has_sidecars else None, on_progress=on_progress,
                                    top_logprobs=top_logprobs, cancelled=cancelled)
        results = [DocumentResult(main, {}) for main in mains]
        generator = None
        if sidecar_sampling.seed is not None:
            generator = torch.Generator(device=self.pair.device).manual_seed(sidecar_sampling.seed + 1)
        if on_progress is not None and pending:
            on_progress(SIDECAR_TASKS, 0, len(pending))
        for chunk_start in range(0, len(pending), batch_size):
            chunk_end = min(chunk_start + batch_size, len(pending))
            # a request whose client has gone gets no sidecars
            chunk = [p for p in pending[chunk_start:chunk_end] if cancelled is None or not cancelled(p.request)]
            if chunk:
                self._decode_sidecars(chunk, results, sidecar_sampling, generator, top_logprobs)
            if on_progress is not None:
                on_progress(SIDECAR_TASKS, chunk_end, len(pending))
        return results

    def _decode_sidecars(self, chunk: list[_Pending], results: list[DocumentResult], sampling: Sampling,
                         generator: torch.Generator | None, top_logprobs: int | None) -> None:
        """Decode one batch of sidecar rows with the draft alone; each output goes to its request's result."""
        extra = max(len(p.catch_up) + len(p.bridge) + p.task.max_new_tokens for p in chunk) + 1
        cache = self._sidecar_cache(chunk, extra)
        context = [int(n) for n in cache.lengths]
        outs = decode_plain(self.pair.draft, cache, [p.bridge for p in chunk], [p.task.max_new_tokens for p in chunk],
                            sampling, generator, self.eos, top_logprobs)
        for p, out, ctx in zip(chunk, outs, context, strict=True):
            results[p.request].sidecars[p.task.name] = self._output(p.task, out, ctx, len(p.catch_up) + len(p.bridge),
                                                                    len(chunk))

    def _sidecar_cache(self, chunk: list[_Pending], extra: int) -> RowKVCache:
        """The batch cache a chunk of sidecar rows decodes from: caught up, document evicted, instruction shown.

        The draft cache may lag the main output by a few tokens (how many depends on gamma and the batch);
        they are fed as while drafting, document visible and instruction hidden, so a sidecar's output never
        depends on when its main output happened to finish.
        """
        draft = self.pair.draft
        cache = RowKVCache.from_snapshots(draft, [p.snapshot for p in chunk], extra)
        if any(p.catch_up for p in chunk):
            with torch.inference_mode():
                ids, valid = pad_rows([p.catch_up for p in chunk], self.pair.device)
                forward(draft, cache, ids)
                cache.commit(valid)
        if any(not p.task.attend_document for p in chunk):
            kept = []
            for row, p in enumerate(chunk):
                evicted = range(0) if p.task.attend_document else p.document
                columns = [c for c in range(int(cache.lengths[row])) if c not in evicted]
                kept.append(cache.snapshot(row, columns))
            cache = RowKVCache.from_snapshots(draft, kept, extra)
        for row, p in enumerate(chunk):
            shift = 0 if p.task.attend_document else len(p.document)
            cache.visible[row, p.instruction.start - shift : p.instruction.stop - shift] = True
        return cache

    def standalone(self, summaries: list[str], tasks: list[SidecarTask], temperature: float = 0.0,
                   top_p: float = 1.0, seed: int | None = None, batch_size: int = 8,
                   system: str | None = DEFAULT_SYSTEM, on_progress: ProgressCallback | None = None,
                   ) -> list[dict[str, SidecarOutput]]:
        """The baseline: the draft model as a separate tagger prompted with only the main output."""
        sampling = Sampling(temperature, top_p, seed)
        generator = torch.Generator(device=self.pair.device).manual_seed(seed + 1) if seed is not None else None
        jobs = [(i, task, build_prompt(self.pair.tokenizer, summary, task.standalone_instruction, system).token_ids)
                for i, summary in enumerate(summaries) for task in tasks]
        results: list[dict[str, SidecarOutput]] = [{} for _ in summaries]
        jobs.sort(key=lambda job: len(job[2]))
        if on_progress is not None:
            on_progress(STANDALONE, 0, len(jobs))
        for chunk_start in range(0, len(jobs), batch_size):
            chunk = jobs[chunk_start : chunk_start + batch_size]
            longest = max(len(prompt) + task.max_new_tokens for _, task, prompt in chunk)
            cache = RowKVCache(self.pair.draft, len(chunk), longest + 1)
            outs = decode_plain(self.pair.draft, cache, [prompt for _, _, prompt in chunk],
                                [task.max_new_tokens for _, task, _ in chunk], sampling, generator, self.eos)
            for (i, task, prompt), out in zip(chunk, outs, strict=True):
                results[i][task.name] = self._output(task, out, 0, len(prompt), len(chunk))
            if on_progress is not None:
                on_progress(STANDALONE, chunk_start + len(chunk), len(jobs))
        return results

    def _output(self, task: SidecarTask, out: PlainResult, context: int, feed: int, batch: int) -> SidecarOutput:
        text = self.pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        parsed, error = task.parse(text)
        stats = SidecarStats(
            new_tokens=len(out.token_ids), context_tokens=context, feed_tokens=feed, feed_seconds=out.feed_seconds,
            decode_seconds=out.decode_seconds, seconds=out.feed_seconds + out.decode_seconds, kv_bytes=out.kv_bytes,
            attended_document=task.attend_document, batch_size=batch,
        )
        return SidecarOutput(task.name, text, out.token_ids, parsed, error, out.finish_reason, stats, out.logprobs)

