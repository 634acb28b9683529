"""sidecar: batched lossless speculative decoding whose draft model runs sidecar tasks afterwards."""

from sidecar.errors import InputError, PairError
from sidecar.models import ModelPair, load_pair
from sidecar.speculative import GenerationOutput, GenerationStats, SpeculativeDecoder

__all__ = [
    "GenerationOutput",
    "GenerationStats",
    "InputError",
    "ModelPair",
    "PairError",
    "SpeculativeDecoder",
    "load_pair",
]
