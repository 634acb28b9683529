"""Sizes of a decoder-only draft model, counted from its config's shapes: parameters, weight bytes a decode
step streams, KV bytes per token, and the shapes a forward's FLOPs are counted from (see ``roofline``).

Only architectures whose parameter count is modelled exactly (Qwen2, Llama, without sliding-window attention)
are accepted; others raise :class:`CostInputError` rather than give a wrong count.
``draft_config`` and ``default_dtype`` give a run's draft config and dtype without loading weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from study.cost.errors import CostInputError, count

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Which attention projections carry a bias, per supported architecture: (q/k/v bias, o bias).
# Qwen2 hard-codes biased q/k/v and an unbiased o_proj; Llama applies `attention_bias` to all four.
_SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def _attention_biases(config: PretrainedConfig | SimpleNamespace) -> tuple[bool, bool]:
    if config.model_type == "qwen2":
        return True, False
    biased = bool(getattr(config, "attention_bias", False))
    return biased, biased


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of one decoder-only model, counted from its config's shapes.

    ``layer_matmul_parameters`` are the weights of every layer's linear maps (q, k, v, o, gate, up, down),
    without biases and norms; ``lm_head_parameters`` the LM head's (vocab x hidden, tied or not);
    ``attention_width`` is heads x head dim, the width of the queries.
    """

    model_type: str
    parameters: int
    embedding_parameters: int
    tied_embeddings: bool
    kv_bytes_per_token: int
    dtype_bytes: int
    layers: int
    attention_width: int
    layer_matmul_parameters: int
    lm_head_parameters: int

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.dtype_bytes

    @property
    def weight_bytes_per_step(self) -> int:
        """Weight bytes a decode step streams from memory.

        A step gathers only ``batch`` rows of the input embedding table, so an untied table is not read
        in full; a tied one is, because the LM head multiplies by the whole matrix.
        """
        if self.tied_embeddings:
            return self.weight_bytes
        return (self.parameters - self.embedding_parameters) * self.dtype_bytes

    @classmethod
    def from_config(cls, config: PretrainedConfig | SimpleNamespace, dtype_bytes: int = 2) -> ModelFacts:
        if config.model_type not in _SUPPORTED_MODEL_TYPES:
            raise CostInputError(
                f"model type {config.model_type!r} is not modelled; supported: {', '.join(_SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "use_sliding_window", False):
            raise CostInputError("sliding-window attention caps the KV cache and is not modelled")
        count("dtype_bytes", dtype_bytes)
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        layers = config.num_hidden_layers
        intermediate = config.intermediate_size
        tied = bool(config.tie_word_embeddings)

        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        qkv_bias, o_bias = _attention_biases(config)
        attention_matmul = hidden * (q_width + 2 * kv_width) + q_width * hidden
        attention = attention_matmul + qkv_bias * (q_width + 2 * kv_width) + o_bias * hidden
        mlp_matmul = 3 * hidden * intermediate  # gate, up, down
        mlp = mlp_matmul + bool(getattr(config, "mlp_bias", False)) * (2 * intermediate + hidden)
        norms = 2 * hidden  # RMSNorm before attention and before the MLP
        embedding = config.vocab_size * hidden
        lm_head = 0 if tied else config.vocab_size * hidden
        parameters = embedding + layers * (attention + mlp + norms) + hidden + lm_head  # + final norm
        return cls(
            model_type=config.model_type,
            parameters=parameters,
            embedding_parameters=embedding,
            tied_embeddings=tied,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,  # K and V
            dtype_bytes=dtype_bytes,
            layers=layers,
            attention_width=q_width,
            layer_matmul_parameters=layers * (attention_matmul + mlp_matmul),
            lm_head_parameters=config.vocab_size * hidden,
        )

    @classmethod
    def from_config_file(cls, path: Path, dtype_bytes: int = 2) -> ModelFacts:
        """Facts from a ``config.json`` file or a model folder holding one."""
        from transformers import AutoConfig  # deferred: importing transformers takes seconds

        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise CostInputError(f"no model config at {config_path}")
        return cls.from_config(AutoConfig.from_pretrained(str(config_path)), dtype_bytes)


def draft_config(pair: str) -> PretrainedConfig | SimpleNamespace:
    """The draft model's config of a pair named as ``load_pair`` takes it (a run's ``pair``), without its weights.

    Only what is on this machine is read: a fetched offline pair, a local path or the Hugging Face cache.
    Raises :class:`CostInputError` saying why when the config is not there. The tiny pair's is its fields
    (``sidecar.models.tiny_config``): a transformers config imports torch, which takes seconds, and a real
    pair's is read with transformers' ``AutoConfig``, which does.
    """
    # deferred: the tiny pair's tokenizer imports transformers (most of a second)
    from sidecar.models.pair_names import pair_model_ids
    from sidecar.models.tiny_config import tiny_draft_config

    if pair == "tiny":
        # The tiny pair has no files: its models are built from a config with random weights, in milliseconds.
        return tiny_draft_config()
    try:
        _, draft = pair_model_ids(pair)  # a mistyped name is refused before transformers loads
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(draft, local_files_only=True)
    except (OSError, ValueError) as exc:  # OSError: no such path, not cached; PairError: unknown, not fetched
        raise CostInputError(f"the config of pair {pair!r}'s draft is not on this machine: {exc}") from exc


def default_dtype(device: str) -> tuple[str, int]:
    """Name and bytes per element of the dtype ``load_pair`` gives a pair on ``device`` when none is asked
    for, which is how the nightly flow loads it."""
    from sidecar.models.default_dtype import device_default_dtype

    return device_default_dtype(device)
