"""The report's sections, as document blocks: the verdict and its plot first, then how it was reached.

A reader opening the page sees the verdict table and the $ per tag token plot before any method text;
what was measured, what was projected, the calibration and what the roofline leaves out follow.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from study.cost import DEFAULT_GAMMA, GB, MB, SpeculationRow, Workload, find_gpu, usd_per_million_tokens
from study.report.assemble import ReportData
from study.report.blocks import Block, Bullets, Heading, Image, Paragraph, Table, fmt, fmt_usd
from study.report.capture import SPECULATION_PAIR
from study.report.projections import tag_usd_per_million
from study.report.tagging_cost import TaggingCost
from study.report.verdicts import Verdict
from vocab.modes import MODES


def report_blocks(data: ReportData) -> list[Block]:
    return [
        Heading("Sidecar cost report", 1),
        *_verdict_section(data),
        Heading("What this report compares"),
        Paragraph(_introduction(data)),
        *_measured_section(data),
        *_projection_section(data),
        *_capture_section(data),
        *_calibration_section(data),
        Heading("What the roofline leaves out"),
        Bullets(
            (
                "Kernel efficiency. Each forward is priced at the GPU's peak dense 16-bit TFLOP/s or its peak "
                "bandwidth, whichever binds; real kernels reach a fraction of both. The host's time per forward "
                "(Python, dispatch, kernel launches) is the host floor of the capture mode, added per forward "
                "(see the capture modes above). The calibration ratios show how far measured steps are from the "
                "roofline. The T4's peak is fp16's: it has no bf16 tensor cores, so a bf16 draft runs far below it.",
                "Deployment. A standalone tagger is a deployment of its own, paid for even when tag traffic is low "
                "or bursty, and the summary has to be shipped to it; the sidecar reuses the draft already "
                "resident next to the target. Projections price busy GPU-seconds only.",
                "Step times leave the prefill out: ms/step, measured and projected, is decode steps only, while "
                "tag tok/s and $, measured and projected, count every line (prefill, decode, instruction).",
                "KV per request is averaged over one request's tag tokens; requests that finish early leave the "
                "batch and make later steps cheaper.",
            )
        ),
        Heading("More plots"),
        Image(data.plot_paths["step_time"], "decode step time vs batch size, document attended vs evicted"),
        Image(data.plot_paths["acceptance"], "acceptance of drafted tokens per request, per GPU type, pair and mode"),
    ]


def _introduction(data: ReportData) -> str:
    text = (
        "This report compares the draft model's tagging phase run as a sidecar - after the summary, on the "
        "same GPU, with the document's KV entries evicted (sidecar) or kept (sidecar_attended) - with a "
        "standalone tagger given only the summary (standalone). "
    )
    if data.measurements:
        runs = {m.run_id for m in data.measurements if m.run_id}
        devices = sorted({f"{m.gpu_type} in {m.dtype}" if m.dtype else m.gpu_type for m in data.measurements})
        pairs = sorted({m.pair for m in data.measurements if m.pair})
        text += (
            f"Measured: {len(data.measurements)} throughput rows from {len(runs)} run(s) on {', '.join(devices)}"
            + (f" with pair(s) {', '.join(pairs)}. " if pairs else ". ")
        )
    else:
        text += "Nothing was measured for this report: every figure in it is a projection. "
    workloads = "; ".join(f"{p.workload.name} ({p.workload.description})" for p in data.projections)
    text += (
        f"Projected: a roofline (peak bandwidth and peak dense compute) on the {len(data.catalog)} GPU types of "
        f"the catalog for {workloads}. "
    )
    if data.pair_projections:
        text += (
            "A measured pair is projected from its draft's config, in the dtype it is loaded in on a GPU, with "
            "the measured mean prompt, summary and tag tokens per request (the document is the main prompt "
            "less an estimate of the chat template and instruction); the source study's shapes are an extra "
            "projection, not derived from the measurements. "
        )
    if data.unprojected:
        text += (
            "No projection of the measured pair, so no calibration, for: "
            + "; ".join(data.unprojected)
            + ". Their GPU types are projected with the source study's shapes only, which model another pair. "
        )
    return text.rstrip()


def _saving_cell(verdict: Verdict) -> str:
    saving = verdict.sidecar_saving_pct
    if round(saving, 1) == 0:
        return "even"  # within 0.05%: neither "0.0% cheaper" nor "0.0% dearer" says anything
    return f"{abs(saving):.1f}% {'cheaper' if saving > 0 else 'dearer'}"


def _lead_projections(data: ReportData) -> list[str]:
    """The workloads whose projections the verdict table shows: the measured pairs', else the study's."""
    return [p.workload.name for p in data.projections if p.pair is not None] or [data.projections[0].workload.name]


def _verdict_table(data: ReportData, measured: Sequence[Verdict], projected: Sequence[Verdict]) -> Table:
    """One row per GPU type, pair and basis, one column per batch size: the sidecar's saving per tag token."""
    batches = sorted({v.batch for v in (*measured, *projected)})
    rows: dict[tuple[str, str, str], dict[int, Verdict]] = {}
    for v in (*measured, *projected):
        rows.setdefault((v.gpu_type, v.basis, v.pair), {})[v.batch] = v
    return Table(
        ("GPU type", "basis", "pair", *(f"batch {b}" for b in batches)),
        tuple(
            (gpu_type, basis, pair, *(_saving_cell(by_batch[b]) if b in by_batch else "–" for b in batches))
            for (gpu_type, basis, pair), by_batch in rows.items()
        ),
    )


