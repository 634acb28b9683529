"""Benchmark results say where they come from, and `make bench` splices their tables into docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common, run_all


def test_every_benchmark_has_its_markers_in_the_benchmarks_page() -> None:
    text = run_all.TABLES.read_text()
    for key, _, _ in run_all.BENCHMARKS:
        assert text.count(f"<!-- bench:{key} -->") == 1 and text.count(f"<!-- /bench:{key} -->") == 1, key


def test_splice_replaces_only_its_own_table(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    shutil.copy(run_all.TABLES, page)
    before = page.read_text()
    table = "| a |\n|---|\n| 1 |\n\nMeasured on commit `abc`, 2026-01-01 00:00:00 UTC, CPU Test."
    assert run_all.splice("sidecar", table, page)
    after = page.read_text()
    assert f"<!-- bench:sidecar -->\n{table}\n<!-- /bench:sidecar -->" in after

    def outside(text: str) -> str:
        return text.split("<!-- bench:sidecar -->")[0] + text.split("<!-- /bench:sidecar -->")[1]

    assert outside(after) == outside(before)
    assert not run_all.splice("no-such-table", table, page)
    assert page.read_text() == after


def test_results_carry_commit_date_machine_torch_and_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    common.write_results("example", {"environment": common.environment(dtype=torch.bfloat16), "rows": [1]},
                         "| a |\n|---|\n| 1 |")
    env = json.loads((tmp_path / "example.json").read_text())["environment"]
    assert len(env["commit"]) == 40 and isinstance(env["dirty"], bool) and env["commit_source"] == "git"
    assert env["dirty_files"]["count"] == len(common.uncommitted_files())
    assert env["date"].endswith("Z") and env["platform"] and env["cpu"] and env["cpus"] and env["torch"]
    assert env["dtype"] == "bfloat16"
    last = (tmp_path / "example.md").read_text().strip().splitlines()[-1]
    assert last == common.provenance(env)
    assert env["commit"][:12] in last and env["date"][:10] in last and env["cpu"] in last
    assert last.endswith(f", torch {env['torch']}, bfloat16.")
    # a benchmark without a model says so: its dtype is None, not absent
    assert common.environment()["dtype"] is None


def test_a_copy_of_the_tree_outside_git_measures_only_under_the_commit_its_sender_names(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A lent GPU machine gets a copy of the tree, no git checkout (`make gpu-check`'s device form)."""
    monkeypatch.setattr(common, "_git", lambda *args: "")
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    assert common.uncommitted_files() is None
    with pytest.raises(SystemExit):
        common.refuse_a_dirty_tree(allow_dirty=False)
    assert "not a git checkout" in capsys.readouterr().err
    env = common.environment()
    assert (env["commit"], env["commit_source"], env["dirty"]) == (None, None, None)
    monkeypatch.setenv(common.COMMIT_ENV, "0123456789abcdef0123456789abcdef01234567")
    common.refuse_a_dirty_tree(allow_dirty=False)  # measures
    env = common.environment()
    assert (env["commit"], env["commit_source"], env["dirty"]) == (
        "0123456789abcdef0123456789abcdef01234567", common.COMMIT_ENV, False)


def test_a_result_without_its_environment_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="lacks its environment's"):
        common.write_results("example", {"rows": [1]}, "table")
    assert not (tmp_path / "example.json").exists()


def test_a_payload_keeps_the_environment_it_brings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    env = {"commit": "0123456789abcdef", "dirty": True, "dirty_files": {"count": 2, "files": ["a.py", "b.py"]},
           "date": "2026-01-02T03:04:05Z", "cpu": "CPU Test", "cpus": 2, "torch": "2.9.0", "dtype": "float32"}
    common.write_results("example", {"environment": env}, "table")
    assert json.loads((tmp_path / "example.json").read_text())["environment"] == env
    assert (tmp_path / "example.md").read_text().strip().endswith(
        "Measured on commit `0123456789ab` with uncommitted changes (2 files), 2026-01-02 03:04:05 UTC, CPU Test "
        "(2 CPUs), torch 2.9.0, float32.")


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real git checkout with one commit, as the benchmarks' repository."""
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", "code.py")
    git(repo, "commit", "-q", "-m", "one")
    monkeypatch.setattr(common, "REPO", repo)
    return repo


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    common.add_bench_arguments(parser)
    return common.parse_bench_args(parser, argv)


