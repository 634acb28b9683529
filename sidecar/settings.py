"""Process-wide settings, read from the environment (``SIDECAR_*``).

The engine reads them, and the engine runs where only torch and transformers are installed (the GPU check
on a stock image), so they are read with the standard library rather than pydantic-settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.errors import InputError

PREFIX = "SIDECAR_"
# the help of the --dtype option of the commands that load a pair (``sidecar.models.dtype_choice``)
DTYPE_HELP = ("Dtype the pair loads in: fp32, bf16, fp16 or auto (default: $SIDECAR_DTYPE, else auto: bf16 on "
              "CUDA, on a CPU the faster of bf16 and fp32, timed at load).")
TRUE = {"1", "true", "yes", "on", "t", "y"}
FALSE = {"0", "false", "no", "off", "f", "n", ""}


def _env(name: str) -> str | None:
    return os.environ.get(PREFIX + name.upper())


def _flag(name: str) -> bool:
    value = (_env(name) or "").strip().lower()
    if value not in TRUE | FALSE:
        raise InputError(f"{PREFIX}{name.upper()}={value!r} is not a boolean: use 1/0, true/false, yes/no or on/off")
    return value in TRUE


# what SIDECAR_DTYPE and --dtype accept (``sidecar.models.dtype_choice.DTYPES`` and ``auto``)
DTYPE_NAMES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "auto")


def _dtype() -> str | None:
    value = (_env("dtype") or "").strip().lower()
    if value and value not in DTYPE_NAMES:
        raise InputError(f"unknown dtype {value!r} in {PREFIX}DTYPE: use fp32, bf16, fp16 or auto")
    return value or None


# what SIDECAR_CAPTURE and the capture arguments accept (``sidecar.runtime.capture``)
CAPTURE_NAMES = ("auto", "eager", "compile", "cudagraph", "hf")


def parse_capture(value: str | None, source: str) -> str | None:
    """A capture mode's name, lower-cased (None: not given); an unknown name is one line naming ``source``."""
    name = (value or "").strip().lower()
    if name and name not in CAPTURE_NAMES:
        raise InputError(f"unknown capture mode {value!r} in {source}: use auto, eager, compile, cudagraph or hf")
    return name or None


# what SIDECAR_WARMUP accepts (``sidecar.runtime.warmup``): auto warms in ``cudagraph`` mode only (a compile
# per shape is seconds on a CPU and minutes on a big model: compile mode compiles a shape when it first runs)
WARMUP_NAMES = ("auto", "on", "off")


def _warmup() -> str:
    value = (_env("warmup") or "").strip().lower()
    if value and value not in WARMUP_NAMES:
        raise InputError(f"unknown warm-up {value!r} in {PREFIX}WARMUP: use auto, on or off")
    return value or "auto"


def _path(name: str) -> Path | None:
    value = _env(name)
    return Path(value) if value else None


@dataclass(frozen=True)
class Settings:
    home: Path = field(default_factory=lambda: _path("home") or Path.home() / ".cache" / "sidecar")
    # where runs take the lock of the accelerator they use; processes that share a device must share
    # this folder (default: ``home``/locks, per user)
    lock_dir: Path | None = field(default_factory=lambda: _path("lock_dir"))
    # prefill every batch in one forward, as on an accelerator, instead of the CPU's groups of rows
    one_prefill_forward: bool = field(default_factory=lambda: _flag("one_prefill_forward"))
    # the Prefect global concurrency limit a run holds a slot of while its pair is loaded: one per GPU on a
    # pool of several (a worker per GPU sets ``gpu-<host>-<index>``), ``gpu`` for a single-GPU server
    gpu_limit: str = field(default_factory=lambda: _env("gpu_limit") or "gpu")
    # the dtype pairs load in when the caller names none: fp32, bf16, fp16, or auto (unset: auto), as
    # ``sidecar.models.dtype_choice`` chooses
    dtype: str | None = field(default_factory=_dtype)
    # how decode forwards run: auto, eager, compile, cudagraph or hf (unset: auto), as
    # ``sidecar.runtime.capture`` resolves it
    capture: str | None = field(default_factory=lambda: parse_capture(_env("capture"), f"{PREFIX}CAPTURE"))
    # whether compiled or captured decode forwards are warmed at load (``sidecar serve``, the nightly run) and
    # as each KV cache is allocated: on, off, or auto (unset: in ``cudagraph`` mode only); eager and hf never
    warmup: str = field(default_factory=_warmup)


def pin_dtype(dtype: str | None) -> None:
    """``--dtype`` for this process and those it starts (shards): they read ``SIDECAR_DTYPE``; a bad name is
    refused here, before anything runs."""
    if dtype is not None:
        if dtype.strip().lower() not in DTYPE_NAMES:
            raise InputError(f"unknown --dtype {dtype!r}: use fp32, bf16, fp16 or auto")
        os.environ[PREFIX + "DTYPE"] = dtype


def sidecar_home() -> Path:
    return Settings().home


def lock_dir() -> Path:
    """``$SIDECAR_LOCK_DIR``, else ``locks`` under the sidecar home."""
    settings = Settings()
    return settings.lock_dir or settings.home / "locks"