def _verdict_note(data: ReportData, measured: Sequence[Verdict], lead: Sequence[str]) -> str:
    text = "Each cell: how much cheaper (or dearer) a sidecar tag token is than a standalone tagger's. "
    if measured:
        text += (
            "Rows marked measured are this report's runs at the batch they ran: attributed device seconds per tag "
            "token from the engine's device-time ledger, the sidecar's prefill + decode + instruction line "
            "against the standalone tagger's prefill + decode, as the table below adds them up. "
        )
    else:
        text += "Nothing was measured in both modes with a device-time ledger, so no row is measured. "
    batches = f"{', '.join(map(str, data.verdict_batches[:-1]))} and {data.verdict_batches[-1]}"
    measured_batches = sorted({v.batch for v in measured})
    return text + (
        f"Rows marked projected are not measurements: the roofline of study.cost for {'; '.join(lead)} on the "
        f"catalog's figures for each GPU type, pricing the same lines, at batch {batches}"
        + (f" (the measured batch {data.reference_batch}, and 32-128, " if measured_batches else " (")
        + f"the batch sizes nightly jobs run on GPUs), in {data.capture.captured.label}."
    )


def _lines_table(verdicts: Sequence[Verdict]) -> Table:
    """Each measured verdict's lines per request, in device milliseconds, and per tag token: what it divides."""
    rows = []
    for v in verdicts:
        for mode, cost in (("sidecar", v.sidecar), ("standalone", v.standalone)):
            lines = [("prefill: catch-up and bridge feed" if mode == "sidecar" else "prefill: whole prompt",
                      cost.prefill_s), ("decode: draft steps", cost.decode_s)]
            if mode == "sidecar":
                lines.append(("instruction: its share of the main draft prefill", cost.instruction_s))
            for label, seconds in lines:
                ms = None if seconds is None else seconds * 1000
                rows.append((v.gpu_type, v.pair, str(v.batch), mode, label, fmt(ms, 4), ""))
            rows.append((v.gpu_type, v.pair, str(v.batch), mode, f"total, {fmt(cost.tag_tokens, 4)} tag tokens",
                         fmt(cost.seconds * 1000, 4), fmt(cost.seconds_per_tag_token * 1000, 4)))
    return Table(("GPU type", "pair", "batch", "mode", "line", "device ms / request", "device ms / tag token"),
                 tuple(rows))


