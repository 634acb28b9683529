"""Accelerator ids: what two processes must agree on to keep each other off one device."""

from __future__ import annotations

import _json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sidecar.models.devices import accelerator_id, gpu_driver_present

ROOT = Path(__file__).resolve().parents[1]


def test_accelerator_ids_name_the_physical_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert accelerator_id() == "cpu" == accelerator_id("cpu")
    # a CUDA machine: its driver loads, and torch finds a device
    monkeypatch.setattr("sidecar.models.devices.gpu_driver_present", lambda: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert accelerator_id() == "cuda-0" and accelerator_id("cuda:1") == "cuda-1"
    # a process that sees only devices 2 and 3 calls them 0 and 1: the id is the physical one
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert accelerator_id() == "cuda-2" and accelerator_id("cuda:1") == "cuda-3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c/../x")
    assert accelerator_id() == "cuda-GPU-5f1c_.._x", "a file name, whatever the variable holds"
    assert accelerator_id("cpu") == "cpu"


@pytest.mark.servers  # it starts a Python process
def test_torch_is_asked_for_the_gpus_wherever_a_gpu_driver_loads(tmp_path: Path) -> None:
    # a sharded run's parent does not load torch (seconds) to count GPUs where no GPU driver is (see
    # test_layers): torch finds none there
    assert gpu_driver_present() or not torch.cuda.is_available()
    # where the CUDA driver's library loads, torch counts them; a stand-in for it: any shared library by its name
    shutil.copy(_json.__file__, tmp_path / "libcuda.so.1")
    code = "import sys; from sidecar.models.devices import visible_gpus; visible_gpus(); print('torch' in sys.modules)"
    env = os.environ | {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, (str(tmp_path),
                                                                        os.environ.get("LD_LIBRARY_PATH"))))}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["True"], result.stdout + result.stderr
