"""The prepared GPU check (bench/gpu_check/) runs its whole code path on the tiny pair on CPU, so it cannot rot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench import common
from bench.gpu_check.check import NO_CUDA, Check
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.identity import identity
from bench.gpu_check.main import main, parse_args, result_file_name
from bench.gpu_check.markdown import pair_markdown
from bench.gpu_check.pairs import BUILTIN_TEXTS, DEFAULT_PAIRS, load_check_pair, local_model_dir
from bench.gpu_check.parts import PARTS, errors
from bench.gpu_check.syncs import SyncCounter
from bench.gpu_check.throughput import throughput
from sidecar.decoding.divergence import ROUNDINGS

# the capture-mode part compiles on a CPU: its own tests (test_gpu_check_capture.py) run it, and those of every part
# run it in eager mode
EVERY_PART = ["--pair", "tiny", "--device", "cpu", "--quick", "--allow-dirty", "--capture-modes", "eager"]
QUICK_TINY_CPU = ["--pair", "tiny", "--device", "cpu", "--quick", "--allow-dirty", "--capture-check", "off"]


@pytest.fixture(scope="module")
def check() -> Check:
    from sidecar.decoding.decoder import SpeculativeDecoder
    from sidecar.tasks.engine import SidecarEngine
    from sidecar.tasks.rows import SidecarRequest

    args = parse_args(QUICK_TINY_CPU)
    pair = load_check_pair("tiny", "tiny", "cpu", torch.float32)
    engine = SidecarEngine(pair)
    prompts = [engine.prompts(SidecarRequest(t))[0].token_ids for t in BUILTIN_TEXTS[:2]]
    return Check(pair, prompts, SpeculativeDecoder(pair), args)


def test_the_tiny_cpu_check_runs_every_part_and_writes_its_results(bench_results: Path) -> None:
    payload = main(EVERY_PART)
    assert errors(payload) == []
    [tiny] = payload["pairs"]
    # fp32 on the tiny pair (peaked logits): the engine is token-identical to HF generate on the target
    assert tiny["identity"]["rows"] == 2 and tiny["identity"]["match_rate"] == 1.0
    # on a CPU the syncs are the torch calls that would wait on a GPU: measured, and within the budget
    for run in tiny["syncs"]["runs"]:
        assert 0 < run["syncs"] <= run["budget"] == run["target_forwards"] + run["draft_forwards"]
    assert tiny["memory"]["skipped"] == NO_CUDA
    assert tiny["sdpa"]["aten_ops"] and tiny["sdpa"]["backends_alone"]["MATH"] == "works"
    rows = tiny["throughput"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["hf_plain_tps"] > 0 and row["engine_static_tps"] > 0
    assert rows[0]["hf_assisted_tps"] > 0 and "hf_assisted_tps" not in rows[1]
    written = json.loads((bench_results / "gpu_check_cpu_tiny_quick.json").read_text())
    assert written["complete"] and written["environment"]["commit"]
    assert written["pairs"][0]["identity"]["match_rate"] == 1.0
    md = (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()
    assert "yes: 2/2 rows identical" in md and "| batch | syncs | target forwards |" in md
    assert "| engine static tok/s |" in md
    # the pair's parts run in the engine's capture mode, named as its dtype is
    assert tiny["capture"] == "eager (SIDECAR_CAPTURE=eager)" and f"capture mode {tiny['capture']}; on cpu" in md
    assert md.strip().splitlines()[-1] == common.provenance(written["environment"])
    # the capture-mode part on its small random pair: plain, speculative and the engine's plain rows, each naming
    # its mode
    assert [(r["mode"], r["decoding"], r["batch"]) for r in written["capture"]["rows"]] == [
        ("eager", decoding, batch) for batch in (1, 2) for decoding in ("plain", "speculative γ=4", "plain (engine)")]
    assert "| eager | speculative γ=4 | 2 |" in md and "| eager | plain | 2 |" in md


def test_a_check_cut_off_mid_run_keeps_every_part_it_finished(bench_results: Path, monkeypatch) -> None:
    """A lent machine's command has a time limit, and a kill there ends the check wherever it is: the results are
    written after each part, so what finished is on disk, marked incomplete."""

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # what the machine's limit does to the pair's parts

    monkeypatch.setattr("bench.gpu_check.main.check_pair", killed)
    with pytest.raises(KeyboardInterrupt):
        main([*QUICK_TINY_CPU, "--step-cost-batches", "1"])
    written = json.loads((bench_results / "gpu_check_cpu_tiny_quick.json").read_text())
    assert written["complete"] is False and written["pairs"] == [] and written["step_costs"]["rows"]
    assert written["environment"]["commit"]
    assert "**Incomplete**" in (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()


def test_a_spent_budget_skips_what_is_left_and_says_so(bench_results: Path) -> None:
    payload = main([*QUICK_TINY_CPU, "--budget-s", "0"])
    assert payload["pairs"] == [] and payload["absent"] == {"tiny": "deadline reached"}
    assert "`tiny`: skipped, deadline reached." in (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()


class AfterFirstRun(Deadline):
    """A deadline that any run estimated to take time misses: the first run of each method, never the next."""

    def __init__(self) -> None:
        super().__init__(float("inf"))

    def skip_reason(self, estimate_s: float = 0.0) -> str | None:
        return "skipped: estimated past the deadline" if estimate_s > 0 else None


def test_throughput_skips_a_run_its_smaller_run_says_would_end_past_the_deadline(check) -> None:
    result = throughput(check, AfterFirstRun())
    first, second = result["rows"]
    assert first["hf_plain_tps"] > 0 and first["engine_static_tps"] > 0
    assert second == {"batch": 2, "hf_plain": "skipped: estimated past the deadline",
                      "engine_static": "skipped: estimated past the deadline",
                      "engine_continuous": "skipped: estimated past the deadline"}
    assert result["hf_assisted_one_at_a_time"]["documents"] == 1  # quick: one prompt


@pytest.mark.slow
def test_a_compiled_engines_timed_runs_compile_nothing(monkeypatch) -> None:
    """Where the engine compiles, each timed run follows an untimed one of its batch and schedule: the batch-2
    shapes the check's own warm-up (a batch of 2) did not compile are compiled there, never in the time."""
    from sidecar.decoding.decoder import SpeculativeDecoder
    from sidecar.runtime.capture import runner_of

    args = parse_args([*QUICK_TINY_CPU, "--batches", "1,2"])
    pair = load_check_pair("tiny", "tiny", "cpu", torch.float32)
    compiled = Check(pair, [list(range(5, 40)), list(range(60, 80))],
                     SpeculativeDecoder(pair, gamma=2, capture="compile"), args)

    def compiles() -> int:
        return sum(runner_of(m).counters.compiles + runner_of(m).counters.recompiles for m in (pair.target, pair.draft))

    timed, real = [], compiled.timed_engine

    def counted(prompts, batch, schedule="static"):
        before = compiles()
        run = real(prompts, batch, schedule)
        timed.append(compiles() - before)
        return run

    monkeypatch.setattr(compiled, "timed_engine", counted)
    result = throughput(compiled, Deadline.after(600))
    assert result["engine_warmed_per_run"] and len(timed) == 2 * 2 * len(result["schedules"])
    assert sum(timed[0::2]) > 0, "the untimed runs compiled the new shapes"
    assert timed[1::2] == [0] * (len(timed) // 2), f"a timed run compiled: {timed}"


def test_deadline_shares_and_reasons() -> None:
    assert Deadline.after(-1).skip_reason() == "skipped: deadline reached"
    assert "estimated" in Deadline.after(10).skip_reason(60)
    assert Deadline.after(60).skip_reason(1) is None
    assert 29 < Deadline.after(60).share(0.5).left() <= 30


def test_a_divergence_is_reported_with_its_position_and_the_targets_top2_gap(check, monkeypatch) -> None:
    real = check.decoder.generate

    def second_best_at_3(prompts, **kwargs):
        outs = real(prompts, **kwargs)
        out = outs[0]
        logits = check.pair.target(torch.tensor([prompts[0] + out.token_ids[:3]])).logits[0, -1]
        out.token_ids[3] = int(logits.topk(2).indices[1])
        return outs

    monkeypatch.setattr(check.decoder, "generate", second_best_at_3)
    with torch.inference_mode():
        result = identity(check, Deadline.after(60))
    first, second = (r["hf_tokens"] for r in result["per_row"])
    assert first > 3, "the tiny target must write more than 3 tokens here for this test to mean anything"
    assert result["rows_identical"] == 1 and result["match_rate"] == 0.5
    [div] = result["divergences"]
    assert div["prompt"] == 0 and div["position"] == 3 and div["verdict"] == "mismatch"  # fp32: exact identity
    assert div["gap"] == pytest.approx(div["top2_gap"]) and div["top2_gap"] > div["bound"] > 0
    assert result["tokens_before_divergence"] == (3 + second) / (first + second)


def test_syncs_are_counted_by_source_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.runtime.syncs import synchronize

    # CPU stand-ins for the two CUDA calls the counter makes; everything else is the code a GPU runs
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match="something else"), SyncCounter() as counter:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        synchronize(cuda)
        with common.Stopwatch(cuda):  # the benchmark's own timer: not counted
            pass
    assert modes == ["warn", "default"] and counter.count == 4
    lines = {site.split(":")[1].split()[0]: n for site, n in counter.sites.items()}
    assert all(site.startswith("tests/test_gpu_check.py:") for site in counter.sites)
    assert sorted(lines.values()) == [1, 3] and len(lines) == 2