def _split_table(verdicts: Sequence[Verdict]) -> Table:
    """Projected verdicts' lines per request, side by side, in milliseconds."""

    def ms(value: float | None) -> str:
        return fmt(None if value is None else value * 1000)

    headers = ("sidecar prefill ms", "sidecar decode ms", "sidecar instruction ms", "standalone prefill ms",
               "standalone decode ms")
    return Table(
        ("GPU type", "pair", "batch", *headers),
        tuple(
            (v.gpu_type, v.pair, str(v.batch), ms(v.sidecar.prefill_s), ms(v.sidecar.decode_s),
             ms(v.sidecar.instruction_s if v.prefill_priced else None), ms(v.standalone.prefill_s),
             ms(v.standalone.decode_s))
            for v in verdicts
        ),
    )


def _verdict_section(data: ReportData) -> list[Block]:
    """The verdict table, the $ plot, then the lines the measured verdicts follow from: the first screen holds
    the answer and its picture."""
    blocks: list[Block] = [
        Heading("Verdict per GPU type"),
        Paragraph("Is a sidecar tag token cheaper than one from a standalone deployment of the same draft model?"),
    ]
    measured = [v for v in data.verdicts if v.basis == "measured"]
    projected = [v for v in data.verdicts if v.basis == "projected"]
    lead = _lead_projections(data)
    lead_projected = [v for v in projected if v.pair in lead]
    if measured or lead_projected:
        blocks += [_verdict_table(data, measured, lead_projected), Paragraph(_verdict_note(data, measured, lead))]
    else:
        blocks.append(
            Paragraph("No verdict: nothing was measured in both modes and the projection has no standalone KV.")
        )
    blocks.append(Image(data.plot_paths["usd_per_mtok"], "$ per 1M tag tokens, sidecar vs standalone, per GPU type"))
    if measured:
        blocks += [
            Paragraph(
                "How the measured verdicts add up: each mode's device seconds per request, line by line, as the "
                "engine's ledger attributed them (a forward's time shared among the rows it served in proportion "
                "to their tokens in it), and per tag token. The sidecar's instruction line is what sidecar mode "
                "adds to the main phase: its masked instruction's share of the main row's draft prefill."
            ),
            _lines_table(measured),
            Bullets(tuple(v.sentence for v in measured)),
        ]
    if data.unledgered:
        blocks.append(
            Paragraph(
                "Measured without a device-time ledger (rows an engine without it wrote), so without a rate or a "
                f"verdict: {'; '.join(data.unledgered)}. Their wall clock is no cost: a stream's clock runs on "
                "through other rows' steps."
            )
        )
    for projection in data.projections:
        of_workload = [v for v in projected if v.pair == projection.workload.name]
        if of_workload:
            blocks.append(Paragraph(_projected_summary(of_workload, projection.workload, data.reference_batch)))
    at_reference = [v for v in projected if v.batch == data.reference_batch and v.prefill_priced]
    if at_reference:
        blocks += [
            Paragraph(
                f"Projected lines per request at batch {data.reference_batch}, side by side: the prefill forward "
                "that yields the first tag token (the standalone tagger's whole prompt, the sidecar's few fed "
                "tokens), the decode steps of the further tag tokens, and the sidecar's instruction line."
            ),
            _split_table(at_reference),
        ]
    compared = {(v.gpu_type, v.pair) for v in measured}
    uncompared = sorted({(g.gpu_type, g.pair) for g in data.groups if g.tag_cost is not None} - compared)
    if uncompared:
        names = ", ".join(f"{gpu} ({pair})" if pair else gpu for gpu, pair in uncompared)
        blocks.append(
            Paragraph(
                "Measured but not compared, for want of sidecar and standalone tagging with a ledger at a common "
                f"batch size: {names}."
            )
        )
    return blocks


