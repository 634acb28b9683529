"""Sidecar engine: speculative main output, then the draft continues alone with each sidecar task.

``SidecarEngine`` runs requests through a ``SidecarBatch`` (``sidecar.tasks.batch``): as a stream (results
as they complete), as a list (``run``), or step by step (``batch``, the server's loop). ``standalone`` is the
baseline tagger: the draft prompted with only the main output, its rows in a batch of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from sidecar.decoding.batch import stream_through
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.randomness import draw_key, nth_seed
from sidecar.decoding.rows import CancelCheck, DecodeRow, DraftRow, TokenCallback
from sidecar.decoding.sampling import Sampling
from sidecar.models.pair import ModelPair
from sidecar.progress import STANDALONE, ProgressCallback
from sidecar.tasks.batch import SidecarBatch, sidecar_output
from sidecar.tasks.prompts import DEFAULT_SYSTEM, SpannedPrompt, build_prompt
from sidecar.tasks.requests import RequestBuilder, nth_sampling
from sidecar.tasks.rows import DocumentResult, SidecarOutput, SidecarRequest
from sidecar.tasks.task import SidecarTask


class SidecarEngine:
    def __init__(self, pair: ModelPair, gamma: int = 4, adaptive: bool = True, max_batch: int | None = None) -> None:
        """``max_batch``: the batch limit the caller will mostly run, where it knows it (``SpeculativeDecoder``)."""
        self.pair = pair
        self.decoder = SpeculativeDecoder(pair, gamma=gamma, adaptive=adaptive, max_batch=max_batch)
        self.builder = RequestBuilder(pair, gamma)

    def prompts(self, request: SidecarRequest) -> tuple[SpannedPrompt, SpannedPrompt]:
        """(target's bare prompt, draft's compound prompt)."""
        return self.builder.prompts(request)

    def decode_row(self, index: int, request: SidecarRequest) -> DecodeRow:
        """The main output's row for ``request`` (``RequestBuilder.decode_row``)."""
        return self.builder.decode_row(index, request)

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
        log-probabilities and that many alternatives (``sidecar.decoding.logprobs``): the main output's under
        the target, each sidecar output's under the draft that wrote it. A request that ``cancelled`` reports
        leaves at the next step, its sidecars too.
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
        (``batch.stream_through``); a request is read only when the batch has a slot for it."""
        batch = self.batch(max_batch, schedule, on_tokens=on_tokens, on_progress=on_progress, cancelled=cancelled,
                           expected=expected)
        return stream_through(batch, requests, indices)

    def batch(self, max_batch: int = 8, schedule: str = "continuous", **options: Any) -> SidecarBatch:
        """An empty running batch of sidecar requests to ``add`` to and ``step`` (the server's loop)."""
        return SidecarBatch(self.builder, self.decoder, max_batch, schedule, **options)

    def standalone(self, summaries: list[str], tasks: list[SidecarTask], temperature: float = 0.0,
                   top_p: float = 1.0, seed: int | None = None, batch_size: int = 8,
                   system: str | None = DEFAULT_SYSTEM, on_progress: ProgressCallback | None = None,
                   schedule: str = "continuous") -> list[dict[str, SidecarOutput]]:
        """The baseline: the draft model as a separate tagger prompted with only the main output, its rows
        joining the batch as slots free (``schedule="static"``: in fixed batches). Row ``j`` (summary
        ``j // len(tasks)``, task ``j % len(tasks)``) of a seeded call draws as seed ``seed + j``."""
        sampling = Sampling(temperature, top_p, seed)
        jobs = [(i, task, build_prompt(self.pair.tokenizer, summary, task.standalone_instruction, system).token_ids)
                for i, summary in enumerate(summaries) for task in tasks]
        order = sorted(range(len(jobs)), key=lambda j: len(jobs[j][2]))  # similar lengths prefill together
        batch = self.decoder.batch(0, max_draft_rows=batch_size) if jobs else None
        results: list[dict[str, SidecarOutput]] = [{} for _ in summaries]
        report = on_progress or (lambda phase, done, total: None)
        report(STANDALONE, 0, len(jobs))
        done, queued = 0, iter(order)
        while batch is not None and done < len(jobs):
            while (schedule == "continuous" or not batch.busy) and batch.wants_draft_rows():
                j = next(queued, None)
                if j is None:
                    break
                _, task, prompt = jobs[j]
                draws = 0 if sampling.greedy else draw_key(nth_seed(seed, j), 1)
                batch.add_draft(j, DraftRow(prompt, task.max_new_tokens, draws, sampling=sampling, phase="standalone",
                                            constraint=task.constraint))
            finished = batch.step()
            for j, out in finished:
                i, task, _ = jobs[j]
                results[i][task.name] = sidecar_output(task, out)
            if finished:
                done += len(finished)
                report(STANDALONE, done, len(jobs))
        return results
