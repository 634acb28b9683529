"""``sidecar cost``: roofline projections and the GPU catalog, from the cost model in ``study.cost``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from study.cost import (
    DEFAULT_BATCHES,
    DEFAULT_GAMMA,
    DTYPE_BYTES,
    GB,
    MB,
    TB,
    TERA,
    CostInputError,
    HostFloor,
    ModelFacts,
    RooflineRow,
    TagTokens,
    Workload,
    check_batches,
    count,
    get_gpu,
    load_catalog,
    load_host_floors,
    number,
    roofline_table,
    speculation_vs_plain,
)
from study.cost.speculation import STUDY_CONTEXT
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B
from vocab.modes import Mode

cost_app = typer.Typer(no_args_is_help=True, help="Roofline cost projections for the draft's tagging phase.")


def _positive(name: str, value: float | None) -> None:
    if value is not None:
        number(name, value)  # finite and above 0: NaN and infinity are refused, naming the option


def _parse_batches(text: str) -> list[int]:
    try:
        batches = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise CostInputError(f"--batches must be comma-separated integers, got {text!r}") from exc
    check_batches(batches)
    return batches


HOST_OVERHEAD_HELP = "bench.host_overhead's result the host floors come from (default: the committed one)."


def _host_floor(capture: str | None, host_overhead: Path | None) -> HostFloor | None:
    """The floor of ``--capture`` (None: none, the bare roofline), from ``--host-overhead``."""
    if capture is None:
        if host_overhead is not None:
            raise CostInputError("--host-overhead goes with --capture eager|captured")
        return None
    if capture not in ("eager", "captured"):
        raise CostInputError(f"--capture must be eager or captured, got {capture!r}")
    return load_host_floors(host_overhead).of(capture)


def _cli_workload(
    weights_gb: float | None,
    kv_full_mb: float | None,
    kv_masked_mb: float | None,
    kv_standalone_mb: float | None,
    pair_config: Path | None,
    doc_tokens: int | None,
    summary_tokens: int | None,
    tag_tokens: int,
    dtype: str,
) -> Workload:
    numbers = {"--weights-gb": weights_gb, "--kv-full-mb": kv_full_mb, "--kv-masked-mb": kv_masked_mb}
    for name, value in {**numbers, "--kv-standalone-mb": kv_standalone_mb}.items():
        _positive(name, value)
    if pair_config is not None:
        if any(v is not None for v in (*numbers.values(), kv_standalone_mb)):
            raise CostInputError("give either --pair-config or the --weights-gb/--kv-*-mb numbers, not both")
        if doc_tokens is None or summary_tokens is None:
            raise CostInputError("--pair-config needs --doc-tokens and --summary-tokens")
        count("--doc-tokens", doc_tokens, 0)
        count("--summary-tokens", summary_tokens, 0)
        count("--tag-tokens", tag_tokens)
        if dtype not in DTYPE_BYTES:
            raise CostInputError(f"unknown --dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        tokens = TagTokens(document=doc_tokens, summary=summary_tokens, tags=tag_tokens)
        facts = ModelFacts.from_config_file(pair_config, DTYPE_BYTES[dtype])
        return Workload.from_model(facts, tokens, name=str(pair_config))
    if doc_tokens is not None or summary_tokens is not None:
        raise CostInputError("--doc-tokens and --summary-tokens only apply with --pair-config")
    if weights_gb is None or kv_full_mb is None or kv_masked_mb is None:
        missing = [name for name, value in numbers.items() if value is None]
        raise CostInputError(f"missing {', '.join(missing)} (or give --pair-config)")
    kv: dict[Mode, float] = {"sidecar_attended": kv_full_mb * MB, "sidecar": kv_masked_mb * MB}
    if kv_standalone_mb is not None:
        kv["standalone"] = kv_standalone_mb * MB
    return Workload("command line", weights_gb * GB, kv, "command-line figures")


@cost_app.command("roofline")
def roofline_command(
    weights_gb: float | None = typer.Option(None, help="Draft weight bytes read per decode step, GB."),
    kv_full_mb: float | None = typer.Option(None, help="KV per request with the document attended, MB."),
    kv_masked_mb: float | None = typer.Option(None, help="KV per request with the document evicted, MB."),
    kv_standalone_mb: float | None = typer.Option(None, help="KV per request of a standalone tagger, MB."),
    bandwidth_tbs: float | None = typer.Option(None, help="Memory bandwidth, TB/s (or use --gpu)."),
    tflops: float | None = typer.Option(
        None, help="Peak dense 16-bit TFLOP/s, with --bandwidth-tbs: prices the prefill (--gpu has its own)."
    ),
    gpu: str | None = typer.Option(None, help="GPU name from the catalog: bandwidth, TFLOP/s and $/hour from it."),
    pair_config: Path | None = typer.Option(None, help="Draft model config.json (or its folder)."),
    doc_tokens: int | None = typer.Option(None, help="Document tokens per request (with --pair-config)."),
    summary_tokens: int | None = typer.Option(None, help="Summary tokens per request (with --pair-config)."),
    tag_tokens: int = typer.Option(32, help="Tag tokens generated per request (with --pair-config)."),
    dtype: str = typer.Option("bf16", help="Weight/KV dtype with --pair-config: bf16, fp16 or fp32."),
    batches: str = typer.Option(",".join(map(str, DEFAULT_BATCHES)), help="Comma-separated batch sizes."),
    capture: str | None = typer.Option(
        None, help="eager or captured: each forward pays that mode's host floor (default: none, the bare roofline)."
    ),
    host_overhead: Path | None = typer.Option(None, help=HOST_OVERHEAD_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of rows instead of a table."),
) -> None:
    """Decode-step bytes, time, tokens/s and $ per 1M tokens, document attended vs evicted; with --pair-config,
    each batch's tagging prefill and decode side by side."""
    batch_sizes = _parse_batches(batches)
    host = _host_floor(capture, host_overhead)
    _positive("--bandwidth-tbs", bandwidth_tbs)
    _positive("--tflops", tflops)
    workload = _cli_workload(
        weights_gb,
        kv_full_mb,
        kv_masked_mb,
        kv_standalone_mb,
        pair_config,
        doc_tokens,
        summary_tokens,
        tag_tokens,
        dtype,
    )
    if gpu is not None and bandwidth_tbs is None:
        if tflops is not None:
            raise CostInputError("--tflops goes with --bandwidth-tbs; --gpu takes its TFLOP/s from the catalog")
        chosen = get_gpu(gpu, load_catalog())
        bandwidth, flops_s, usd_per_hour = chosen.bandwidth_bytes_s, chosen.flops_s, chosen.usd_per_hour
        hardware = (
            f"{chosen.name} at {bandwidth / TB:g} TB/s and {chosen.dense_tflops:g} dense {chosen.tflops_dtype} "
            f"TFLOP/s, ${usd_per_hour:.2f}/GPU-hour"
        )
    elif bandwidth_tbs is not None and gpu is None:
        bandwidth, flops_s, usd_per_hour = bandwidth_tbs * TB, None if tflops is None else tflops * TERA, None
        hardware = f"{bandwidth_tbs:g} TB/s" + ("" if tflops is None else f" and {tflops:g} TFLOP/s")
    else:
        raise CostInputError("give exactly one of --gpu and --bandwidth-tbs")
    rows = roofline_table(workload, bandwidth, batch_sizes, usd_per_hour, flops_s, host)
    # a tagging decode step is one forward: it pays a plain step's host work (``HostFloor.plain``)
    hardware += "; " + ("no host floor (the bare roofline; --capture adds one)" if host is None else host.plain.label)

    if as_json:
        typer.echo(json.dumps([asdict(row) for row in rows], indent=2))
        return
    unpriced = None
    if not workload.prices_compute:
        unpriced = "no prefill: it needs the draft's shape and token counts (--pair-config)"
    elif flops_s is None:
        unpriced = "no prefill: it needs a FLOP/s peak (--tflops, or --gpu)"
    _print_roofline_table(rows, f"{workload.description}; {hardware}", unpriced)