def _projected_summary(verdicts: Sequence[Verdict], workload: Workload, reference_batch: int) -> str:
    """One paragraph for all projected verdicts of one workload: how much cheaper per batch size, and what the
    prefill weighs at the reference batch."""
    by_batch: dict[int, list[float]] = {}
    for v in verdicts:
        by_batch.setdefault(v.batch, []).append(round(v.sidecar_saving_pct, 1))
    priced = all(v.prefill_priced for v in verdicts)
    text = (
        f"Projected with {workload.name} on {len({v.gpu_type for v in verdicts})} GPU types, "
        f"{'prefill, decode and instruction lines' if priced else 'decode steps only'}: a sidecar tag token costs "
        + "; ".join(f"{_spread(savings)} at batch {batch}" for batch, savings in sorted(by_batch.items()))
        + " than a standalone tagger's."
    )
    at_reference = [v for v in verdicts if v.batch == reference_batch]
    standalone_share = _prefill_share([v.standalone for v in at_reference])
    sidecar_share = _prefill_share([v.sidecar for v in at_reference])
    if priced and standalone_share and sidecar_share and workload.tokens is not None:
        prompt, _ = workload.tokens.prefill("standalone")
        feed, cached = workload.tokens.prefill("sidecar")
        text += (
            f" At batch {reference_batch} the standalone tagger prefills its {prompt}-token prompt (template, "
            f"summary, tag instruction): {standalone_share} of its tagging time. The sidecar feeds {feed} tokens "
            f"into the cache it kept ({cached} entries, document evicted): {sidecar_share} of its own, beside its "
            f"instruction line ({workload.tokens.sidecar_instruction} tokens of the main draft prefill)."
        )
    kv = workload.kv_bytes_per_request
    if all(v.sidecar_saving_pct < 0 for v in at_reference) and at_reference:
        text += (
            f" With the document evicted, the sidecar still reads its main prompt's KV entries "
            f"({kv['sidecar'] / MB:.2f} vs {kv['standalone'] / MB:.2f} MB per request), so per decode step it cannot "
            "beat a standalone tagger"
        )
        text += (
            f"; at batch {reference_batch} the prefill it saves does not make up for that."
            if priced
            else "; what it saves is what this projection leaves out: the standalone's summary prefill (the "
            "workload has no model shape to price it) and its separate deployment."
        )
    return text


def _spread(savings: Sequence[float]) -> str:
    """'3.1-4.0% less', '2.0% more', or '1.0% more to 2.0% less' across GPU types."""
    low, high = min(savings), max(savings)
    if low >= 0 or high <= 0:
        amounts = sorted({abs(low), abs(high)})
        amount = f"{amounts[0]:.1f}%" if len(amounts) == 1 else f"{amounts[0]:.1f}-{amounts[1]:.1f}%"
        return f"{amount} {'less' if low >= 0 else 'more'}"
    return f"{abs(low):.1f}% more to {high:.1f}% less"


def _prefill_share(costs: Sequence[TaggingCost]) -> str | None:
    """The prefill's share of the tagging time, as a percentage or a range of them; None if any is unpriced."""
    if not costs or any(c.prefill_s is None for c in costs):
        return None
    shares = [round((c.prefill_s or 0) / c.seconds * 100) for c in costs]
    return f"{shares[0]}%" if min(shares) == max(shares) else f"{min(shares)}-{max(shares)}%"


