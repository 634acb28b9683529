"""Sidecar engine: speculative main output, then the draft continues alone with each sidecar task.

``SidecarEngine`` builds each request's two prompts and runs requests through a ``SidecarBatch``
(``sidecar.tasks.batch``): as a stream (results as they complete), as a list (``run``), or step by step
(``batch``, the server's loop). ``standalone`` is the baseline tagger: the draft prompted with only the
main output.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from sidecar.decoding.batch import stream_through
from sidecar.decoding.plain import PlainBatch, plain_rows
from sidecar.decoding.rows import CancelCheck, DecodeRow, TokenCallback
from sidecar.decoding.sampling import Sampling
from sidecar.decoding.speculative import SpeculativeDecoder
from sidecar.errors import InputError
from sidecar.models.pair import ModelPair
from sidecar.progress import STANDALONE, ProgressCallback
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.tasks.batch import SidecarBatch, sidecar_output
from sidecar.tasks.prompts import DEFAULT_SYSTEM, SpannedPrompt, build_prompt, encode
from sidecar.tasks.rows import DocumentResult, SidecarOutput, SidecarRequest
from sidecar.tasks.task import SidecarTask


def nth_sampling(sampling: Sampling, i: int) -> Sampling:
    """``sampling`` for row ``i`` of a call: a seeded call's rows draw as seeds ``seed + i``."""
    return sampling if sampling.seed is None else replace(sampling, seed=(sampling.seed + i) & ((1 << 63) - 1))


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
            cancelled: CancelCheck | None = None, schedule: str = "continuous") -> list[DocumentResult]:
        """Main outputs by speculative decoding, each request's sidecar tasks by the draft alone as soon as its
        main output is final; results in input order.

        ``sidecar_sampling`` decodes the sidecar outputs differently from the main output (for example a
        greedy summary with sampled tags); by default both use ``temperature``/``top_p``/``seed`` (request
        ``i`` of a call seeded ``s`` draws as a request seeded ``s + i``). ``on_progress`` hears each
        phase's progress (``sidecar.progress``). ``top_logprobs`` (None: off) gives every output its tokens'
        log-probabilities and that many alternatives (``sidecar.decoding.logprobs``): the main output's under the
        target, each sidecar output's under the draft that wrote it. A request that ``cancelled`` reports
        leaves at the next step and gets no sidecars.
        """
        sampling = Sampling(temperature, top_p, seed)
        sidecar_sampling = sidecar_sampling or sampling
        limits = [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        jobs = [replace(request, max_new_tokens=limit, stop=stop, top_logprobs=top_logprobs,
                        sampling=nth_sampling(sampling, i), sidecar_sampling=nth_sampling(sidecar_sampling, i))
                for i, (request, limit) in enumerate(zip(requests, limits, strict=True))]
        rows = [self.decode_row(i, job) for i, job in enumerate(jobs)]  # every request checked before any runs
        self.decoder.validate(rows, batch_size)
        # similar lengths are admitted together, so right-padding wastes little prefill
        order = sorted(range(len(jobs)), key=lambda i: len(rows[i].target_prompt))
        results: dict[int, DocumentResult] = {}
        for index, result in self.stream((jobs[i] for i in order), batch_size, schedule, on_tokens=on_tokens,
                                         on_progress=on_progress, cancelled=cancelled, indices=order,
                                         expected=len(jobs)):
            results[index] = result
        return [results[i] for i in range(len(jobs))]

    def stream(self, requests: Iterable[SidecarRequest], max_batch: int = 8, schedule: str = "continuous",
               on_tokens: TokenCallback | None = None, on_progress: ProgressCallback | None = None,
               cancelled: CancelCheck | None = None, indices: list[int] | None = None,
               expected: int | None = None) -> Iterator[tuple[int, DocumentResult]]:
        """Run requests as they come: (index, result) as each request's main output and sidecars are done
        (``sidecar.decoding.batch.stream_through``); a request is read only when the main batch has a slot for it."""
        batch = self.batch(max_batch, schedule, on_tokens=on_tokens, on_progress=on_progress, cancelled=cancelled,
                           expected=expected)
        return stream_through(batch, requests, indices)

    def batch(self, max_batch: int = 8, schedule: str = "continuous", **options: Any) -> SidecarBatch:
        """An empty running batch of sidecar requests to ``add`` to and ``step`` (the server's loop)."""
        return SidecarBatch(self, max_batch, schedule, **options)

    def decode_row(self, index: int, request: SidecarRequest) -> DecodeRow:
        """The main output's row for ``request``, checked against the draft's context, which must also hold
        the main output and the longest sidecar output."""
        bare, compound = self.prompts(request)
        limit = request.max_new_tokens or 128
        draft_context = int(self.pair.draft.config.max_position_embeddings)
        longest_task = max((len(encode(self.pair.tokenizer, t.bridge)) + t.max_new_tokens
                            for t in request.sidecars), default=0)
        if len(compound.token_ids) + limit + longest_task + self.decoder.gamma + 1 > draft_context:
            raise InputError(f"request {index}: document, main output and sidecar outputs exceed the draft's "
                             f"context of {draft_context} tokens; shorten the document")
        return DecodeRow(bare.token_ids, limit, compound.token_ids,
                         [compound.spans[f"sidecar:{t.name}"] for t in request.sidecars],
                         sampling=request.sampling or Sampling(), stop=request.stop,
                         top_logprobs=request.top_logprobs, keep_draft=bool(request.sidecars))

    def standalone(self, summaries: list[str], tasks: list[SidecarTask], temperature: float = 0.0,
                   top_p: float = 1.0, seed: int | None = None, batch_size: int = 8,
                   system: str | None = DEFAULT_SYSTEM, on_progress: ProgressCallback | None = None,
                   schedule: str = "continuous") -> list[dict[str, SidecarOutput]]:
        """The baseline: the draft model as a separate tagger prompted with only the main output, its jobs
        joining the batch as slots free (``schedule="static"``: in fixed batches)."""
        sampling = Sampling(temperature, top_p, seed)
        jobs = [(i, task, build_prompt(self.pair.tokenizer, summary, task.standalone_instruction, system).token_ids)
                for i, summary in enumerate(summaries) for task in tasks]
        jobs.sort(key=lambda job: len(job[2]))
        draw = plain_rows([task.max_new_tokens for _, task, _ in jobs], sampling, seed, stream=1)
        results: list[dict[str, SidecarOutput]] = [{} for _ in summaries]
        batch = PlainBatch(self.pair.draft, batch_size, self.eos, self.decoder.prefill_plans["draft"])
        joined: dict[int, int] = {}  # job -> live rows once it joined
        report = on_progress or (lambda phase, done, total: None)
        report(STANDALONE, 0, len(jobs))
        done, next_job = 0, 0
        while done < len(jobs):
            finished = []
            free = batch.free if schedule == "continuous" or not batch.busy else 0
            if free and next_job < len(jobs):
                group = list(range(next_job, min(next_job + free, len(jobs))))
                next_job = group[-1] + 1
                longest = max(len(jobs[j][2]) for j in group)
                cache = RowKVCache(self.pair.draft, len(group), longest + 1)
                joined.update((j, len(batch.rows) + len(group)) for j in group)
                finished += batch.admit(cache, [jobs[j][2] for j in group], [draw[j] for j in group])
            finished += batch.step()
            for job, out in finished:
                i, task, prompt = jobs[job]
                results[i][task.name] = sidecar_output(self.pair.tokenizer, task, out, 0, len(prompt), joined[job])
                done += 1
            if finished:
                report(STANDALONE, done, len(jobs))
        return results
