"""sidecar: batched lossless speculative decoding whose draft model runs sidecar tasks afterwards.

The names below load on first use, so that ``import vocab.modes`` or the command line's start does
not import torch and transformers (seconds) before a command needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.lazy_names import lazy_names

if TYPE_CHECKING:
    from sidecar.decoding.decoder import SpeculativeDecoder
    from sidecar.decoding.rows import GenerationOutput
    from sidecar.decoding.stats import GenerationStats
    from sidecar.errors import InputError, PairError
    from sidecar.models.loading import load_pair
    from sidecar.models.pair import ModelPair
    from sidecar.tasks.engine import SidecarEngine
    from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
    from sidecar.tasks.rows import DocumentResult, SidecarOutput, SidecarRequest, SidecarStats
    from sidecar.tasks.task import HASHTAGS, SidecarTask, parse_hashtags

_EXPORTS = {
    "sidecar.tasks.engine": ("SidecarEngine",),
    "sidecar.tasks.rows": ("DocumentResult", "SidecarOutput", "SidecarRequest", "SidecarStats"),
    "sidecar.errors": ("InputError", "PairError"),
    "sidecar.models.loading": ("load_pair",),
    "sidecar.models.pair": ("ModelPair",),
    "sidecar.tasks.prompts": ("DEFAULT_SYSTEM", "SUMMARIZE_INSTRUCTION"),
    "sidecar.decoding.rows": ("GenerationOutput",),
    "sidecar.decoding.stats": ("GenerationStats",),
    "sidecar.decoding.decoder": ("SpeculativeDecoder",),
    "sidecar.tasks.task": ("HASHTAGS", "SidecarTask", "parse_hashtags"),
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


__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF, __all__)