def _measured_section(data: ReportData) -> list[Block]:
    blocks: list[Block] = [Heading("What was measured")]
    if not data.groups:
        return [*blocks, Paragraph("No measurements were given.")]
    table_rows = []
    for g in data.groups:
        price = data.price(g.gpu_type)
        usd = None if price is None or g.tag_tokens_per_s is None else usd_per_million_tokens(price, g.tag_tokens_per_s)
        table_rows.append(
            (
                g.gpu_type,
                g.pair,
                g.mode,
                str(g.batch_size),
                str(len(g.run_ids)),
                fmt(g.tag_tokens_per_s),
                fmt(None if g.tag_cost is None else g.tag_cost.seconds_per_tag_token * 1000),
                fmt_usd(usd),
                fmt(g.tag_ms_per_step),
                fmt(g.tag_first_token_s),
                fmt(None if g.kv_bytes_per_request is None else g.kv_bytes_per_request / MB),
                fmt(g.summary_tokens_per_s),
                fmt(g.acceptance_rate),
            )
        )
    blocks += [
        Table(
            (
                "GPU type",
                "pair",
                "mode",
                "batch",
                "runs",
                "tag tok/s",
                "device ms/tag tok",
                "$/1M tag tok",
                "tag ms/step (wall)",
                "first tag token s (wall)",
                "KV MB/request",
                "summary tok/s",
                "acceptance",
            ),
            tuple(table_rows),
        ),
        Paragraph(
            "Cost: tag tok/s is the tagging rows' tag tokens per attributed device second, every line included "
            "(prefill, decode and, for a sidecar, its instruction line), from the engine's device-time ledger; "
            "device ms/tag tok is its inverse and $ its price at the catalog's rent for the GPU type (devices "
            "outside the catalog have none). A run written without the ledger has none of the three. Latency, "
            "wall clock, never a cost: ms/step is the batches' decode time per decode step, prefill excluded (a "
            "batch steps until its longest row is done, and the first tag token comes from the prefill, so a batch "
            "whose longest row made n tokens took n - 1 steps); first tag token is the mean time from a row's "
            "arrival in its batch to its first committed token. Summary tok/s (per attributed device second) and "
            "acceptance (accepted / drafted) come from the speculative main phase."
        ),
    ]
    if data.acceptance:
        blocks += [
            Paragraph("Acceptance per request in the main phase (requests that drafted), as plotted below:"),
            Table(
                ("GPU type", "pair", "mode", "requests", "min", "median", "max"),
                tuple(
                    (
                        gpu,
                        pair,
                        mode,
                        str(len(rates)),
                        fmt(min(rates)),
                        fmt(statistics.median(rates)),
                        fmt(max(rates)),
                    )
                    for (gpu, pair, mode), rates in data.acceptance.items()
                ),
            ),
        ]
    eviction = _eviction_rows(data)
    if eviction:
        blocks += [
            Paragraph("Eviction: the same tagging step with the document's KV entries kept and evicted."),
            Table(
                (
                    "GPU type",
                    "pair",
                    "batch",
                    "attended ms/step",
                    "evicted ms/step",
                    "measured speedup %",
                    "projected speedup %",
                ),
                tuple(eviction),
            ),
        ]
    return blocks


def _eviction_rows(data: ReportData) -> list[tuple[str, ...]]:
    by_key = {(g.gpu_type, g.pair, g.mode, g.batch_size): g for g in data.groups if g.tag_ms_per_step}
    rows = []
    for (gpu_type, pair, mode, batch), evicted in by_key.items():
        attended = by_key.get((gpu_type, pair, "sidecar_attended", batch))
        if mode != "sidecar" or attended is None or not evicted.tag_ms_per_step or not attended.tag_ms_per_step:
            continue
        own = data.pair_projections.get(pair)
        projected = None
        if own is not None and find_gpu(gpu_type, data.catalog) is not None:
            full = own.workload.step_bytes("sidecar_attended", batch)
            projected = (full / own.workload.step_bytes("sidecar", batch) - 1) * 100
        rows.append(
            (
                gpu_type,
                pair,
                str(batch),
                fmt(attended.tag_ms_per_step),
                fmt(evicted.tag_ms_per_step),
                fmt((attended.tag_ms_per_step / evicted.tag_ms_per_step - 1) * 100),
                fmt(projected),
            )
        )
    return rows