def _print_roofline_table(rows: Sequence[RooflineRow], title: str, unpriced: str | None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    has_standalone = rows[0].standalone_ms_per_step is not None
    priced = rows[0].usd_per_million_masked is not None
    # Step costs and throughput/price go in two tables so each fits an 80-column terminal.
    step_columns = [
        ("batch", "batch"),
        ("GB/step\nattended", "full_gb_per_step"),
        ("GB/step\nevicted", "masked_gb_per_step"),
        ("ms/step\nattended", "full_ms_per_step"),
        ("ms/step\nevicted", "masked_ms_per_step"),
        *([("ms/step\nstandalone", "standalone_ms_per_step")] if has_standalone else []),
        ("eviction\nspeedup %", "speedup_pct"),
    ]
    rate_columns = [
        ("batch", "batch"),
        ("tok/s\nattended", "full_tokens_per_s"),
        ("tok/s\nevicted", "masked_tokens_per_s"),
        *([("tok/s\nstandalone", "standalone_tokens_per_s")] if has_standalone else []),
    ]
    if priced:
        rate_columns += [
            ("$/1M tok\nattended", "usd_per_million_full"),
            ("$/1M tok\nevicted", "usd_per_million_masked"),
        ]
        if has_standalone:
            rate_columns.append(("$/1M tok\nstandalone", "usd_per_million_standalone"))
    console = Console()
    for table_title, columns in (
        (title, step_columns),
        ("decode throughput" + (" and price" if priced else ""), rate_columns),
    ):
        table = Table(title=table_title, box=box.SIMPLE)
        for header, _ in columns:
            table.add_column(header, justify="right")
        for row in rows:
            values = asdict(row)
            table.add_row(*(_format_number(values[key]) for _, key in columns))
        console.print(table)
    if unpriced is not None:
        console.print(f"tagging phase per batch: {unpriced}")
        return
    # One cell per mode: the batch's tagging prefill next to its decode steps; and the instruction line a
    # sidecar, attended or evicted, adds to the main draft prefill.
    modes = [("attended", "full"), ("evicted", "masked"), *([("standalone", "standalone")] if has_standalone else [])]
    body = []
    for row in rows:
        values = asdict(row)
        cells = [
            f"{_format_number(values[f'{key}_prefill_ms'])} + {_format_number(values[f'{key}_decode_ms'])}"
            for _, key in modes
        ]
        cells.insert(2, _format_number(row.masked_instruction_ms))
        saving = [_format_number(row.sidecar_saving_pct)] if has_standalone else []
        body.append([str(row.batch), *cells, *saving])
    headers = ["batch", *(f"{label}\nprefill +\ndecode" for label, _ in modes)]
    headers.insert(3, "sidecar\ninstr.\nline")
    if has_standalone:
        headers.append("evicted\nsaves %")
    table = Table(title="tagging phase per batch, ms: prefill + decode steps, a sidecar's instruction line "
                  "(projection)", box=box.SIMPLE)
    for index, header in enumerate(headers):
        # a cell never wraps: its numbers are read together; the headers wrap instead
        table.add_column(header, justify="right", min_width=max(len(cells[index]) for cells in body))
    for cells in body:
        table.add_row(*cells)
    console.print(table)


def _format_number(value: Any) -> str:
    if isinstance(value, int):
        return str(value)
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 1 else f"{value:.2f}"


@cost_app.command("speculation")
def speculation_command(
    acceptance: float = typer.Option(..., help="Accepted / drafted tokens, as the engine measures it (0-1)."),
    gpu: str | None = typer.Option(None, help="One catalog GPU (default: every one)."),
    batches: str = typer.Option("1,8,32", help="Comma-separated batch sizes."),
    context: float = typer.Option(
        STUDY_CONTEXT, help="KV entries per row while decoding (default: the study's, as the report uses)."
    ),
    gamma: int = typer.Option(DEFAULT_GAMMA, help="Draft tokens per step."),
    host_overhead: Path | None = typer.Option(None, help=HOST_OVERHEAD_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of rows instead of a table."),
) -> None:
    """Speculation with Qwen2.5-7B/1.5B against plain decoding, eager (its host cost added to the device's time,
    and overlapping it) and captured, host floors included."""
    batch_sizes = _parse_batches(batches)
    if context < 0:
        raise CostInputError(f"--context must not be negative, got {context}")
    floors = load_host_floors(host_overhead)
    catalog = load_catalog()
    gpus = list(catalog.values()) if gpu is None else [get_gpu(gpu, catalog)]
    # eager in both readings of its host cost against the device's time: added, and overlapping it
    hosts = (floors.eager, floors.eager.overlapping(), floors.captured)
    rows = [
        (chosen.name, speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, chosen, batch, context, acceptance, host, gamma))
        for chosen in gpus
        for host in hosts
        for batch in batch_sizes
    ]
    if as_json:
        typer.echo(json.dumps([{"gpu_type": name, **asdict(row), "reading": row.reading, "speedup": row.speedup}
                               for name, row in rows],
                              indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Qwen2.5-7B/1.5B, gamma {gamma}, acceptance {acceptance:g}: speculative vs plain ms per "
                  f"token; {floors.eager.label} (eager overlapped: a forward takes the larger of its device time "
                  f"and its own host cost); {floors.captured.label}; a plain forward pays "
                  f"{floors.captured.plain.step.label or 'no step work'} instead")
    for header in ("GPU", "capture", "batch", "plain ms/token", "speculative ms/token", "speedup"):
        table.add_column(header, justify="right")
    for name, row in rows:
        table.add_row(name, row.reading, str(row.batch), _format_number(row.plain_s_per_token * 1000),
                      _format_number(row.speculative_s_per_token * 1000),
                      row.speedup_text + (" slower" if row.slower else ""))
    Console().print(table)


@cost_app.command("gpus")
def gpus_command(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """The GPU catalog: bandwidth, peak dense TFLOP/s, $/GPU-hour and where each figure comes from."""
    catalog = load_catalog()
    if as_json:
        typer.echo(json.dumps([asdict(gpu) for gpu in catalog.values()], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="GPU catalog (study/cost/gpus.json)")
    for header in ("GPU", "GB/s", "dense TFLOP/s", "$/GPU-hour", "source"):
        table.add_column(header)
    for gpu in catalog.values():
        price = f"{gpu.usd_per_hour:.2f}"
        if gpu.usd_per_hour_quoted:
            price += f" ({gpu.usd_per_hour_quoted[0]:.2f}-{gpu.usd_per_hour_quoted[1]:.2f})"
        tflops = f"{gpu.dense_tflops:,.0f} {gpu.tflops_dtype}"
        table.add_row(gpu.name, f"{gpu.bandwidth_gb_s:,.0f}", tflops, price, gpu.source)
    Console().print(table)