def test_a_benchmark_refuses_a_dirty_tree_unless_told_and_records_that_it_was(
        checkout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a clean tree, and a benchmark's own outputs beside it, run
    (checkout / "bench" / "results" / "old.json").write_text("{}")
    assert parse(["--quick"]).profile == "quick"
    assert common.environment()["dirty"] is False
    # a modified tracked file, or a new file the commit lacks, is refused before anything runs
    for change in (lambda: (checkout / "code.py").write_text("x = 2\n"), lambda: (checkout / "new.py").write_text("")):
        change()
        with pytest.raises(SystemExit) as refused:
            parse(["--quick"])
        assert refused.value.code == 2
        [message] = capsys.readouterr().err.splitlines()
        assert message.startswith("error: the working tree has ") and "--allow-dirty" in message
    # told, it measures, says so, and the result records the tree and its changed files
    assert parse(["--quick", "--allow-dirty"]).allow_dirty
    assert capsys.readouterr().err.startswith("warning: the working tree has 2 uncommitted file(s)")
    env = common.environment()
    assert env["dirty"] is True and env["dirty_files"] == {"count": 2, "files": ["code.py", "new.py"]}
    assert "with uncommitted changes (2 files)" in common.provenance(env)


def test_outside_a_git_checkout_no_commit_can_be_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "REPO", tmp_path)
    with pytest.raises(SystemExit) as refused:
        parse([])
    assert refused.value.code == 2
    assert parse(["--allow-dirty"]).allow_dirty
    assert (common.environment()["commit"], common.environment()["dirty"]) == (None, None)


