"""The command line: ``parse_args`` with its sizes per profile, ``main``, which times the step costs and checks every
pair within one global deadline and writes the results, and ``result_file_name``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from bench import common
from bench.common import (
    add_bench_arguments,
    apply_profile,
    environment,
    parse_bench_args,
    profile_suffix,
    write_results,
)
from bench.gpu_check import __doc__ as OVERVIEW
from bench.gpu_check.capture_modes import CAPTURE_MODES, CAPTURE_SCALES, capture_modes, default_modes
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.host_floor import HOST_FLOOR_SCALES, host_floor
from bench.gpu_check.markdown import markdown
from bench.gpu_check.pairs import DEFAULT_PAIRS, resolve_pair
from bench.gpu_check.parts import check_pair, failure
from bench.gpu_check.projected import with_projection
from bench.gpu_check.step_costs import STEP_COST_SCALES, step_costs
from sidecar.models.dtype_choice import requested_dtype
from sidecar.models.loading import NAMED_PAIRS, default_device
from sidecar.settings import DTYPE_HELP, DTYPE_NAMES

SIZES = {
    "quick": {"identity_prompts": 2, "batches": "1,2", "max_new_tokens": 8, "chars": 400, "assisted_documents": 1,
              "sync_batches": "1,2", "step_cost_batches": "1,2", "step_cost_context": 32, "capture_batches": "1,2"},
    "standard": {"identity_prompts": 8, "batches": "1,8,32,64", "max_new_tokens": 64, "chars": 1500,
                 "assisted_documents": 4, "sync_batches": "1,8,32", "step_cost_batches": "1,8,32,64",
                 "step_cost_context": 512, "capture_batches": "1,8,32"},
    "full": {"identity_prompts": 16, "batches": "1,8,32,64,128", "max_new_tokens": 128, "chars": 1500,
             "assisted_documents": 8, "sync_batches": "1,8,32,64", "step_cost_batches": "1,8,32,64",
             "step_cost_context": 512, "capture_batches": "1,8,32"},
}
# the share of the budget the step costs may take, then the share of what is left the capture modes may take: a
# captured mode compiles each of about ten shapes of a 28-layer stack, the slowest part on a GPU
STEP_COSTS_SHARE = 0.25
CAPTURE_SHARE = 0.75
# then the host floors' share of what is left: two modes of a 28-layer stack at hidden 64, one of them compiled; the
# pairs' parts keep the rest (where no real pair is on disk, as on a lent machine, the tiny pair's: seconds)
HOST_FLOOR_SHARE = 0.85


def result_file_name(args: argparse.Namespace, device: torch.device, default_pairs: bool) -> str:
    """gpu_check on a GPU with the default pairs at standard sizes; gpu_check_cpu_tiny_quick and so on otherwise."""
    name = "gpu_check" + ("" if device.type == "cuda" else f"_{device.type}")
    if not default_pairs:
        name += "_" + re.sub(r"[^A-Za-z0-9]+", "-", "+".join(args.pair)).strip("-")[:40]
    return name + profile_suffix(args.profile)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # the package is run as `python -m bench.gpu_check`: argparse would call it __main__.py
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=OVERVIEW,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", action="append",
                        help="a pair to check (repeatable): tiny, qwen-coder-small, "
                             f"{', '.join(NAMED_PAIRS)} or TARGET,DRAFT; default: {', '.join(DEFAULT_PAIRS)} where "
                             "on disk, else the tiny pair")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    # each pair's choice and its reason are printed and reported (``sidecar.models.dtype_choice``)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help=DTYPE_HELP)
    parser.add_argument("--budget-s", type=float, default=480.0, help="global deadline in seconds (default 8 min)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--identity-prompts", type=int)
    parser.add_argument("--batches", help="comma-separated batch sizes for throughput; the largest for memory")
    parser.add_argument("--sync-batches", help="comma-separated batch sizes for the sync count")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--chars", type=int, help="cut each document to this many characters")
    parser.add_argument("--assisted-documents", type=int, help="prompts HF assisted generation decodes, one by one")
    parser.add_argument("--step-costs", choices=STEP_COST_SCALES,
                        help="time forwards of random Qwen2.5-7B and 1.5B: full shapes (default on CUDA), small "
                             "ones (default elsewhere: the code path only) or off")
    parser.add_argument("--step-cost-batches", help="comma-separated batch sizes the step costs are timed at")
    parser.add_argument("--step-cost-context", type=int, help="KV entries per row the timed forwards attend")
    parser.add_argument("--capture-check", choices=CAPTURE_SCALES,
                        help="plain and speculative tokens/s per capture mode of random Qwen2.5-7B + 1.5B: full "
                             "shapes (default on CUDA), small ones (default elsewhere: the code path only) or off")
    parser.add_argument("--host-floor", choices=HOST_FLOOR_SCALES,
                        help="bench.host_overhead per capture mode on this device, the host floors the cost model "
                             "prices forwards with: at its 28 layers, written as host_overhead_gpu (default on "
                             "CUDA), at 2 layers without a result file (small: the code path only) or off (default "
                             "elsewhere)")
    parser.add_argument("--capture-modes", help="comma-separated capture modes to compare (default: eager,cudagraph "
                                                "on CUDA, else eager,compile)")
    parser.add_argument("--capture-batches", help="comma-separated batch sizes of the speculative runs")
    add_bench_arguments(parser)
    args = parse_bench_args(parser, argv)
    apply_profile(args, SIZES)
    unknown = [m for m in (args.capture_modes or "").split(",") if m and m not in CAPTURE_MODES]
    if unknown:
        parser.error(f"--capture-modes: unknown mode {', '.join(unknown)} (choose from {', '.join(CAPTURE_MODES)})")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a lent GPU machine has no network: use what is on disk
    started = time.monotonic()
    deadline = Deadline.after(args.budget_s)
    device = default_device(args.device)
    args.device = str(device)
    args.step_costs = args.step_costs or ("full" if device.type == "cuda" else "small")
    args.capture_check = args.capture_check or ("full" if device.type == "cuda" else "small")
    args.host_floor = args.host_floor or ("full" if device.type == "cuda" else "off")
    args.capture_modes = args.capture_modes or ",".join(default_modes(device))
    default_pairs = args.pair is None
    results_name = result_file_name(args, device, default_pairs)
    payload = {"environment": environment(device, None), "args": vars(args), "absent": {}, "fallback": None,
               "pairs": [], "step_costs": {"skipped": "not reached"}, "host_floor": {"skipped": "not reached"},
               "capture": {"skipped": "not reached"},
               "seconds": 0.0, "complete": False}

    def save() -> None:
        """The results so far: a check cut off by its machine's time limit keeps every part it finished."""
        dtypes = {r["dtype"] for r in payload["pairs"] if "dtype" in r}  # the dtype measured in, where one
        payload["environment"] = environment(device, getattr(torch, dtypes.pop()) if len(dtypes) == 1 else None)
        payload["seconds"] = time.monotonic() - started
        write_results(results_name, payload, markdown(payload))

    # first, within a share of the budget: what the step costs leave unused goes to the pairs
    payload["step_costs"] = measure_step_costs(args, device, deadline.share(STEP_COSTS_SHARE), results_name)
    save()
    payload["capture"] = measure_capture_modes(args, device, deadline.share(CAPTURE_SHARE))
    save()
    # then the host floors, from the pairs' time, and the cost model's projection of the capture rows with them
    payload["host_floor"] = measure_host_floor(args, device, deadline.share(HOST_FLOOR_SHARE))
    payload["capture"] = project_capture_modes(payload["capture"])
    save()
    names = list(DEFAULT_PAIRS) if default_pairs else args.pair
    resolved = {name: resolve_pair(name) for name in names}
    present = [(name, spec) for name, (spec, _) in resolved.items() if spec is not None]
    payload["absent"] = {name: where for name, (spec, where) in resolved.items() if spec is None}
    if default_pairs and not present:
        present = [("tiny", "tiny")]
        payload["fallback"] = ("No real pair is on disk, so the tiny random pair ran instead: its identity, syncs and "
                               "code paths are real, its speeds and kernel choices (at its tiny shapes) say nothing "
                               "about real models.")
    for i, (name, spec) in enumerate(present):
        if reason := deadline.skip_reason():
            payload["absent"][name] = reason.removeprefix("skipped: ")
            continue
        # each pair gets an equal share of what is left; what one leaves unused goes to the next
        payload["pairs"].append(check_pair(name, spec, args, deadline.share(1 / (len(present) - i))))
        save()
    payload["complete"] = True
    save()
    return payload