def test_pairs_not_on_disk_are_reported_and_the_tiny_pair_runs_instead(bench_results, monkeypatch) -> None:
    monkeypatch.setattr("bench.gpu_check.pairs.is_fetched", lambda name: False)
    monkeypatch.setattr("bench.gpu_check.pairs.local_model_dir", lambda model_id: None)
    monkeypatch.setattr("bench.gpu_check.parts.PARTS", [part for part in PARTS if part[0] == "identity"])
    payload = main(["--device", "cpu", "--quick", "--allow-dirty", "--budget-s", "120", "--capture-check", "off"])
    assert set(payload["absent"]) == set(DEFAULT_PAIRS)
    assert "not fetched" in payload["absent"]["qwen-coder-small"] and "not on disk" in payload["absent"]["qwen2.5-7b"]
    assert [p["pair"] for p in payload["pairs"]] == ["tiny"] and "tiny random pair ran instead" in payload["fallback"]
    assert payload["pairs"][0]["identity"]["match_rate"] == 1.0
    assert (bench_results / "gpu_check_cpu_quick.json").exists()


def test_a_local_model_is_found_only_with_its_config_and_every_weight_file(tmp_path: Path) -> None:
    assert local_model_dir("no-such-org/no-such-model") is None
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "one.safetensors",
                                                                                   "b": "two.safetensors"}}))
    (model / "one.safetensors").write_bytes(b"")
    assert local_model_dir(str(model)) is None
    (model / "two.safetensors").write_bytes(b"")
    assert local_model_dir(str(model)) == model


