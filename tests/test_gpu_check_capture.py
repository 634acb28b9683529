"""The GPU check's capture-mode part (bench/gpu_check/capture_modes.py) on a small random pair on CPU, eager and
compiled: the pair's known outputs, the rows and counters it reports, and the goals it judges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.gpu_check import capture_modes as part
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.main import main, parse_args
from bench.gpu_check.markdown import capture_markdown
from bench.gpu_check.parts import errors
from bench.gpu_check.synthetic_pair import AGREEMENT, prompt_for, synthetic_pair

CPU = torch.device("cpu")
[(SMALL_NAME, (SMALL_TARGET, SMALL_DRAFT))] = part.SMALL_PAIR.items()


@pytest.fixture(scope="module")
def pair():
    return synthetic_pair(SMALL_NAME, SMALL_TARGET, SMALL_DRAFT, CPU, torch.float32)


def test_the_synthetic_models_follow_their_tables_and_the_draft_agrees_on_its_share(pair) -> None:
    ordinary = torch.arange(3, len(pair.target_next))
    with torch.inference_mode():
        for model in (pair.target, pair.draft):
            predicted = model(input_ids=ordinary[:, None]).logits[:, -1].argmax(-1)
            table = pair.target_next if model is pair.target else pair.draft_next
            assert torch.equal(predicted, table[ordinary])
    agree = (pair.draft_next[ordinary] == pair.target_next[ordinary]).float().mean().item()
    assert AGREEMENT - 0.06 < agree < AGREEMENT + 0.06
    prompt = prompt_for(pair, 16, 5)
    walk = [prompt[-1]]
    for _ in range(6):
        walk.append(int(pair.target_next[walk[-1]]))
    assert walk[-1] == pair.eos_token_ids[0] not in walk[:-1]  # five tokens, then EOS


def test_plain_decoding_writes_the_tables_walk(pair) -> None:
    part.SpeculativeDecoder(pair, capture="eager")
    prompt = prompt_for(pair, 16, 6)
    with torch.inference_mode():
        cache = part.RowKVCache(pair.target, 1, 40)
        tokens, seconds = part.plain_decode(pair, cache, prompt, 6)
        again, _ = part.plain_decode(pair, cache, prompt, 6)  # the cache is emptied first: the same walk
    expected = [int(pair.target_next[prompt[-1]])]
    for _ in range(5):
        expected.append(int(pair.target_next[expected[-1]]))
    assert tokens == expected == again and seconds > 0


def test_eager_and_compiled_modes_are_measured_counted_and_reported(bench_results, monkeypatch) -> None:
    monkeypatch.setattr("bench.gpu_check.parts.PARTS", [])  # the pair's parts have their own tests
    payload = main(["--pair", "tiny", "--device", "cpu", "--quick", "--allow-dirty", "--dtype", "fp32",
                    "--step-costs", "off", "--capture-batches", "1", "--max-new-tokens", "6", "--gamma", "2"])
    assert errors(payload) == []
    c = payload["capture"]
    assert c["pair"] == SMALL_NAME and c["peak_bandwidth_gb_s"] == "unknown"  # a CPU is in no GPU catalog
    rows = {(r["mode"], r["decoding"], r["batch"]): r for r in c["rows"]}
    assert set(rows) == {(m, d, 1) for m in ("eager", "compile")
                         for d in ("plain", "speculative γ=2", part.ENGINE_PLAIN)}
    for (mode, decoding, _), row in rows.items():
        assert row["tokens_per_s"] > 0
        if decoding == "plain":
            assert row["bandwidth_share"] == "unknown"
        else:
            assert row["vs_plain"] > 0 and row["rows_identical_to_plain"] == 1  # fp32 greedy: plain's tokens
        if decoding == part.ENGINE_PLAIN:  # gamma 0: one token per target forward, and no speculation to compare
            assert row["tokens_per_step"] == 1 and "vs_engine_plain" not in row
        elif decoding != "plain":
            assert row["tokens_per_step"] > 1  # the draft agrees on most tokens
            assert row["vs_engine_plain"] == pytest.approx(
                row["tokens_per_s"] / rows[mode, part.ENGINE_PLAIN, 1]["tokens_per_s"])
        assert ("vs_eager" in row) == (mode == "compile")
    eager, compiled = c["modes"]
    assert eager["mode"] == "eager" and eager["compiles"] == 0
    # compiled: one graph per shape, each compiled once at warm-up, none after, no break
    assert compiled["mode"] == "compile" and compiled["compiles"] >= 3 and compiled["compile_seconds"] > 0
    assert compiled["recompiles_after_warmup"] == 0 and compiled["graph_breaks"] == 0
    assert compiled["distinct_shapes"]["target"] >= 2 and "memory_allocated_gb" not in compiled  # CUDA only
    # no catalog peak on a CPU: the goal is read against the copy bandwidth measured here, and says so
    assert c["copy_bandwidth_gb_s"] > 0.1
    assert all(r["copy_bandwidth_share"] > 0 for (_, decoding, _), r in rows.items() if decoding == "plain")
    assert c["goals"]["captured plain reaches >= 70% of memory bandwidth"].endswith(
        "(against the copy bandwidth measured here: no catalog peak)")
    assert c["goals"]["captured is never slower than eager at any batch"].startswith(("met", "not met: compile"))
    written = json.loads((bench_results / "gpu_check_cpu_tiny_quick.json").read_text())
    assert written["capture"]["rows"] == c["rows"]
    md = (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()
    assert "| mode | decoding | batch | tok/s | share of bandwidth |" in md
    assert "| compile | plain | 1 |" in md and "| eager | speculative γ=2 | 1 |" in md
    assert f"| compile | {compiled['compiles']} | 0 | 0 | " in md  # compiles, recompiles, graph breaks
    assert "Goals: captured plain reaches >= 70% of memory bandwidth: " in md and "a copy reached " in md
    assert "Not projected by the cost model: the device is not in the GPU catalog" in md  # a CPU


def modes_of(plain: dict[tuple[str, int], float], speculative: dict[tuple[str, int], float]) -> list[dict]:
    """Measured modes as ``measure_mode`` returns them, from tokens/s per (mode, batch), plain and speculative."""
    modes = dict.fromkeys(m for m, _ in plain)
    return [{"mode": mode, "rows": [{"mode": m, "decoding": decoding, "batch": b, "tokens_per_s": tps}
                                    for decoding, runs in (("plain", plain), ("speculative γ=4", speculative))
                                    for (m, b), tps in runs.items() if m == mode]} for mode in modes]


def test_bandwidth_ratios_and_goals_follow_the_numbers() -> None:
    measured = modes_of({("eager", 1): 20.0, ("eager", 8): 100.0, ("cudagraph", 1): 200.0, ("cudagraph", 8): 150.0},
                        {("eager", 1): 30.0, ("eager", 8): 200.0, ("cudagraph", 1): 320.0, ("cudagraph", 8): 180.0})
    table = part.compare(measured, peak=1e12, bytes_per_token=4 * 10**9)
    rows = {(r["mode"], r["batch"], r["decoding"]): r for r in table}
    assert rows["cudagraph", 1, "plain"]["bandwidth_share"] == pytest.approx(0.8)  # 4 GB x 200 / 1 TB/s
    assert rows["eager", 1, "plain"]["bandwidth_share"] == pytest.approx(0.08)
    # at batch 8 a forward yields 8 tokens: 150 tok/s is 18.75 forwards/s of 4 GB each
    assert rows["cudagraph", 8, "plain"]["bandwidth_share"] == pytest.approx(0.075)
    assert rows["cudagraph", 1, "speculative γ=4"]["vs_plain"] == pytest.approx(1.6)
    assert rows["cudagraph", 8, "speculative γ=4"]["vs_plain"] == pytest.approx(1.2), "against plain at batch 8"
    assert rows["eager", 8, "speculative γ=4"]["vs_plain"] == pytest.approx(2.0)
    assert rows["cudagraph", 8, "speculative γ=4"]["vs_eager"] == pytest.approx(0.9)
    assert "vs_eager" not in rows["eager", 8, "speculative γ=4"]
    verdicts = list(part.goals(table).values())
    assert verdicts == ["met", "met", "not met: cudagraph speculative γ=4 batch 8: 0.90x"]
    slow = part.goals(part.compare(measured, peak=1e13, bytes_per_token=4 * 10**9))
    assert slow["captured plain reaches >= 70% of memory bandwidth"] == "not met: cudagraph 8%"
    counted = {"compiles": 0, "recompiles_after_warmup": 0, "graph_breaks": 0, "cudagraph_skips": 0,
               "skip_reasons": [], "compile_seconds": 0.0, "distinct_shapes": {"target": 4, "draft": 6}}
    md = capture_markdown({
        "pair": "Qwen2.5-7B + 1.5B (random weights)", "dtype": "bfloat16", "agreement": AGREEMENT, "gamma": 4,
        "prompt_tokens": 64, "new_tokens": 64, "weight_gb_per_token": 4.0, "peak_bandwidth_gb_s": 1000.0,
        "rows": table, "goals": part.goals(table), "failed": [], "skipped_pairs": {},
        "modes": [counted | {"mode": "eager", "memory_allocated_gb": 0.0, "memory_reserved_gb": 0.0},
                  counted | {"mode": "cudagraph", "compiles": 10, "memory_allocated_gb": 1.25,
                             "memory_reserved_gb": 2.5}]})
    assert "| cudagraph | plain | 1 | 200 | 80% |" in md and "| eager | plain | 1 | 20 | 8% |" in md
    assert "| cudagraph | 10 | 0 | 0 | 0 | 4 / 6 | 0 | 1.25 | 2.5 |" in md and "1000 GB/s peak" in md
    assert "captured is never slower than eager at any batch: not met: cudagraph speculative γ=4 batch 8" in md
    unknown = part.compare(measured, peak=None, bytes_per_token=1)
    assert {r["bandwidth_share"] for r in unknown if r["decoding"] == "plain"} == {"unknown"}
    assert part.goals(unknown)["captured plain reaches >= 70% of memory bandwidth"] == "not measured"
    # a GPU the catalog does not list: the share of the bandwidth a copy reached there (4 GB x 200 / 2 TB/s)
    copied = part.compare(measured, peak=None, bytes_per_token=4 * 10**9, copy=2e12)
    assert {(r["mode"], r["batch"]): r for r in copied if r["decoding"] == "plain"}["cudagraph", 1][
        "copy_bandwidth_share"] == pytest.approx(0.4)
    assert part.goals(copied)["captured plain reaches >= 70% of memory bandwidth"] == (
        "not met: cudagraph 40% (against the copy bandwidth measured here: no catalog peak)")
    both = part.goals(part.compare(measured, peak=1e12, bytes_per_token=4 * 10**9, copy=2e12))
    assert both["captured plain reaches >= 70% of memory bandwidth"] == "met", "the catalog's peak first"


def test_a_copy_measures_the_devices_bandwidth() -> None:
    from bench.gpu_check.bandwidth import copy_bandwidth

    # a CPU's memory moves at least hundreds of MB/s and no machine moves a PB/s
    assert 1e8 < copy_bandwidth(CPU, 1 << 22) < 1e15


def test_a_pair_out_of_memory_gives_way_to_the_next_smaller(monkeypatch) -> None:
    built = []

    def first_does_not_fit(name, *args, **kwargs):
        built.append(name)
        if len(built) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return synthetic_pair(name, SMALL_TARGET, SMALL_DRAFT, CPU, torch.float32)

    monkeypatch.setattr(part, "synthetic_pair", first_does_not_fit)
    result = part.capture_modes("full", ["eager"], [1], 4, 2, CPU, torch.float32, Deadline.after(120))
    assert built == list(part.FULL_PAIRS) and result["pair"] == built[1]
    assert result["skipped_pairs"] == {built[0]: "out of memory (CUDA out of memory. Tried to allocate 1.00 GiB)"}
    assert [r["decoding"] for r in result["rows"]] == ["plain", "speculative γ=2", part.ENGINE_PLAIN]


def test_a_spent_deadline_skips_the_runs_and_says_so() -> None:
    result = part.capture_modes("small", ["eager"], [1, 2], 4, 2, CPU, torch.float32, Deadline.after(-1))
    # plain, speculative and the engine's plain, each batch
    assert [r["skipped"] for r in result["rows"]] == ["skipped: deadline reached"] * 6
    assert set(result["goals"].values()) == {"not measured"}


def test_an_unknown_capture_mode_is_refused_naming_the_option(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--capture-modes", "eager,fast", "--allow-dirty"])
    assert exited.value.code == 2 and "--capture-modes: unknown mode fast" in capsys.readouterr().err


def test_a_graph_break_or_a_recompile_after_warm_up_fails_the_check() -> None:
    payload = {"pairs": [], "capture": {"failed": ["compile: 2 graph breaks", "compile: 1 recompiles after warmup"]}}
    assert errors(payload) == ["capture modes: compile: 2 graph breaks",
                               "capture modes: compile: 1 recompiles after warmup"]
    assert errors({"pairs": [], "capture": {"error": "RuntimeError: boom"}}) == ["capture modes: RuntimeError: boom"]
    assert errors({"pairs": [], "capture": {"rows": [], "failed": []}}) == []


def test_a_graph_left_uncaptured_fails_the_check_with_inductors_reason() -> None:
    clean = {"graph_breaks": 0, "recompiles_after_warmup": 0, "cudagraph_skips": 0, "skip_reasons": []}
    reason = "skipping cudagraphs due to mutated inputs (2 instances)"
    modes = [clean | {"mode": "eager"}, clean | {"mode": "compile", "cudagraph_skips": 0},
             clean | {"mode": "cudagraph", "cudagraph_skips": 3, "skip_reasons": [reason]}]
    assert part.faults(modes) == [f"cudagraph: 3 graphs not captured ({reason})"]
    assert part.faults([clean | {"mode": "cudagraph", "cudagraph_skips": 1}]) == [
        "cudagraph: 1 graphs not captured (no reason logged)"]
    assert part.faults(modes[:2]) == []


def test_a_shape_first_seen_after_warm_up_is_counted_and_fails_the_check(monkeypatch) -> None:
    real = part.engine_decode
    calls = []

    def longer_limit_in_the_timed_run(decoder, prompt, tokens, batch):
        calls.append(batch)
        # the first timed run (the second call) asks for more tokens: a larger cache (past the warm-up's power-of-two
        # capacity), a shape the warm-up never ran
        return real(decoder, prompt, tokens + 256 * (len(calls) == 2), batch)

    monkeypatch.setattr(part, "engine_decode", longer_limit_in_the_timed_run)
    result = part.capture_modes("small", ["compile"], [1], 6, 2, CPU, torch.float32, Deadline.after(600))
    [compiled] = result["modes"]
    # the speculative rows' warm-up and two timed runs, then the engine's plain rows'
    assert calls == [1] * 6 and compiled["recompiles_after_warmup"] >= 1 and compiled["graph_breaks"] == 0
    assert result["failed"] == [f"compile: {compiled['recompiles_after_warmup']} recompiles after warmup"]
    assert errors({"pairs": [], "capture": result}) == [f"capture modes: {result['failed'][0]}"]


def test_a_batch_out_of_memory_is_skipped_and_says_so_while_the_others_run(monkeypatch) -> None:
    real = part.engine_decode

    def batch_two_does_not_fit(decoder, prompt, tokens, batch):
        if batch == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(decoder, prompt, tokens, batch)

    monkeypatch.setattr(part, "engine_decode", batch_two_does_not_fit)
    result = part.capture_modes("small", ["eager"], [1, 2, 3], 4, 2, CPU, torch.float32, Deadline.after(120))
    one, two, three = [r for r in result["rows"] if r["decoding"].startswith("speculative")]
    assert two["skipped"] == "skipped: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
    assert one["tokens_per_s"] > 0 and three["tokens_per_s"] > 0 and result["failed"] == []


def test_each_measured_row_has_the_cost_models_projection_for_its_mode(tmp_path: Path) -> None:
    """On a catalog GPU every measured eager or cudagraph row gets the cost model's tokens/s for it (the roofline
    plus the mode's host floor at the row's batch; speculation at the row's acceptance) and measured over
    projected; a compile row (no such mode in the cost model), a skipped row and a device outside the catalog get
    none, and the part says why."""
    from bench.gpu_check.markdown import projection_markdown
    from bench.gpu_check.projected import projected
    from study.cost import forward_seconds, get_gpu, load_catalog, load_host_floors, speculation_vs_plain
    from study.cost.workload import QWEN2_5_1_5B_CONFIG, QWEN2_5_7B_CONFIG, qwen2_facts
    from tests.host_overhead_results import host_result

    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=4.0, outside_graphs_ms={1: 0.2, 8: 0.4}))
    h100 = get_gpu("H100 SXM", load_catalog())
    target, draft = qwen2_facts(QWEN2_5_7B_CONFIG, 2), qwen2_facts(QWEN2_5_1_5B_CONFIG, 2)
    table = [{"mode": "eager", "decoding": "plain", "batch": 1, "tokens_per_s": 100.0},
             {"mode": "cudagraph", "decoding": "speculative γ=4", "batch": 8, "tokens_per_s": 2000.0,
              "acceptance": 0.75},
             {"mode": "compile", "decoding": "plain", "batch": 1, "tokens_per_s": 150.0},
             {"mode": "cudagraph", "decoding": "plain", "batch": 32, "skipped": "skipped: out of memory"}]
    configs = (QWEN2_5_7B_CONFIG, QWEN2_5_1_5B_CONFIG)
    rows, projection = projected(table, configs, 2, h100, 96.0, 4, floors)
    eager = 1 / forward_seconds(target, h100, 1, 1, 96.0, host=floors.of("eager"))
    assert eager == pytest.approx(1 / (forward_seconds(target, h100, 1, 1, 96.0) + 0.0042))
    assert rows[0]["projected_tokens_per_s"] == pytest.approx(eager)
    assert rows[0]["vs_projected"] == pytest.approx(100.0 / eager)
    # eager also read as overlapping the device: the 7B's bytes (about 4.5 ms) hide its 4 ms floor
    overlapped = 1 / (forward_seconds(target, h100, 1, 1, 96.0) + 0.0002)
    assert rows[0]["projected_overlapped_tokens_per_s"] == pytest.approx(overlapped) and overlapped > eager
    assert rows[0]["vs_projected_overlapped"] == pytest.approx(100.0 / overlapped)
    assert "projected_overlapped_tokens_per_s" not in rows[1]  # a captured row: one reading
    speculative = 8 / speculation_vs_plain(target, draft, h100, 8, 96.0, 0.75, floors.of("captured"),
                                           4).speculative_s_per_token
    assert rows[1]["projected_tokens_per_s"] == pytest.approx(speculative)
    assert rows[1]["vs_projected"] == pytest.approx(2000.0 / speculative)
    assert "projected_tokens_per_s" not in rows[2] and "projected_tokens_per_s" not in rows[3]
    assert projection["gpu"] == "H100 SXM" and "lower bound" in projection["floors"]["captured"]
    assert "Projected: the cost model's tokens/s for each row on H100 SXM" in projection_markdown(projection)
    # the check projects the part's result on the GPU it names, over the decode phase's mean context
    from bench.gpu_check.projected import with_projection
    capture = {"pair": "Qwen2.5-7B + 1.5B (random weights)", "catalog_gpu": "H100 SXM", "dtype": "bfloat16",
               "prompt_tokens": 64, "new_tokens": 64, "gamma": 4, "rows": table}
    assert with_projection(capture, floors) == capture | dict(zip(
        ("rows", "projection"), projected(table, configs, 2, h100, 96.0, 4, floors), strict=True))
    assert projected(table, configs, 2, None, 96.0, 4, floors) == (
        table, {"skipped": "the device is not in the GPU catalog (study/cost/gpus.json)"})
