"""Accelerator ids: what two processes must agree on to keep each other off one device."""

from __future__ import annotations

import pytest

from sidecar.models.devices import accelerator_id


def test_accelerator_ids_name_the_physical_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert accelerator_id() == "cpu" == accelerator_id("cpu")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert accelerator_id() == "cuda-0" and accelerator_id("cuda:1") == "cuda-1"
    # a process that sees only devices 2 and 3 calls them 0 and 1: the id is the physical one
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert accelerator_id() == "cuda-2" and accelerator_id("cuda:1") == "cuda-3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c/../x")
    assert accelerator_id() == "cuda-GPU-5f1c_.._x", "a file name, whatever the variable holds"
    assert accelerator_id("cpu") == "cpu"
