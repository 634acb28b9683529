"""The dtype a pair loads in: the argument, else SIDECAR_DTYPE, else the faster of bf16 and fp32 on a CPU.

The rest of the suite runs pinned to fp32 (``tests/conftest.py``); these tests set their own.
"""

from __future__ import annotations

import os

import pytest
import torch

from sidecar.errors import InputError
from sidecar.fastest import fastest_seconds
from sidecar.models.cpu_kernels import OneDNNLinear, onednn_available
from sidecar.models.dtype_choice import choose_dtype, faster_dtype
from sidecar.models.loading import load_pair

CPU = torch.device("cpu")


def test_bf16_is_chosen_only_where_its_matmul_is_faster() -> None:
    amx = faster_dtype(bf16_s=0.31e-3, fp32_s=0.84e-3)
    assert amx.dtype == torch.bfloat16 and amx.reason == "auto: bf16 matmul 0.31 ms vs fp32 0.84 ms"
    emulated = faster_dtype(bf16_s=4.2e-3, fp32_s=0.84e-3)
    assert emulated.dtype == torch.float32 and emulated.reason == "auto: bf16 matmul 4.20 ms vs fp32 0.84 ms"
    assert faster_dtype(1e-3, 1e-3).dtype == torch.float32  # a tie keeps the reference dtype


def test_a_burst_of_load_on_the_faster_dtypes_first_calls_does_not_crown_the_other() -> None:
    """The faster call is stalled for its warm-up and first six timed calls (a loaded machine's scheduler
    slices); timed in turn within a budget, each keeps its undisturbed best. Five calls each, as the choice
    once timed, would have crowned the slower one."""
    now = [0.0]
    fast = iter([0.010] * 7 + [0.001] * 10_000)
    calls = [lambda: now.__setitem__(0, now[0] + next(fast)), lambda: now.__setitem__(0, now[0] + 0.003)]
    assert fastest_seconds(calls, budget_s=0.05, clock=lambda: now[0]) == pytest.approx([0.001, 0.003])
    now[0], fast = 0.0, iter([0.010] * 7 + [0.001] * 10_000)
    assert fastest_seconds(calls, budget_s=0.0, clock=lambda: now[0]) == pytest.approx([0.010, 0.003])
    # the budget bounds the timing: about budget / call time rounds, then it stops
    now[0], count = 0.0, [0]
    counted = [lambda: (now.__setitem__(0, now[0] + 0.001), count.__setitem__(0, count[0] + 1))] * 2
    fastest_seconds(counted, budget_s=0.02, clock=lambda: now[0])
    assert 2 * 20 <= count[0] <= 2 * 22
    # calls of seconds each: the cap on all timed rounds stops short of min_calls, after one round at least
    slow = [lambda: (now.__setitem__(0, now[0] + 10.0), count.__setitem__(0, count[0] + 1))] * 2
    for cap, rounds in ((None, 3), (30.0, 2), (5.0, 1)):
        now[0], count[0] = 0.0, 0
        fastest_seconds(slow, budget_s=0.15, min_calls=3, clock=lambda: now[0], cap_s=cap)
        assert count[0] == 2 * (1 + rounds), cap  # the untimed first call of each, then the timed rounds


def test_the_argument_wins_over_the_environment_which_wins_over_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDECAR_DTYPE", "bf16")
    assert choose_dtype(CPU, "fp16", 64, 128).dtype == torch.float16
    assert choose_dtype(CPU, torch.float32, 64, 128).reason == "argument dtype=fp32"
    from_env = choose_dtype(CPU, None, 64, 128)
    assert (from_env.dtype, from_env.reason) == (torch.bfloat16, "SIDECAR_DTYPE=bf16")
    assert choose_dtype(CPU, "auto", 64, 128).reason.startswith("auto: bf16 matmul ")
    monkeypatch.setenv("SIDECAR_DTYPE", "auto")
    assert choose_dtype(CPU, None, 64, 128).reason.startswith("auto: bf16 matmul ")
    monkeypatch.delenv("SIDECAR_DTYPE")
    assert choose_dtype(CPU, None, 64, 128).reason.startswith("auto: bf16 matmul ")
    assert choose_dtype(torch.device("cuda"), None, 64, 128).reason == "default on CUDA: bf16"


def test_an_unknown_dtype_is_one_line_naming_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDECAR_DTYPE", "fp8")
    with pytest.raises(InputError, match="unknown dtype 'fp8' in SIDECAR_DTYPE: use fp32, bf16, fp16 or auto"):
        choose_dtype(CPU, None, 64, 128)
    with pytest.raises(InputError, match="in the dtype argument"):
        choose_dtype(CPU, "int4", 64, 128)


def test_the_loaded_pair_carries_its_dtype_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = load_pair("tiny")
    assert pinned.dtype == torch.float32 and pinned.dtype_report == "fp32 (SIDECAR_DTYPE=fp32)"
    if onednn_available():  # fp32 on a CPU keeps its packed oneDNN Linear layers
        assert any(isinstance(m, OneDNNLinear) for m in pinned.target.modules())
    assert load_pair("tiny", dtype="bf16").dtype_report == "bf16 (argument dtype=bf16)"
    monkeypatch.setenv("SIDECAR_DTYPE", "auto")
    timed = load_pair("tiny")
    assert timed.dtype in (torch.float32, torch.bfloat16) and timed.dtype_reason.startswith("auto: bf16 matmul ")


def test_a_bad_dtype_option_is_refused_before_it_reaches_the_environment() -> None:
    from sidecar.settings import pin_dtype

    with pytest.raises(InputError, match="unknown --dtype 'fp8'"):
        pin_dtype("fp8")
    assert os.environ["SIDECAR_DTYPE"] == "fp32"