def _projection_section(data: ReportData) -> list[Block]:
    blocks: list[Block] = [
        Heading("What was projected"),
        Paragraph(
            "A roofline: each forward takes the longer of its bytes over the GPU's peak bandwidth and its FLOPs "
            "over its peak dense 16-bit TFLOP/s. A tagging decode step is memory-bandwidth bound: it reads the "
            "draft's weights once and each request's KV cache once, so bytes per step = weights + batch x KV per "
            "request and time = bytes / bandwidth. The tagging phase starts with a prefill forward that yields "
            "the first tag token: the standalone tagger's whole prompt, compute-bound at batch (FLOPs = 2 x "
            "weights x tokens + 4 x layers x query width x tokens x keys attended, per request), against the "
            "sidecar's few fed tokens into the cache it kept. A sidecar also carries its instruction line: its "
            "masked instruction's share of the main row's draft prefill, in proportion to its tokens there, as the "
            "engine's ledger charges it. Tag tokens/s = batch x tags / (prefill + (tags - 1) decode steps + "
            "instruction line), the way a measured tag tok/s counts them, and $ per 1M tag tokens = $/GPU-hour / 3600 "
            "/ tag tokens/s x 1e6. Bandwidth, TFLOP/s and rent come from the GPU catalog (study/cost/gpus.json, "
            "with a source per entry). Each forward also pays the host floor of the capture mode; these "
            f"projections assume {data.capture.captured.label}. These are projections, not measurements. The "
            "full grid of batch sizes is in the cost rows and the plots."
        ),
    ]
    for projection in data.projections:
        workload = projection.workload
        kv = ", ".join(f"{mode} {kv / MB:.3g} MB" for mode, kv in workload.kv_bytes_per_request.items())
        source = (
            "Not derived from the measurements"
            if projection.pair is None
            else f"The measured pair {projection.pair}, from its draft's config and the measured token counts"
        )
        rows = []
        for gpu in data.catalog.values():
            for batch in _table_batches(data.batches):
                by_mode = {mode: projection.row(gpu.name, mode, batch) for mode in MODES}
                attended, evicted, alone = by_mode["sidecar_attended"], by_mode["sidecar"], by_mode["standalone"]
                speedup = (
                    (attended.ms_per_step / evicted.ms_per_step - 1) * 100 if attended is not None and evicted else None
                )
                rows.append(
                    (
                        gpu.name,
                        f"{gpu.bandwidth_gb_s:,.0f}",
                        f"{gpu.dense_tflops:,.0f}",
                        f"{gpu.usd_per_hour:.2f}",
                        str(batch),
                        *(fmt(None if row is None else row.ms_per_step) for row in (attended, evicted, alone)),
                        fmt(speedup),
                        *(fmt(None if row is None else row.prefill_ms) for row in (evicted, alone)),
                        fmt(None if evicted is None else evicted.instruction_ms),
                        *(fmt_usd(None if row is None else tag_usd_per_million(row)) for row in (evicted, alone)),
                    )
                )
        blocks += [
            Heading(workload.name, 3),
            Paragraph(
                f"{source}: {workload.description}. Weights read per step: "
                f"{workload.weight_bytes_per_step / GB:.3g} GB; KV per request: {kv}."
                + (
                    ""
                    if workload.prices_compute
                    else " Without the draft's shape the prefill is not priced: $ counts decode steps only."
                )
            ),
            Table(
                (
                    "GPU",
                    "GB/s",
                    "dense TFLOP/s",
                    "$/GPU-hour",
                    "batch",
                    "attended ms/step",
                    "evicted ms/step",
                    "standalone ms/step",
                    "eviction speedup %",
                    "evicted prefill ms",
                    "standalone prefill ms",
                    "evicted instruction ms",
                    "sidecar $/1M tag tok",
                    "standalone $/1M tag tok",
                ),
                tuple(rows),
            ),
        ]
    return blocks


def _speedup_cell(row: SpeculationRow) -> str:
    return f"{row.speedup:.2f}x" + (" (slower)" if row.slower else "")


