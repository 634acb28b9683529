"""sidecar: batched lossless speculative decoding whose draft model runs sidecar tasks afterwards.

The names below load on first use, so that ``import sidecar.modes`` or the command line's start does
not import torch and transformers (seconds) before a command needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.engine import SidecarEngine
    from sidecar.errors import InputError, PairError
    from sidecar.models import ModelPair, load_pair
    from sidecar.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
    from sidecar.rows import GenerationOutput, GenerationStats
    from sidecar.sidecar_rows import DocumentResult, SidecarOutput, SidecarRequest, SidecarStats
    from sidecar.speculative import SpeculativeDecoder
    from sidecar.tasks import HASHTAGS, SidecarTask, parse_hashtags

_EXPORTS = {
    "sidecar.engine": ("DocumentResult", "SidecarEngine", "SidecarOutput", "SidecarRequest", "SidecarStats"),
    "sidecar.errors": ("InputError", "PairError"),
    "sidecar.models": ("ModelPair", "load_pair"),
    "sidecar.prompts": ("DEFAULT_SYSTEM", "SUMMARIZE_INSTRUCTION"),
    "sidecar.speculative": ("GenerationOutput", "GenerationStats", "SpeculativeDecoder"),
    "sidecar.tasks": ("HASHTAGS", "SidecarTask", "parse_hashtags"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DEFAULT_SYSTEM",
    "HASHTAGS",
    "SUMMARIZE_INSTRUCTION",
    "DocumentResult",
    "GenerationOutput",
    "GenerationStats",
    "InputError",
    "ModelPair",
    "PairError",
    "SidecarEngine",
    "SidecarOutput",
    "SidecarRequest",
    "SidecarStats",
    "SidecarTask",
    "SpeculativeDecoder",
    "load_pair",
    "parse_hashtags",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'sidecar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
