"""The suite's own settings: a hung test fails in bounded time instead of holding the run forever, and a run
keeps every test's time."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from servers import UnmarkedServer, refuse_servers

REPO = Path(__file__).resolve().parents[1]


def test_every_test_has_a_time_limit_covering_its_setup(pytestconfig: pytest.Config) -> None:
    # pytest-timeout reads an unset `timeout` as no limit; with func_only off, the limit covers the fixtures a
    # test sets up (the real pair's module fixture decodes its references there)
    assert 0 < float(pytestconfig.getini("timeout") or 0) <= 600
    assert not pytestconfig.getini("timeout_func_only")


@pytest.mark.servers
def test_a_run_keeps_every_tests_setup_call_and_teardown_seconds_slowest_first(tmp_path: Path) -> None:
    # the way `make test` runs: under pytest-xdist, where the workers run the tests and the controller writes
    path = tmp_path / "artifacts" / "durations.txt"
    tests = ["tests/test_suite_settings.py::test_every_test_has_a_time_limit_covering_its_setup",
             "tests/test_shard_plan.py"]
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadfile", "--durations-file", str(path), *tests],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stdout[-2000:]
    header, *lines = path.read_text().splitlines()
    assert header.split() == ["total", "setup", "call", "teardown", "test"]
    collected = int(re.search(r"(\d+) passed", ran.stdout).group(1))
    assert len(lines) == collected > 1
    totals = [float(line.split()[0]) for line in lines]
    assert totals == sorted(totals, reverse=True)
    for line in lines:  # each total is its three phases
        total, *phases, _ = line.split()
        assert abs(float(total) - sum(map(float, phases))) < 0.02


def test_a_fast_run_refuses_an_unmarked_test_that_starts_a_server_or_a_process(monkeypatch, tmp_path) -> None:
    refuse_servers(monkeypatch)
    for command in ([sys.executable, "-c", "pass"], [str(Path(sys.executable).with_name("sidecar")), "--help"],
                    [str(REPO / "infra" / "gpu-workers.sh")], ["chromium", "--headless"]):
        with pytest.raises(UnmarkedServer, match="mark it `servers`"):
            subprocess.Popen(command)
    with socket.socket() as sock, pytest.raises(UnmarkedServer, match="this test starts a server"):
        sock.bind(("127.0.0.1", 0))  # binding to learn a free port is no server; listening is
        sock.listen()
    # other commands (git, a linter) still run
    assert subprocess.run(["git", "--version"], capture_output=True, text=True).returncode == 0


def test_a_fast_run_lets_the_compiler_start_its_own_helpers(monkeypatch) -> None:
    """Inductor probes the CPU's vector ISA in a Python process of its own the first time a process loads a
    compiled graph: part of a compile, which a fast test may do."""
    refuse_servers(monkeypatch)
    source = "def start():\n    return subprocess.run([sys.executable, '-c', 'pass']).returncode\n"
    for filename, allowed in ((str(Path(torch.__file__).parent / "_inductor" / "cpu_vec_isa.py"), True),
                              (str(REPO / "sidecar" / "anything.py"), False)):
        scope = {"subprocess": subprocess, "sys": sys}
        exec(compile(source, filename, "exec"), scope)
        if allowed:
            assert scope["start"]() == 0
        else:
            with pytest.raises(UnmarkedServer, match="mark it `servers`"):
                scope["start"]()


def test_make_test_fast_deselects_the_tests_that_start_servers(pytestconfig: pytest.Config) -> None:
    assert any(line.startswith("servers:") for line in pytestconfig.getini("markers"))
    fast = re.search(r"^test-fast:.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
    assert '-m "not real and not slow and not servers"' in fast


@pytest.mark.servers
def test_make_test_hands_modules_out_in_collection_order() -> None:
    # pytest-xdist's loadfile reorders the modules by their number of tests unless told not to, which undoes
    # module_rank's order (the real pair's module, with 3 tests, went out midway and ended the run alone)
    pytest_line = re.search(r"^PYTEST :=(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1).split()
    assert "--no-loadscope-reorder" in pytest_line and pytest_line[pytest_line.index("--dist") + 1] == "loadfile"


@pytest.mark.servers
def test_the_real_pairs_modules_run_first_then_the_wholly_slow_ones(tmp_path: Path) -> None:
    # pytest-xdist hands modules out in this order: one as long as the real pair's handed out late is the tail
    modules = ["tests/test_shard_plan.py", "tests/test_sharded_nightly.py", "tests/test_real_pair.py",
               "tests/test_capture.py"]  # test_capture.py: some of its tests are slow, not all
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *modules],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stdout[-2000:]
    order = list(dict.fromkeys(line.split("::")[0] for line in ran.stdout.splitlines() if "::" in line))
    assert order == ["tests/test_real_pair.py", "tests/test_sharded_nightly.py", "tests/test_shard_plan.py",
                     "tests/test_capture.py"]


COMMAND_LINE = """
import sys
sys.path.insert(0, "tests")
from inductor_paths import name_torch_by_its_build
from test_suite_settings import kernel_command_line

