"""``bench.host_overhead`` runs and writes what its table claims (at two layers: the counts, not the speed)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import common, host_overhead


@pytest.mark.slow
def test_the_host_overhead_bench_writes_each_modes_ratios_and_counters(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(host_overhead, "LAYERS", 2)
    monkeypatch.setitem(host_overhead.SIZES, "quick", dict(calls=5, runs=1))
    host_overhead.main(["--quick", "--allow-dirty", "--modes", "eager"])
    payload = json.loads((tmp_path / "host_overhead_cpu_quick.json").read_text())
    (row,) = payload["rows"]
    assert row["mode"] == "eager" and payload["layers"] == 2
    for key in ("hf_forward_ms", "our_forward_ms", "fixed_ms_per_target_forward", "adaptive_ms_per_token"):
        assert row[key] > 0, key
    assert row["our_over_hf"] == pytest.approx(row["our_forward_ms"] / row["hf_forward_ms"])
    assert row["fixed_draft_forwards_per_step"] > 1  # a fixed-gamma-4 step drafts, up to 4 forwards
    assert row["plain_ms_per_token"] > 0 and row["plain_hf_forwards_per_step"] > 0  # gamma 0: a plain step
    # eager forwards call no compiled region, and chain none
    assert row["fixed_draft_graph_calls_per_step"] == 0 and row["chained_forwards"] == {"target": 0, "draft": 0}
    assert row["graph_breaks"] == 0 and row["recompiles"] == 0 and row["compiles"] == 0  # eager compiles nothing
    assert "host_overhead" in (tmp_path / "host_overhead_cpu_quick.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_steps_host_work_outside_its_graphs_is_timed_per_step_per_forward_and_by_batch(
        tmp_path, monkeypatch):
    """Compiled (one layer: compiling is slow on a CPU): the step's host time outside its compiled calls is part of
    the step (the compiled calls took the rest), per forward it is that over the step's forwards, and it is timed
    at each of ``HOST_BATCHES``, a speculative step's and a plain one's; nothing compiles after warm-up."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(host_overhead, "LAYERS", 1)
    monkeypatch.setattr(host_overhead, "HOST_BATCHES", (1, 2))
    monkeypatch.setitem(host_overhead.SIZES, "quick", dict(calls=5, runs=1))
    torch._dynamo.reset()  # dynamo keeps graphs by code object, across pairs: this pair compiles its own
    host_overhead.main(["--quick", "--allow-dirty", "--modes", "compile"])
    torch._dynamo.reset()
    (row,) = json.loads((tmp_path / "host_overhead_cpu_quick.json").read_text())["rows"]
    step = row["fixed_ms_per_target_forward"]  # a fixed-gamma step has one target forward
    assert 0 < row["fixed_host_ms_per_step_outside_graphs"] < step
    assert row["fixed_host_ms_per_forward_outside_graphs"] == pytest.approx(
        row["fixed_host_ms_per_step_outside_graphs"] / (1 + row["fixed_draft_forwards_per_step"]))
    assert row["fixed_host_ms_per_step_outside_graphs_at_2"] > 0
    # per forward at batch 2: over that run's own forwards per step, one target's and one to four drafts'
    at_2 = (row["fixed_host_ms_per_step_outside_graphs_at_2"], row["fixed_host_ms_per_forward_outside_graphs_at_2"])
    assert 2 <= at_2[0] / at_2[1] <= 5
    # a plain step, one forward, does less around it than a speculative step (drafting, acceptance: about a third
    # of it here)
    for at in ("", "_at_2"):
        assert 0 < row[f"plain_host_ms_per_step_outside_graphs{at}"] < row[f"fixed_host_ms_per_step_outside_graphs{at}"]
    assert row["compiles"] > 0 and row["recompiles_after_warmup"] == 0 and row["graph_breaks"] == 0
    table = (tmp_path / "host_overhead_cpu_quick.md").read_text()
    assert "the same per step at batch 2" in table and "per forward at batch 2" in table
    assert "plain step host ms outside compiled calls" in table and "plain, at batch 2" in table


def test_a_gpu_run_measures_on_the_gpu_in_bf16_under_the_name_the_cost_model_reads(monkeypatch):
    """On CUDA the pair goes to the GPU (it stayed on the CPU, labelled gpu) in bf16, the GPU's reference dtype,
    so the result is host_overhead_gpu.json, which ``study.cost.host_floor`` reads (fp32 named it
    host_overhead_gpu_fp32, read by nothing)."""
    from bench.common import variant_suffix
    from study.cost.host_floor import CPU_RESULT, GPU_RESULT

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert host_overhead.dtype_for(cuda) == torch.bfloat16 and host_overhead.dtype_for(cpu) == torch.float32
    assert "host_overhead_gpu" + variant_suffix("cuda", host_overhead.dtype_for(cuda), "standard") == GPU_RESULT.stem
    assert "host_overhead_cpu" + variant_suffix("cpu", host_overhead.dtype_for(cpu), "standard") == CPU_RESULT.stem
    built = []

    def record(device=None, dtype=torch.float32, **kwargs):
        built.append((device, dtype))
        raise RuntimeError("stop here")

    monkeypatch.setattr(host_overhead, "tiny_pair", record)
    with pytest.raises(RuntimeError, match="stop here"):
        host_overhead.measure_mode("eager", 1, 1, cuda)
    assert built == [(cuda, torch.bfloat16)]