def test_result_names() -> None:
    # --allow-dirty: the name does not depend on the checkout, and a test must not either
    assert result_file_name(parse_args(["--allow-dirty"]), torch.device("cuda"), True) == "gpu_check"
    args = parse_args(QUICK_TINY_CPU)
    assert result_file_name(args, torch.device("cpu"), False) == "gpu_check_cpu_tiny_quick"


def test_a_part_that_raises_is_reported_and_fails_the_check_while_the_others_run(bench_results, monkeypatch) -> None:
    def broken(check, deadline):
        raise RuntimeError("kernel exploded")

    identity = next(part for part in PARTS if part[0] == "identity")
    monkeypatch.setattr("bench.gpu_check.parts.PARTS", [("broken", broken, 0.5), identity])
    payload = main(QUICK_TINY_CPU)
    [tiny] = payload["pairs"]
    assert tiny["broken"]["error"].startswith("RuntimeError: kernel exploded (at tests/test_gpu_check.py:")
    assert tiny["identity"]["match_rate"] == 1.0
    assert errors(payload) == [f"tiny broken: {tiny['broken']['error']}"]


def test_the_dtype_is_chosen_as_the_engine_chooses_it_and_printed_with_why(bench_results, monkeypatch, capsys) -> None:
    monkeypatch.setattr("bench.gpu_check.parts.PARTS", [])  # the choice is made when the pair loads
    auto = main([*QUICK_TINY_CPU, "--dtype", "auto"])["pairs"][0]
    # timed at the tiny target's shapes: which dtype wins depends on the CPU, the reason says by how much
    assert auto["dtype_reason"].startswith("auto: bf16 matmul ") and auto["dtype"] in ("bfloat16", "float32")
    assert f"tiny: {'bf16' if auto['dtype'] == 'bfloat16' else 'fp32'} ({auto['dtype_reason']})" in \
        capsys.readouterr().out
    md = (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()
    assert f"### `tiny` ({auto['dtype']}, {auto['dtype_reason']}; capture mode {auto['capture']}; on cpu" in md
    # without --dtype: SIDECAR_DTYPE (this suite pins fp32), else auto, as every command that loads a pair
    pinned = main(QUICK_TINY_CPU)
    assert (pinned["pairs"][0]["dtype"], pinned["pairs"][0]["dtype_reason"]) == ("float32", "SIDECAR_DTYPE=fp32")
    assert pinned["environment"]["dtype"] == "float32"
    monkeypatch.delenv("SIDECAR_DTYPE")
    assert main(QUICK_TINY_CPU)["pairs"][0]["dtype_reason"].startswith("auto: bf16 matmul ")
    with pytest.raises(SystemExit) as refused:
        parse_args([*QUICK_TINY_CPU, "--dtype", "fp64"])
    assert refused.value.code == 2


def test_a_pair_that_fails_to_load_is_reported(bench_results, monkeypatch) -> None:
    def unloadable(*args):
        raise OSError("no weights")

    monkeypatch.setattr("bench.gpu_check.check.load_check_pair", unloadable)
    payload = main(QUICK_TINY_CPU)
    [error] = errors(payload)
    assert error.startswith("tiny: OSError: no weights (at tests/test_gpu_check.py:")
    assert "Could not be loaded" in (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()


def plant_in_the_step(monkeypatch: pytest.MonkeyPatch, extra: Callable[[torch.Tensor], object]) -> None:
    """Every forward of a decode step (target and draft) also runs ``extra`` on its hidden states."""
    from sidecar.decoding import step

    real = step.forward

    def forward_and_extra(*args, **kwargs):
        hidden = real(*args, **kwargs)
        extra(hidden)
        return hidden

    monkeypatch.setattr(step, "forward", forward_and_extra)


def with_args(check: Check, **sizes) -> Check:
    return dataclasses.replace(check, args=argparse.Namespace(**vars(check.args) | sizes))


def test_a_sync_planted_in_the_step_is_counted_and_fails_the_check(bench_results, monkeypatch) -> None:
    syncs_part = next(part for part in PARTS if part[0] == "syncs")
    monkeypatch.setattr("bench.gpu_check.parts.PARTS", [syncs_part])
    plant_in_the_step(monkeypatch, lambda hidden: hidden[0, 0, 0].item())
    payload = main(QUICK_TINY_CPU)
    [tiny] = payload["pairs"]
    for run in tiny["syncs"]["runs"]:
        assert not run["within_budget"] and run["syncs"] > run["budget"]
        assert any(site.startswith("tests/test_gpu_check.py:") for site in run["top_sites"])
    failures = errors(payload)
    assert len(failures) == 2 and all(f.startswith("tiny syncs: batch ") and "over the budget" in f for f in failures)
    assert "**syncs failed**: batch 1:" in (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()


def engine_takes_the_runner_up_once(check: Check, monkeypatch: pytest.MonkeyPatch) -> list:
    """Perturbs the engine's first decode-step target forward: one row's next token becomes the target's second
    best there. HF generate and the reference forward are untouched. Returns the perturbed calls."""
    from sidecar.decoding import step

    real, calls = step.logits_at, []

    def runner_up_at_the_first_decode_step(model, hidden, index):
        logits = real(model, hidden, index)
        if model is check.pair.target and not calls:
            calls.append(index)
            row = logits[0, 0]
            row[row.topk(2).indices[1]] = row.max() + 1
        return logits

    monkeypatch.setattr(step, "logits_at", runner_up_at_the_first_decode_step)
    return calls


def test_a_perturbed_target_forward_fails_identity(check, monkeypatch) -> None:
    calls = engine_takes_the_runner_up_once(check, monkeypatch)
    with torch.inference_mode():
        result = identity(check, Deadline.after(60))
    assert calls, "the engine's decode did not reach the target's logits"
    [div] = result["divergences"]  # the engine may order its rows: which prompt is its first row is its own
    assert div["verdict"] == "mismatch" and div["gap"] == pytest.approx(div["top2_gap"])
    [failure] = result["failed"]
    assert failure.startswith(f"prompt {div['prompt']}: mismatches HF at token {div['position']} ")
    assert errors({"pairs": [{"pair": "tiny", "identity": result}]}) == [f"tiny identity: {failure}"]


def runner_up_within(pair, roundings: float) -> torch.utils.hooks.RemovableHandle:
    """Plants a near-tie in the target: wherever it computes logits (HF generate, the engine, the reference
    forward) its runner-up is moved to ``roundings`` near-tie bounds below its top logit, the argmax unchanged."""
    eps = torch.finfo(pair.dtype).eps

    def hook(module, inputs, logits):
        top = logits.topk(2, dim=-1)
        bound = ROUNDINGS * eps * top.values[..., :1].abs().clamp(min=1.0)
        return logits.scatter(-1, top.indices[..., 1:], top.values[..., :1] - roundings * bound)

    return pair.target.get_output_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize(("roundings", "verdict"), [(0.5, "near-tie"), (10.0, "mismatch")])
def test_a_planted_near_tie_passes_identity_and_a_large_gap_fails_it(check, monkeypatch, roundings, verdict) -> None:
    engine_takes_the_runner_up_once(check, monkeypatch)
    handle = runner_up_within(check.pair, roundings)
    try:
        with torch.inference_mode():
            result = identity(check, Deadline.after(60))
    finally:
        handle.remove()
    [div] = result["divergences"]
    # fp32 rounds the planted gap, by a few percent at these logits
    assert div["verdict"] == verdict and div["gap"] == pytest.approx(roundings * div["bound"], rel=0.2)
    assert (result["rows_identical"], result["rows_near_tie"], result["rows_mismatch"]) == (
        (1, 1, 0) if verdict == "near-tie" else (1, 0, 1))
    assert len(result["failed"]) == (verdict == "mismatch")
    assert result["identical_output"].startswith("near-ties 1 of 2 (gaps <= " if verdict == "near-tie"
                                                 else "MISMATCH 1 of 2")


def test_the_report_holds_measured_numbers_that_follow_the_settings(check) -> None:
    parts = {name: run for name, run, _ in PARTS}
    with torch.inference_mode():
        short, long = ({name: parts[name](with_args(check, max_new_tokens=n), Deadline.after(60))
                        for name in ("identity", "syncs")} for n in (4, 12))
    for result in (short, long):
        assert result["identity"]["failed"] == [] and result["syncs"]["failed"] == []
    # more new tokens: more reference tokens, more forwards and more syncs, in the engine and in HF
    assert [r["hf_tokens"] for r in short["identity"]["per_row"]] == [4, 4]
    assert [r["hf_tokens"] for r in long["identity"]["per_row"]] == [12, 12]
    for a, b in zip(short["syncs"]["runs"], long["syncs"]["runs"], strict=True):
        assert a["batch"] == b["batch"]
        for key in ("syncs", "target_forwards", "hf_plain_syncs", "hf_plain_steps"):
            assert 0 < a[key] < b[key], key


class FedTokens:
    """Fake CUDA memory statistics that measure the run: the bytes of the target's embeddings computed since the
    last reset as the peak, the target's weights as the memory allocated."""

    def __init__(self, pair) -> None:
        self.pair, self.fed = pair, 0
        self.hook = pair.target.get_input_embeddings().register_forward_hook(self.count)

    def count(self, module, inputs, output) -> None:
        self.fed += output.numel() * output.element_size()

    def reset(self, device=None) -> None:
        self.fed = 0

    def peak(self, device=None) -> int:
        return self.fed

    def weights(self, device=None) -> int:
        return sum(p.numel() * p.element_size() for p in self.pair.target.parameters())


def test_the_cuda_parts_run_on_cpu_with_the_cuda_calls_faked(check, monkeypatch) -> None:
    """The CUDA-only code paths run here with CUDA's calls faked: a synchronize planted in the step is counted and
    fails the check; the memory figures are each run's own measure, not a constant."""
    for name in ("set_sync_debug_mode", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    memory_stats = FedTokens(check.pair)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", memory_stats.reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", memory_stats.peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", memory_stats.weights)
    monkeypatch.setattr(Check, "cuda", property(lambda self: True))
    # the faked device reports none of the engine's own reads: two planted syncs per forward exceed the budget alone
    plant_in_the_step(monkeypatch, lambda hidden: (torch.cuda.synchronize(), torch.cuda.synchronize()))
    try:
        parts = {name: run(check, Deadline.after(60)) for name, run, _ in PARTS
                 if name in ("syncs", "memory", "throughput")}  # the CUDA-only ones, and the one with a peak column
    finally:
        memory_stats.hook.remove()
    runs = parts["syncs"]["runs"]
    assert [r["batch"] for r in runs] == [1, 2]
    for run in runs:
        decode_forwards = run["target_forwards"] - 1 + run["draft_forwards"]  # the prefill's forward is no step's
        assert run["syncs"] == 2 * decode_forwards > run["budget"] and not run["within_budget"]
        [site] = run["top_sites"]
        assert site.startswith("tests/test_gpu_check.py:") and site.endswith(" synchronize()")
        assert run["hf_plain_steps"] > 1 and run["hf_plain_syncs_per_step"] == 0
    assert len(parts["syncs"]["failed"]) == 2
    memory = parts["memory"]
    assert memory["weights_gb"] == memory_stats.weights() / 2**30 and memory["batch"] == 2
    one, two = parts["throughput"]["rows"]
    for key in ("engine_static_peak_gb", "hf_plain_peak_gb"):
        # two prompts feed more tokens than one: each run's peak is its own
        assert 0 < one[key] < two[key], key
    # the memory part's run is the throughput part's at its batch; an adaptive engine's steps follow its timings, and
    # where rows copy unequal lengths only their real tokens are embedded, so two runs may feed a few tokens apart
    assert memory["engine_static_peak_gb"] == pytest.approx(two["engine_static_peak_gb"], rel=0.05)
    header = {"pair": "tiny", "dtype": "bfloat16", "dtype_reason": "default on CUDA: bf16", "device": "cuda:0",
              "load_s": 1.0, "prompts": "built-in texts", "mean_prompt_tokens": 300.0}
    md = pair_markdown(header | parts)
    assert "| batch | syncs | target forwards |" in md and f"| 2 | {runs[1]['syncs']} |" in md
    assert f"engine {memory['engine_static_peak_gb']:.1f} GB" in md and "| peak GB |" in md
    assert "**syncs failed**: batch " in md


# What the stock GPU image (torch 2.11, transformers 5.17 with its own dependencies, numpy) lacks of what this
# repository imports. Run under those versions (a venv of the two wheels, 2026-12-07), the check found three
# breaks that these lines keep out: the constraints' imports (jsonschema, llguidance), pyarrow for the corpus,
# and the cache's keyword of transformers before 5.25 (``sidecar.runtime.forward.cache_keyword``).
NOT_ON_GPU_IMAGE = ("pydantic", "pydantic_settings", "prefect", "duckdb", "fastapi", "openai", "jsonschema",
                    "llguidance", "pyarrow")
WITHOUT_THEM = """
import importlib.abc, json, sys
from pathlib import Path

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"No module named {{name!r}} (not on the stock GPU image)")
        return None

sys.meta_path.insert(0, Missing())
from bench import common
from bench.gpu_check.main import main
from bench.gpu_check.parts import errors

common.RESULTS = Path({results!r})
payload = main({argv!r})
print(json.dumps({{"errors": errors(payload), "pairs": len(payload["pairs"]),
                  "step_costs": len(payload["step_costs"].get("rows", [])),
                  "capture": len(payload["capture"].get("rows", []))}}))
"""


@pytest.mark.servers
def test_the_check_runs_on_the_stock_gpu_image_without_the_services_packages(tmp_path: Path) -> None:
    script = WITHOUT_THEM.format(blocked=set(NOT_ON_GPU_IMAGE), results=str(tmp_path), argv=EVERY_PART)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the step costs too: a draft step and a verify at each gamma 0-4 of both models at batches 1 and 2; and the
    # capture modes: plain, speculative and the engine's plain, at batches 1 and 2
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"errors": [], "pairs": 1, "step_costs": 24,
                                                                "capture": 6}