def test_run_all_hands_allow_dirty_to_every_benchmark(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (checkout / "code.py").write_text("x = 3\n")
    commands, real_run = [], subprocess.run

    def run(command: list[str], **kwargs):  # the benchmarks are recorded, not run; git still runs
        if command[0] != sys.executable:
            return real_run(command, **kwargs)
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(run_all.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["run_all", "--quick", "--only", "ingest,syncs"])
    with pytest.raises(SystemExit):
        run_all.main()
    assert commands == []  # refused before any benchmark started
    monkeypatch.setattr(sys, "argv", ["run_all", "--quick", "--only", "ingest,syncs", "--allow-dirty"])
    run_all.main()
    assert [c[2:] for c in commands] == [["bench.syncs", "--quick", "--allow-dirty"],
                                         ["bench.ingest", "--quick", "--allow-dirty"]]


def test_result_names_keep_fp32_on_a_cpu_unmarked_and_give_other_dtypes_their_own() -> None:
    import torch

    cpu, gpu = torch.device("cpu"), torch.device("cuda")

    def name(device: torch.device, profile: str, dtype: torch.dtype | None, pair: str = "qwen-coder-small") -> str:
        return common.result_name("engine", device, pair, profile, dtype)

    # every fp32 CPU result keeps the name it had before the dtype was chosen by timing
    assert [name(cpu, p, torch.float32) for p in common.PROFILES] == ["engine_cpu_quick", "engine_cpu",
                                                                       "engine_cpu_full"]
    assert [name(cpu, p, torch.bfloat16) for p in common.PROFILES] == ["engine_cpu_bf16_quick", "engine_cpu_bf16",
                                                                        "engine_cpu_bf16_full"]
    assert name(cpu, "quick", torch.bfloat16, "tiny") == "engine_cpu_tiny_bf16_quick"
    # on CUDA bf16 is the reference, and fp32 is marked
    assert (name(gpu, "standard", torch.bfloat16), name(gpu, "full", torch.float32)) == ("engine_gpu",
                                                                                          "engine_gpu_fp32_full")
    # no model ran: nothing to mark; the environment's string names the same dtypes as torch's
    assert common.variant_suffix("cpu", None, "full") == "_full"
    assert common.variant_suffix("cpu", "bfloat16", "standard") == common.dtype_suffix("cpu", torch.bfloat16) == "_bf16"


def test_run_all_splices_a_bf16_result_under_its_own_key_and_leaves_the_fp32_table(
        checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    page, results = checkout / "docs" / "benchmarks.md", checkout / "bench" / "results"
    page.parent.mkdir()
    shutil.copy(run_all.TABLES, page)
    assert run_all.splice("engine_bf16", "not yet measured in bf16", page)  # whatever the real page holds there
    monkeypatch.setattr(run_all, "REPO", checkout)
    monkeypatch.setattr(run_all, "TABLES", page)
    monkeypatch.setattr(run_all, "RESULTS", results)
    monkeypatch.setattr(common, "RESULTS", results)
    monkeypatch.setattr(run_all.torch.cuda, "is_available", lambda: False)  # the CPU's tables
    measured_in, real_run = [torch.float32], subprocess.run

    def benchmark(command: list[str], **kwargs):
        """The engine benchmark's writing, in the dtype of ``measured_in``; git still runs."""
        if command[0] != sys.executable:
            return real_run(command, **kwargs)
        dtype = measured_in[0]
        monkeypatch.setenv(common.WRITTEN_ENV, kwargs["env"][common.WRITTEN_ENV])
        common.write_results(common.result_name("engine", torch.device("cpu"), "qwen-coder-small", "standard", dtype),
                             {"environment": common.environment(torch.device("cpu"), dtype)}, f"table in {dtype}")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(run_all.subprocess, "run", benchmark)
    monkeypatch.setattr(sys, "argv", ["run_all", "--only", "engine", "--allow-dirty"])

    def table(key: str) -> str:
        return page.read_text().split(f"<!-- bench:{key} -->\n")[1].split(f"\n<!-- /bench:{key} -->")[0]

    run_all.main()
    fp32_table = table("engine")
    assert fp32_table.startswith("table in torch.float32") and table("engine_bf16") == "not yet measured in bf16"
    before = page.read_text()
    measured_in[0] = torch.bfloat16
    run_all.main()
    assert table("engine_bf16").startswith("table in torch.bfloat16") and table("engine") == fp32_table
    assert page.read_text().replace(table("engine_bf16"), "not yet measured in bf16") == before
    assert sorted(p.name for p in results.iterdir()) == ["engine_cpu.json", "engine_cpu.md", "engine_cpu_bf16.json",
                                                         "engine_cpu_bf16.md"]
    assert json.loads((results / "engine_cpu.json").read_text())["environment"]["dtype"] == "float32"


def test_every_cpu_table_a_bf16_run_fills_has_its_markers() -> None:
    text = run_all.TABLES.read_text()
    for key in ("engine_bf16", "engine_bf16_full", "continuous_bf16", "sidecar_bf16", "sidecar_bf16_full",
                "tagging_cost_bf16"):
        assert re.search(f"<!-- bench:{key} -->\n.+?\n<!-- /bench:{key} -->", text, re.DOTALL), key


def test_the_dtype_a_benchmark_records_is_pinned_for_the_loads_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import torch

    from sidecar import load_pair
    from sidecar.models import dtype_choice

    def timed(faster: torch.dtype):  # the CPU's two matmuls (bf16, fp32), timed close enough to go either way
        return lambda calls, **kwargs: [1.0, 1.01] if faster == torch.bfloat16 else [1.01, 1.0]

    monkeypatch.setenv("SIDECAR_DTYPE", "auto")
    monkeypatch.setattr(dtype_choice, "fastest_seconds", timed(torch.bfloat16))
    device, dtype = common.pin_pair_dtype("tiny")
    assert (device.type, dtype, os.environ["SIDECAR_DTYPE"]) == ("cpu", torch.bfloat16, "bf16")
    # a flow run, shard or server loading the pair later, where the timing has turned, loads what was recorded
    monkeypatch.setattr(dtype_choice, "fastest_seconds", timed(torch.float32))
    assert load_pair("tiny").dtype == torch.bfloat16
    assert common.variant_suffix(device.type, dtype, "quick") == "_bf16_quick"