def _capture_section(data: ReportData) -> list[Block]:
    """Eager against captured: the floors, and speculation with the study's pair against plain decoding."""
    modes = data.capture
    blocks: list[Block] = [Heading("Capture mode: eager against captured")]
    intro = (
        "On a GPU a forward also costs its host work (Python, dispatch, kernel launches), for every layer "
        "whatever the width: the host floor, measured by python -m bench.host_overhead at production depth "
        "and tiny width, where compute is about zero, and scaled by the projected model's layers over the "
        "benchmark's. Each projected forward takes max(bytes / bandwidth, FLOPs / peak) + the floor of its "
        "capture mode. The projections above assume captured mode (CUDA graphs): "
        f"{modes.captured.label}. "
    )
    if modes.eager is None:
        return [*blocks, Paragraph(
            intro + "No host-overhead result is committed (bench/results/host_overhead_gpu.json or "
            "host_overhead_cpu.json), so eager mode is not projected and every projection here is a lower bound: "
            "run python -m bench.host_overhead.")]
    intro += f"Eager mode: {modes.eager.label}."
    blocks.append(Paragraph(intro))
    if modes.acceptance is None:
        return [*blocks, Paragraph(
            "Speculation against plain decoding is not projected: no acceptance of the main phase was measured.")]
    measured_by = f" for {', '.join(modes.acceptance_pairs)}" if modes.acceptance_pairs else ""
    captured_head = "captured" + ("" if modes.captured.measured else " (lower bound)")
    batches = sorted({r.batch for by_mode in modes.rows.values() for r in by_mode["eager"]})
    rows = tuple(
        (gpu, *(_speedup_cell(r) for r in by_mode["eager"]), *(_speedup_cell(r) for r in by_mode["captured"]))
        for gpu, by_mode in modes.rows.items()
    )
    blocks += [
        Paragraph(
            f"Speculation with {SPECULATION_PAIR} (published shapes, bf16) against plain decoding of the target, "
            f"per token of each row: a step of {DEFAULT_GAMMA} draft forwards and a verify of {DEFAULT_GAMMA + 1} "
            f"tokens, each paying the floor, yields 1 + acceptance x {DEFAULT_GAMMA} tokens, at the measured "
            f"acceptance {modes.acceptance:.2f}{measured_by}; plain decoding pays one target forward per token. "
            "Each cell is plain time over speculative time: below 1x speculation is slower."
            + ("" if modes.captured.measured else " The captured floor is unmeasured, so captured times are lower "
               "bounds and its speedups upper bounds.")
        ),
        Table(("GPU", *(f"eager, batch {b}" for b in batches), *(f"{captured_head}, batch {b}" for b in batches)),
              rows),
    ]
    slower = modes.eager_slower
    if slower:
        where = "; ".join(f"{gpu} at batch {', '.join(map(str, b))}" for gpu, b in slower.items())
        blocks.append(Paragraph(
            f"In eager mode speculation with {SPECULATION_PAIR} is slower than plain decoding on: {where}. "
            "There the host floor of the draft's forwards outweighs the target forwards they save."))
    else:
        blocks.append(Paragraph(
            f"In eager mode speculation with {SPECULATION_PAIR} beats plain decoding on every catalog GPU at batch "
            f"{', '.join(map(str, batches))}."))
    return blocks


def _calibration_section(data: ReportData) -> list[Block]:
    blocks: list[Block] = [Heading("Calibration: measured ÷ projected")]
    if data.calibration:
        blocks += [
            Table(
                (
                    "GPU type",
                    "catalog GPU",
                    "projected as",
                    "mode",
                    "batch",
                    "measured ms/step",
                    "projected ms/step",
                    "measured ÷ projected",
                ),
                tuple(
                    (
                        c.gpu_type,
                        c.catalog_gpu,
                        projection.workload.name,
                        c.mode,
                        str(c.batch),
                        fmt(c.measured_ms_per_step),
                        fmt(c.projected_ms_per_step),
                        f"{c.measured_over_projected:.2f}",
                    )
                    for projection, c in data.calibration
                ),
            ),
            Paragraph(
                "Each measured decode step is divided by the projection of its own pair (draft config, GPU dtype, "
                "measured token counts) on the catalog's figures for its GPU type. Above 1 the measured step is "
                "slower than the bandwidth roofline."
            ),
        ]
    else:
        blocks.append(
            Paragraph(
                "Nothing is calibrated: no decode step was measured on a catalogued GPU with a projection of its "
                "own pair."
            )
        )
    if data.unprojected:
        blocks.append(
            Paragraph(f"Not calibrated, for want of a projection of their pair: {'; '.join(data.unprojected)}.")
        )
    if data.uncatalogued:
        blocks.append(
            Paragraph(
                f"Measured only (not in the GPU catalog, so no bandwidth or price): {', '.join(data.uncatalogued)}."
            )
        )
    return blocks


def _table_batches(batches: Sequence[int]) -> list[int]:
    """Smallest, a middle and the largest batch size: enough rows to read the trend in a table."""
    ordered = sorted(set(batches))
    return sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})