def requested_or_bf16(args: argparse.Namespace) -> torch.dtype:
    """The random-weight parts' dtype: ``--dtype`` (or ``SIDECAR_DTYPE``) when named, else bf16 (what a GPU runs)."""
    requested = requested_dtype(args.dtype)
    return torch.bfloat16 if requested is None else requested.dtype


def measure_capture_modes(args: argparse.Namespace, device: torch.device, deadline: Deadline) -> dict:
    """The capture-mode part's result (``capture_modes``)."""
    if args.capture_check == "off":
        return {"skipped": "off (--capture-check off)"}
    if reason := deadline.skip_reason():
        return {"skipped": reason.removeprefix("skipped: ")}
    modes = [m for m in args.capture_modes.split(",") if m]
    batches = [int(b) for b in args.capture_batches.split(",") if b]
    try:
        return capture_modes(args.capture_check, modes, batches, args.max_new_tokens, args.gamma, device,
                             requested_or_bf16(args), deadline)
    except Exception as exc:  # reported, and fails the check; the pairs still run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": failure(exc)}


def measure_host_floor(args: argparse.Namespace, device: torch.device, deadline: Deadline) -> dict:
    """The host-floor part's result (``host_floor``)."""
    if args.host_floor == "off":
        return {"skipped": "off (--host-floor off)"}
    if reason := deadline.skip_reason():
        return {"skipped": reason.removeprefix("skipped: ")}
    try:
        return host_floor(args.host_floor, [m for m in args.capture_modes.split(",") if m], args.profile, device,
                          deadline)
    except Exception as exc:  # reported, and fails the check; the other parts still run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": failure(exc)}


def project_capture_modes(capture: dict) -> dict:
    """The capture part's result with the cost model's projection of each row (``projected``), after the host
    floors; one that fails leaves the measurements standing and says why."""
    try:
        return with_projection(capture)
    except Exception as exc:  # reported beside the rows; the measurements stand
        return capture | {"projection": {"skipped": "error: " + failure(exc)}}


def measure_step_costs(args: argparse.Namespace, device: torch.device, deadline: Deadline, name: str) -> dict:
    """The step-cost part's result; its table, with where it was measured, goes to NAME_step_costs.json."""
    if args.step_costs == "off":
        return {"skipped": "off (--step-costs off)"}
    if reason := deadline.skip_reason():
        return {"skipped": reason.removeprefix("skipped: ")}
    dtype = requested_or_bf16(args)
    batches = [int(b) for b in args.step_cost_batches.split(",") if b]
    try:
        result = step_costs(args.step_costs, batches, args.gamma, args.step_cost_context, device, dtype, deadline)
    except Exception as exc:  # reported, and fails the check; the pairs still run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": failure(exc)}
    table = common.RESULTS / f"{name}_step_costs.json"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    table.write_text(json.dumps({"environment": environment(device, dtype)} | result, indent=2))
    return result | {"table": str(table)}
