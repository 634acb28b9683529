"""The GPU check's host-floor part (bench/gpu_check/host_floor.py): ``bench.host_overhead`` per capture mode on the
check's device, written where the cost model reads it on a GPU, its faults failing the check."""

from __future__ import annotations

import torch

from bench import host_overhead
from bench.gpu_check import host_floor as part
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.main import main
from bench.gpu_check.parts import errors


def test_the_small_part_measures_each_mode_on_a_cpu_without_a_result_file(bench_results, monkeypatch) -> None:
    monkeypatch.setattr("bench.gpu_check.parts.PARTS", [])  # the pair's parts have their own tests
    monkeypatch.setitem(host_overhead.SIZES, "quick", dict(calls=5, runs=1))
    payload = main(["--pair", "tiny", "--device", "cpu", "--quick", "--allow-dirty", "--step-costs", "off",
                    "--capture-check", "off", "--host-floor", "small", "--capture-modes", "eager"])
    assert errors(payload) == []
    h = payload["host_floor"]
    assert (h["scale"], h["layers"], h["written"], h["skipped_modes"], h["failed"]) == ("small", 2, None, {}, [])
    (row,) = h["rows"]
    assert row["mode"] == "eager" and row["our_forward_ms"] > 0 and row["fixed_hf_forwards_per_step"] > 0
    assert not list(bench_results.glob("host_overhead*"))  # a CPU's floors are the benchmark's own
    md = (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()
    assert "Host floors (`bench.host_overhead` on this device: the tiny pair at 2 layers, hidden 64, float32; no " \
           "result file (the code path only)):" in md
    assert "| mode | HF forward ms | our forward ms |" in md
    # off by default on a CPU, and the check says so
    off = main(["--pair", "tiny", "--device", "cpu", "--quick", "--allow-dirty", "--step-costs", "off",
                "--capture-check", "off"])
    assert off["host_floor"] == {"skipped": "off (--host-floor off)"}
    assert "Host floors: off (--host-floor off)." in (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()


def test_on_cuda_the_full_part_writes_the_result_the_cost_model_reads(monkeypatch) -> None:
    """At full scale on CUDA the rows, at the benchmark's depth and the check's profile's sizes, are written by the
    benchmark's own writer (whose name on CUDA is host_overhead_gpu, tests/test_bench_host_overhead.py) after each
    mode; a mode that would start with less than ``MIN_SECONDS`` left is skipped and says so."""
    measured, written = [], []
    clean = {"graph_breaks": 0, "recompiles_after_warmup": 0, "cudagraph_skips": 0, "skip_reasons": []}
    monkeypatch.setattr(host_overhead, "measure_mode",
                        lambda mode, calls, runs, device, layers: measured.append((mode, calls, runs, layers))
                        or {"mode": mode, **clean})
    monkeypatch.setattr(host_overhead, "write",
                        lambda rows, device, profile, sizes, layers: written.append((list(rows), profile, layers))
                        or "host_overhead_gpu")
    cuda = torch.device("cuda")
    result = part.host_floor("full", ["eager", "cudagraph"], "standard", cuda, Deadline.after(600))
    sizes = host_overhead.SIZES["standard"]
    assert measured == [(m, sizes["calls"], sizes["runs"], host_overhead.LAYERS) for m in ("eager", "cudagraph")]
    # after each mode: a check its machine cuts off keeps the eager row
    assert written == [([{"mode": "eager", **clean}], "standard", host_overhead.LAYERS),
                       ([{"mode": "eager", **clean}, {"mode": "cudagraph", **clean}], "standard", host_overhead.LAYERS)]
    assert result["failed"] == []
    assert result["written"] == "bench/results/host_overhead_gpu.json"
    late = part.host_floor("full", ["eager", "cudagraph"], "standard", cuda, Deadline.after(part.MIN_SECONDS / 2))
    assert [r["mode"] for r in late["rows"]] == ["eager"] and "cudagraph" in late["skipped_modes"]
    assert not part.host_floor("small", ["eager"], "standard", cuda, Deadline.after(600))["written"]


def test_a_graph_break_a_late_compile_or_an_uncaptured_graph_fails_the_check() -> None:
    rows = [{"mode": "eager", "graph_breaks": 0, "recompiles_after_warmup": 0, "cudagraph_skips": 0,
             "skip_reasons": []},
            {"mode": "cudagraph", "graph_breaks": 0, "recompiles_after_warmup": 1, "cudagraph_skips": 3,
             "skip_reasons": ["mutated inputs"]}]
    failed = part.faults(rows)
    assert failed == ["cudagraph: 1 recompiles after warmup", "cudagraph: 3 graphs not captured (mutated inputs)"]
    payload = {"pairs": [], "host_floor": {"rows": rows, "failed": failed}}
    assert errors(payload) == ["host floor: cudagraph: 1 recompiles after warmup",
                               "host floor: cudagraph: 3 graphs not captured (mutated inputs)"]
    assert errors({"pairs": [], "host_floor": {"error": "RuntimeError: x"}}) == ["host floor: RuntimeError: x"]