name_torch_by_its_build()
print(kernel_command_line())
"""


def kernel_command_line() -> str:
    """The g++ command line inductor keys a CPU kernel by (besides its source)."""
    from torch._inductor.codecache import pick_vec_isa
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

    options = CppTorchDeviceOptions(compile_only=False, min_optimize=False, device_type="cpu",
                                    vec_isa=pick_vec_isa(), extra_flags=(), use_relative_path=False)
    return CppBuilder(name="o", sources="i", BuildOption=options).get_command_line()


@pytest.mark.servers
def test_a_venv_at_another_path_compiles_kernels_under_the_same_cache_keys(tmp_path: Path) -> None:
    # inductor keys a compiled C++ kernel by its g++ command line: a clean clone's venv, elsewhere, named torch's
    # headers by its own path and compiled every kernel again (tests/inductor_paths.py; conftest.py names it so)
    elsewhere = tmp_path / "clean-clone" / ".venv"
    elsewhere.parent.mkdir()
    elsewhere.symlink_to(sys.prefix, target_is_directory=True)  # the same torch, found under another path
    ran = subprocess.run([str(elsewhere / "bin" / "python"), "-c", COMMAND_LINE], cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-2000:]
    line = ran.stdout.removesuffix("\n")
    assert str(elsewhere) not in line and "sidecar-torch" in line
    assert line == kernel_command_line()


def test_the_link_naming_torch_by_its_build_is_made_again_where_it_is_broken_or_leads_to_another_build(
        tmp_path: Path) -> None:
    from inductor_paths import build_link

    def torch_dir(name: str, version: str) -> Path:
        path = tmp_path / name / "torch"
        path.mkdir(parents=True)
        (path / "version.py").write_text(f"__version__ = '{version}'\n")
        return path

    first, same, other = torch_dir("a", "2.13.0"), torch_dir("b", "2.13.0"), torch_dir("c", "2.14.0")
    cache = tmp_path / "cache"
    link = build_link(first, cache, "2.13.0+cpu", "0123456789abcdef")
    assert link == cache / "sidecar-torch" / "2.13.0_cpu-0123456789ab" and link.resolve() == first
    # another venv of the same build uses the link as it is
    assert build_link(same, cache, "2.13.0+cpu", "0123456789abcdef") == link and link.resolve() == first
    # a link to another build, or to a venv since removed, is made again to this one's
    assert build_link(other, cache, "2.13.0+cpu", "0123456789abcdef") == link and link.resolve() == other
    (other / "version.py").unlink()
    other.rmdir()
    assert build_link(same, cache, "2.13.0+cpu", "0123456789abcdef") == link and link.resolve() == same
    assert [p.name for p in link.parent.iterdir()] == [link.name]


def test_without_a_cache_directory_to_write_torchs_own_paths_stay(tmp_path: Path, monkeypatch) -> None:
    import torch.utils.cpp_extension as cpp_extension
    from inductor_paths import name_torch_by_its_build

    before = cpp_extension._TORCH_PATH, cpp_extension.TORCH_LIB_PATH
    monkeypatch.setattr(cpp_extension, "_TORCH_PATH", before[0])  # both put back after the test
    monkeypatch.setattr(cpp_extension, "TORCH_LIB_PATH", before[1])
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert name_torch_by_its_build() is None
    assert before == (cpp_extension._TORCH_PATH, cpp_extension.TORCH_LIB_PATH)
    # a torch without those module paths (a later release may rename them) is left alone too
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delattr(cpp_extension, "TORCH_LIB_PATH")
    assert name_torch_by_its_build() is None and before[0] == cpp_extension._TORCH_PATH
    assert not (tmp_path / "cache" / "sidecar-torch").exists()
