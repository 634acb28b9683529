"""sidecar: batched lossless speculative decoding whose draft model runs sidecar tasks afterwards."""

from sidecar.engine import DocumentResult, SidecarEngine, SidecarOutput, SidecarRequest, SidecarStats
from sidecar.errors import InputError, PairError
from sidecar.models import ModelPair, load_pair
from sidecar.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
from sidecar.speculative import GenerationOutput, GenerationStats, SpeculativeDecoder
from sidecar.tasks import HASHTAGS, SidecarTask, parse_hashtags

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
