"""The host floor (study/cost/host_floor.py): read from the host-overhead benchmark's result, added to every
projected forward by the capture mode, and what it does to speculation against plain decoding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from sidecar.runtime.ledger import ForwardRecord
from study.cost import (
    STUDY_WORKLOAD,
    CostInputError,
    Peaks,
    SpeculationRow,
    decode_step_seconds,
    forward_seconds,
    get_gpu,
    load_catalog,
    load_host_floors,
    project,
    speculation_vs_plain,
)
from study.cost.replay import replay
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B
from tests.host_overhead_results import host_result

H100 = get_gpu("H100 SXM", load_catalog())
runner = CliRunner()


def test_each_forward_pays_the_floor_scaled_by_its_models_depth(tmp_path: Path) -> None:
    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=5.0, layers=28))
    eager = floors.of("eager")
    bare = forward_seconds(QWEN2_5_1_5B, H100, 8, 1, 500)
    assert forward_seconds(QWEN2_5_1_5B, H100, 8, 1, 500, host=eager) == pytest.approx(bare + 0.005)
    # a model of half the benchmark's depth pays half its floor
    shallow = load_host_floors(host_result(tmp_path / "deep.json", eager_ms=5.0, layers=56)).of("eager")
    assert forward_seconds(QWEN2_5_1_5B, H100, 8, 1, 500, host=shallow) == pytest.approx(bare + 0.0025)


def test_a_projection_names_its_capture_mode_and_its_step_pays_the_floor(tmp_path: Path) -> None:
    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=3.0, cudagraph_ms=0.05))
    bare = {(r.mode, r.batch): r for r in project(STUDY_WORKLOAD, H100, [1, 32])}
    for capture, ms in (("eager", 3.0), ("captured", 0.05)):
        rows = project(STUDY_WORKLOAD, H100, [1, 32], host=floors.of(capture))
        for r in rows:
            assert r.capture == capture
            assert r.ms_per_step == pytest.approx(bare[r.mode, r.batch].ms_per_step + ms)
            # the prefill is one forward too: it pays one floor
            assert r.prefill_ms == pytest.approx(bare[r.mode, r.batch].prefill_ms + ms)
    assert {r.capture for r in bare.values()} == {"roofline"}


def test_without_a_cudagraph_row_the_captured_floor_is_unmeasured_zero_and_a_lower_bound(tmp_path: Path) -> None:
    captured = load_host_floors(host_result(tmp_path / "cpu.json")).of("captured")
    assert (captured.ms, captured.measured) == (0.0, False)
    assert "unmeasured" in captured.label and "lower bound" in captured.label
    measured = load_host_floors(host_result(tmp_path / "gpu.json", cudagraph_ms=0.04)).of("captured")
    assert measured.measured and measured.ms == 0.04 and "NVIDIA H100" in measured.label


def test_a_cudagraph_row_whose_graphs_were_not_captured_is_no_captured_floor(tmp_path: Path) -> None:
    """Inductor may compile a graph and leave it uncaptured: that row timed compile mode under cudagraph's name, so
    the captured floor stays unmeasured (0, a lower bound) and says why; a row of captured graphs is the floor."""
    path = host_result(tmp_path / "gpu.json", cudagraph_ms=0.9, outside_graphs_ms=0.2)
    result = json.loads(path.read_text())
    result["rows"][-1]["cudagraph_skips"] = 3
    path.write_text(json.dumps(result))
    captured = load_host_floors(path).of("captured")
    assert (captured.ms, captured.measured) == (0.0, False)
    assert captured.forward_seconds(0.0, 28) == pytest.approx(0.0002)
    assert "gpu.json's cudagraph row left 3 graphs uncaptured, so it timed compile mode" in captured.source
    assert "lower bound" in captured.label
    result["rows"][-1]["cudagraph_skips"] = 0
    path.write_text(json.dumps(result))
    assert load_host_floors(path).of("captured").measured


def test_a_compile_rows_host_work_outside_its_graphs_is_the_steps_work_every_forward_pays_in_both_modes(
        tmp_path: Path) -> None:
    """A CPU result's compiled step, less the time inside its compiled calls, is host work around the forwards that
    a CUDA graph does not take away: both modes pay it per forward, at any depth (it is the step's, not the
    layers'); without a cudagraph row a captured forward's own floor is 0, unmeasured, and its projections lower
    bounds."""
    floors = load_host_floors(host_result(tmp_path / "cpu.json", eager_ms=4.0, outside_graphs_ms=0.2))
    captured = floors.of("captured")
    assert (captured.ms, captured.measured, captured.per_layer) == (0.0, False, False)
    assert captured.forward_seconds(0.0, 56) == captured.forward_seconds(0.0, 28) == pytest.approx(0.0002)
    assert "lower bound" in captured.label
    assert ("plus a step's host work around its forwards, 0.2 ms per forward at 1 row (a compile step's host time "
            "outside its compiled calls, measured on") in captured.label
    bare = forward_seconds(QWEN2_5_7B, H100, 1, 1, 500)
    assert forward_seconds(QWEN2_5_7B, H100, 1, 1, 500, host=captured) == pytest.approx(bare + 0.0002)
    assert forward_seconds(QWEN2_5_1_5B, H100, 1, 1, 500, host=captured) == pytest.approx(
        forward_seconds(QWEN2_5_1_5B, H100, 1, 1, 500) + 0.0002)
    # the eager forward's own floor scales with the depth, the step's work does not
    eager = floors.of("eager")
    assert eager.per_layer and eager.forward_seconds(0.0, 56) == pytest.approx(0.008 + 0.0002)
    assert "host floor 4 ms per 28-layer forward" in eager.label and "0.2 ms per forward at 1 row" in eager.label
    # a GPU's cudagraph row: its forward's floor, measured, plus the step's work (its own where it timed it)
    gpu = load_host_floors(host_result(tmp_path / "gpu.json", cudagraph_ms=0.04, outside_graphs_ms=0.2))
    assert gpu.of("captured").measured and gpu.of("captured").ms == 0.04
    assert gpu.of("captured").forward_seconds(0.0, 56) == pytest.approx(0.00024), "a captured floor scaled with depth"
    own = load_host_floors(host_result(tmp_path / "own.json", cudagraph_ms=0.04, outside_graphs_ms=0.2,
                                       cudagraph_outside_ms={1: 0.1}))
    assert own.of("captured").forward_seconds(0.0, 28) == pytest.approx(0.00004 + 0.0001)
    assert own.of("eager").forward_seconds(0.0, 28) == pytest.approx(0.005 + 0.0001)
    assert "a cudagraph step's host time" in own.of("captured").label
    with pytest.raises(CostInputError, match=r"rows\[mode=compile\]\.fixed_host_ms_per_forward_outside_graphs"):
        load_host_floors(host_result(tmp_path / "bad.json", outside_graphs_ms=-1.0))
    with pytest.raises(CostInputError, match=r"rows\[mode=compile\]\.fixed_host_ms_per_forward_outside_graphs_at_8"):
        load_host_floors(host_result(tmp_path / "bad8.json", outside_graphs_ms={1: 0.2, 8: math.nan}))


def test_the_steps_host_work_is_charged_at_the_forwards_rows(tmp_path: Path) -> None:
    """Measured at 1, 8 and 32 rows: interpolated between them, along the last segment beyond 32 (per-row work
    grows linearly), and never falling beyond it where the last segment fell (noise)."""
    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=0.0,
                                          outside_graphs_ms={1: 0.2, 8: 0.3, 32: 0.6}))
    captured = floors.of("captured")
    ms = {rows: captured.forward_seconds(0.0, 28, rows) * 1000 for rows in (1, 4, 8, 20, 32, 64)}
    assert ms == pytest.approx({1: 0.2, 4: 0.2 + 0.1 * 3 / 7, 8: 0.3, 20: 0.45, 32: 0.6, 64: 1.0})
    assert "0.2 ms per forward at 1 row to 0.6 at 32" in captured.label
    # a forward of 8 rows pays the step's work at 8
    assert forward_seconds(QWEN2_5_7B, H100, 8, 1, 500, host=captured) == pytest.approx(
        forward_seconds(QWEN2_5_7B, H100, 8, 1, 500) + 0.0003)
    falling = load_host_floors(host_result(tmp_path / "f.json", outside_graphs_ms={1: 0.2, 8: 0.5, 32: 0.4}))
    assert falling.of("captured").forward_seconds(0.0, 28, 64) == pytest.approx(0.0004)
    # a result from before the step's work was timed per forward at 8 and 32: batch 1's at every batch
    only_one = load_host_floors(host_result(tmp_path / "o.json", outside_graphs_ms=0.2)).of("captured")
    assert only_one.forward_seconds(0.0, 28, 32) == pytest.approx(0.0002)


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{not json", "not a readable host-overhead result"),
        (json.dumps({"layers": 28}), "rows"),
        (json.dumps({"layers": 0, "rows": []}), "layers"),
        (json.dumps({"layers": 28, "rows": [{"mode": "compile", "our_forward_ms": 1.0}]}), "mode 'eager'"),
        (json.dumps({"layers": 28, "rows": [{"mode": "eager"}]}), "rows[mode=eager].our_forward_ms"),
        (json.dumps({"layers": 28, "rows": [{"mode": "eager", "our_forward_ms": "5"}]}), "our_forward_ms"),
        (json.dumps({"layers": 28, "rows": [{"mode": "eager", "our_forward_ms": -1.0}]}), "our_forward_ms"),
        ('{"layers": 28, "rows": [{"mode": "eager", "our_forward_ms": NaN}]}', "rows[mode=eager].our_forward_ms"),
        ('{"layers": 28, "rows": [{"mode": "eager", "our_forward_ms": 1.0}, '
         '{"mode": "cudagraph", "our_forward_ms": Infinity}]}', "rows[mode=cudagraph].our_forward_ms"),
    ],
)
def test_a_bad_floor_file_is_refused_naming_the_file_and_field(tmp_path: Path, content: str, field: str) -> None:
    path = tmp_path / "host_overhead_gpu.json"
    path.write_text(content)
    with pytest.raises(CostInputError) as error:
        load_host_floors(path)
    assert str(path) in str(error.value) and field in str(error.value)


def test_a_missing_floor_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CostInputError, match=r"absent\.json"):
        load_host_floors(tmp_path / "absent.json")


def test_a_replayed_roofline_forward_pays_the_floor(tmp_path: Path) -> None:
    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=2.0))
    records = [ForwardRecord("target", "decode", 2, 10, 1000, {"main": 10}, seconds=0.0),
               ForwardRecord("draft", "decode", 2, 2, 1000, {"main": 2}, seconds=0.0)]
    bare = replay(records, QWEN2_5_7B, QWEN2_5_1_5B, H100)
    eager = replay(records, QWEN2_5_7B, QWEN2_5_1_5B, H100, host=floors.of("eager"))
    assert eager.decode_s == pytest.approx(bare.decode_s + 2 * 0.002)  # two 28-layer forwards
    assert "eager" in eager.source


def test_a_replay_prices_the_host_work_around_each_step_once_by_its_forwards(tmp_path: Path) -> None:
    """A step of five forwards pays five shares of a speculative step's work (0.2 ms each at 2 rows), a step of one
    forward a plain step's (0.5 ms), each shared equally by the step's forwards and charged to the phases by their
    tokens; a record naming no step pays the share per forward; each forward pays its own floor too."""
    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=1.0, outside_graphs_ms=0.2,
                                          plain_outside_ms={1: 0.5}))
    eager = floors.of("eager")

    def record(model: str, step: int | None, phase: str = "main") -> ForwardRecord:
        return ForwardRecord(model, "decode", 2, 2 if model == "draft" else 10, 1000, {phase: 2}, 0.0, step)

    speculative = [record("draft", 1) for _ in range(4)] + [record("target", 1)]
    plain = [record("draft", 2, "sidecar")]
    bare = replay([*speculative, *plain], QWEN2_5_7B, QWEN2_5_1_5B, H100)
    floored = replay([*speculative, *plain], QWEN2_5_7B, QWEN2_5_1_5B, H100, host=eager)
    assert floored.decode_s == pytest.approx(bare.decode_s + 6 * 0.001 + 5 * 0.0002 + 0.0005)
    assert floored.by_phase["sidecar"] == pytest.approx(bare.by_phase["sidecar"] + 0.001 + 0.0005)
    unnamed = replay([record("draft", None)], QWEN2_5_7B, QWEN2_5_1_5B, H100, host=eager)
    assert unnamed.decode_s == pytest.approx(replay([record("draft", None)], QWEN2_5_7B, QWEN2_5_1_5B, H100).decode_s
                                             + 0.001 + 0.0002)


def test_a_large_eager_floor_makes_speculation_slower_than_plain_and_capture_wins_it_back(tmp_path: Path) -> None:
    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=8.0, cudagraph_ms=0.0))
    # the figures: acceptance 0.6 at gamma 4 gives 3.4 tokens a step
    eager = speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, H100, 1, 560, 0.6, floors.of("eager"))
    captured = speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, H100, 1, 560, 0.6, floors.of("captured"))
    plain = forward_seconds(QWEN2_5_7B, H100, 1, 1, 560)
    assert captured.plain_s_per_token == pytest.approx(plain)
    assert eager.plain_s_per_token == pytest.approx(plain + 0.008)
    # speculative: 4 draft forwards and a verify of 5, each with its floor, over 1 + 0.6 x 4 tokens
    drafts = sum(forward_seconds(QWEN2_5_1_5B, H100, 1, 1, 560 + i) for i in range(4))
    verify = forward_seconds(QWEN2_5_7B, H100, 1, 5, 560, logits=5)
    assert eager.speculative_s_per_token == pytest.approx((drafts + verify + 5 * 0.008) / 3.4)
    assert eager.slower and not captured.slower
    assert captured.speedup > 1.5


def test_an_overlapped_floor_costs_a_forward_the_larger_of_its_device_time_and_its_own_host_cost(
        tmp_path: Path) -> None:
    """Read as overlapping the device, a forward takes the larger of its roofline time and its own host cost (8 ms
    here), plus its share of the step's work (0.2 ms), which stays added: the 7B's verify streams its bytes for
    longer than 8 ms on a T4, so its floor is hidden; the 1.5B's draft forward on an H100 does not, so it costs its
    floor. Speculation against plain decoding and a replayed forward price it so."""
    eager = load_host_floors(host_result(tmp_path / "h.json", eager_ms=8.0, outside_graphs_ms=0.2)).of("eager")
    overlapped = eager.overlapping()
    assert overlapped.overlapped and not eager.overlapped
    assert "overlapping its device time" in overlapped.label and "overlapping" not in eager.label
    t4 = get_gpu("T4", load_catalog())
    verify = forward_seconds(QWEN2_5_7B, t4, 1, 5, 560, logits=5)
    assert verify > 0.008
    assert forward_seconds(QWEN2_5_7B, t4, 1, 5, 560, logits=5, host=overlapped) == pytest.approx(verify + 0.0002)
    assert forward_seconds(QWEN2_5_7B, t4, 1, 5, 560, logits=5, host=eager) == pytest.approx(verify + 0.0082)
    draft = forward_seconds(QWEN2_5_1_5B, H100, 1, 1, 560)
    assert draft < 0.008
    assert forward_seconds(QWEN2_5_1_5B, H100, 1, 1, 560, host=overlapped) == pytest.approx(0.0082)
    row = speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, H100, 1, 560, 0.6, overlapped)
    target = forward_seconds(QWEN2_5_7B, H100, 1, 5, 560, logits=5)
    assert row.speculative_s_per_token == pytest.approx((4 * 0.008 + max(target, 0.008) + 5 * 0.0002) / 3.4)
    assert row.overlapped and row.reading == "eager overlapped"
    assert speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, H100, 1, 560, 0.6, eager).reading == "eager"
    record = ForwardRecord("draft", "decode", 1, 1, 560, {"main": 1}, 0.0, None)
    assert replay([record], QWEN2_5_7B, QWEN2_5_1_5B, H100, host=overlapped).decode_s == pytest.approx(0.0082)


def test_a_plain_steps_forward_pays_the_plain_steps_work_and_without_it_a_share_labelled_as_favouring_plain(
        tmp_path: Path) -> None:
    """A speculative step's forwards each pay a share of its host work (0.2 ms at 1 row here); a plain step's one
    forward pays what a plain step measured (0.5 ms at 1 row, 0.9 at 8), in speculation against plain decoding and
    in a tagging step (one draft forward a step). A result without the plain step charges the share and says that
    favours plain decoding."""
    floors = load_host_floors(host_result(tmp_path / "h.json", eager_ms=1.0, outside_graphs_ms={1: 0.2, 8: 0.3},
                                          plain_outside_ms={1: 0.5, 8: 0.9}))
    eager = floors.of("eager")
    assert eager.forward_seconds(0.0, 28, 8) == pytest.approx(0.0013)
    assert eager.plain.forward_seconds(0.0, 28, 1) == pytest.approx(0.0015)
    assert eager.plain.forward_seconds(0.0, 28, 8) == pytest.approx(0.0019)
    assert "a plain step's host work around its forward, 0.5 ms per forward at 1 row to 0.9 at 8" in eager.plain.label
    row = speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, H100, 8, 560, 0.6, eager)
    assert row.plain_s_per_token == pytest.approx(forward_seconds(QWEN2_5_7B, H100, 8, 1, 560) + 0.0019)
    drafts = sum(forward_seconds(QWEN2_5_1_5B, H100, 8, 1, 560 + i) for i in range(4))
    verify = forward_seconds(QWEN2_5_7B, H100, 8, 5, 560, logits=5)
    assert row.speculative_s_per_token == pytest.approx((drafts + verify + 5 * 0.0013) / 3.4)
    assert decode_step_seconds(QWEN2_5_7B, H100, 8, 560, host=eager) == pytest.approx(row.plain_s_per_token)
    assert STUDY_WORKLOAD.step_seconds("sidecar", 8, H100.bandwidth_bytes_s, host=eager) == pytest.approx(
        STUDY_WORKLOAD.step_seconds("sidecar", 8, H100.bandwidth_bytes_s) + eager.plain.forward_seconds(0.0, 28, 8))
    older = load_host_floors(host_result(tmp_path / "old.json", eager_ms=1.0, outside_graphs_ms=0.2)).of("eager")
    assert older.plain.forward_seconds(0.0, 28, 1) == older.forward_seconds(0.0, 28, 1)
    assert "a plain step's unmeasured: this favours plain decoding" in older.plain.label
    bare = load_host_floors(host_result(tmp_path / "bare.json")).of("eager")  # eager rows only: no step work
    assert bare.plain == bare


@pytest.mark.parametrize(("speedup", "text"), [(1.4199, "1.42x"), (0.81, "0.81x"), (0.9961, "0.996x"),
                                              (0.99951, "0.9995x"), (1.0004, "1.00x")])
def test_a_slower_row_never_reads_as_1x(speedup: float, text: str) -> None:
    row = SpeculationRow("eager", 1, 4, 0.6, speculative_s_per_token=1.0, plain_s_per_token=speedup,
                         floor_measured=True)
    assert row.speedup_text == text


def test_speculation_refuses_an_acceptance_outside_0_to_1(tmp_path: Path) -> None:
    floors = load_host_floors(host_result(tmp_path / "h.json"))
    with pytest.raises(CostInputError, match="acceptance"):
        speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, Peaks(1e12, 1e15), 1, 10, math.nan, floors.of("eager"))


ROOFLINE = ["cost", "roofline", "--weights-gb", "3.09", "--kv-full-mb", "18", "--kv-masked-mb", "3.7", "--gpu", "T4",
            "--batches", "1,64", "--json"]


def test_the_cli_roofline_adds_the_floor_of_the_capture_mode_it_is_asked_for(tmp_path: Path) -> None:
    floors = str(host_result(tmp_path / "h.json", eager_ms=4.0))
    bare = runner.invoke(app, ROOFLINE)
    eager = runner.invoke(app, [*ROOFLINE, "--capture", "eager", "--host-overhead", floors])
    assert bare.exit_code == 0 and eager.exit_code == 0, eager.output
    for plain, floored in zip(json.loads(bare.stdout), json.loads(eager.stdout), strict=True):
        assert (plain["capture"], floored["capture"]) == ("roofline", "eager")
        assert floored["masked_ms_per_step"] == pytest.approx(plain["masked_ms_per_step"] + 4.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capture", "graphs"], "--capture must be eager or captured"),
        (["--host-overhead", "x.json"], "--host-overhead goes with --capture"),
        (["--capture", "eager", "--host-overhead", "absent.json"], "absent.json"),
    ],
)
def test_the_cli_roofline_refuses_a_capture_it_cannot_price(args: list[str], message: str) -> None:
    result = runner.invoke(app, [*ROOFLINE, *args])
    assert result.exit_code == 2
    assert message in result.stderr


def test_the_cli_says_where_eager_speculation_loses(tmp_path: Path) -> None:
    floors = str(host_result(tmp_path / "h.json", eager_ms=8.0))
    result = runner.invoke(app, ["cost", "speculation", "--acceptance", "0.4", "--gpu", "H100 SXM", "--batches", "1",
                                 "--host-overhead", floors, "--json"])
    assert result.exit_code == 0, result.output
    by_reading = {row["reading"]: row for row in json.loads(result.stdout)}
    assert list(by_reading) == ["eager", "eager overlapped", "captured"]
    assert by_reading["eager"]["speedup"] < 1 < by_reading["captured"]["speedup"]
    # overlapped, an eager draft forward still costs its floor while the target's bytes hide its own
    assert by_reading["eager overlapped"]["speedup"] < by_reading["eager"]["speedup"]
    assert by_reading["eager overlapped"]["overlapped"] and not by_reading["eager"]["overlapped"]
    assert by_reading["captured"]["floor_measured"] is False  # no cudagraph row: a lower bound
    table = runner.invoke(app, ["cost", "speculation", "--acceptance", "0.4", "--gpu", "H100 SXM", "--batches", "1",
                                "--host-overhead", floors])
    assert "slower" in table.stdout and "lower bound" in table.stdout
    assert "a plain forward pays no step work instead" in " ".join(table.stdout.split())  # eager rows only
