"""A draft/target model pair: the two models, their shared tokenizer, and what the pair needs checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sidecar.errors import PairError
from sidecar.models.devices import device_name


@dataclass
class ModelPair:
    """A target, the draft that speculates for it, and their shared tokenizer."""

    name: str
    target: PreTrainedModel
    draft: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    # draft parameters / target parameters: a prior for what the draft's prefill costs before it is timed
    draft_size_ratio: float | None = None
    # why the pair runs in ``dtype`` (``sidecar.models.dtype_choice``): reported beside the device
    dtype_reason: str = ""
    # the capture mode asked for (``load_pair``'s argument; None: SIDECAR_CAPTURE, else auto), and the one the
    # decoder runs with and why, once a ``SpeculativeDecoder`` has attached it (``sidecar.runtime.capture``)
    capture: str | None = None
    capture_mode: str = ""
    capture_reason: str = ""

    def __post_init__(self) -> None:
        # inference only: a forward run outside inference mode (a caller's own, a benchmark's) records no gradient
        # graph; on a CPU in bf16 a oneDNN-packed one-token forward took 140x as long while its parameters wanted one
        for model in (self.target, self.draft):
            model.requires_grad_(False)
        if not self.dtype_reason:
            self.dtype_reason = f"argument dtype={dtype_name(self.dtype)}"
        if self.draft_size_ratio is None:
            self.draft_size_ratio = self.draft.num_parameters() / self.target.num_parameters()

    @property
    def max_context(self) -> int:
        return int(self.target.config.max_position_embeddings)

    @property
    def gpu_type(self) -> str:
        return device_name(self.device)

    @property
    def dtype_report(self) -> str:
        """``bf16 (auto: bf16 matmul 0.31 ms vs fp32 0.84 ms)``: the dtype and why."""
        return f"{dtype_name(self.dtype)} ({self.dtype_reason})"

    @property
    def capture_report(self) -> str:
        """``compile (auto: compiled step 31 ms (...) vs eager step 40 ms (...), ...)``: the capture mode and why
        (empty before a decoder attached one)."""
        return f"{self.capture_mode} ({self.capture_reason})" if self.capture_mode else ""


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def check_tokenizers(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """Refuse pairs whose tokenizers disagree: speculative decoding compares token ids directly."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise PairError(
            "draft and target tokenizers differ (their vocabularies do not map the same strings to the same "
            "ids); speculative decoding needs one shared tokenizer. Pick a draft from the target's family."
        )


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    ids: set[int] = set()
    config_eos = model.generation_config.eos_token_id if model.generation_config else None
    for value in (config_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(ids)
