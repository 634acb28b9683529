"""Draft/target model pairs: named offline pairs, hub ids or paths, and a tiny random pair for tests."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sidecar.attention import GROUPED_SDPA
from sidecar.errors import PairError
from sidecar.fetch import is_fetched, pair_dir

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

NAMED_PAIRS: dict[str, tuple[str, str]] = {
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"),
}


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

    def __post_init__(self) -> None:
        if self.draft_size_ratio is None:
            self.draft_size_ratio = self.draft.num_parameters() / self.target.num_parameters()

    @property
    def max_context(self) -> int:
        return int(self.target.config.max_position_embeddings)

    @property
    def gpu_type(self) -> str:
        return device_name(self.device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return "CPU " + line.split(":", 1)[1].strip()
    return "CPU " + (platform.processor() or platform.machine())


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure it (CPU work is synchronous already)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device_dtype(device: str | None, dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        # bf16 is 5-7x slower than fp32 on this class of CPU; on GPUs bf16 is the native fast path.
        return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}[dtype]
    return resolved, dtype


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


def pair_model_ids(name_or_spec: str) -> tuple[str, str]:
    """(target, draft) hub ids or local paths of a named pair or a ``TARGET,DRAFT`` spec."""
    if name_or_spec == "qwen-coder-small":
        if not is_fetched(name_or_spec):
            raise PairError("the offline pair is not fetched yet: run `sidecar models fetch` first")
        root = pair_dir(name_or_spec)
        return str(root / "target"), str(root / "draft")
    if name_or_spec in NAMED_PAIRS:
        return NAMED_PAIRS[name_or_spec]
    if "," in name_or_spec:
        target_id, draft_id = (part.strip() for part in name_or_spec.split(",", 1))
        return target_id, draft_id
    raise PairError(
        f"unknown pair {name_or_spec!r}: use tiny, qwen-coder-small, {', '.join(NAMED_PAIRS)} "
        "or 'TARGET_ID_OR_PATH,DRAFT_ID_OR_PATH'"
    )


def load_tokenizer(name_or_spec: str = "qwen-coder-small") -> PreTrainedTokenizerBase:
    """The tokenizer of a pair (see :func:`load_pair`), without its models: for counting tokens."""
    if name_or_spec == "tiny":
        return tiny_tokenizer()
    return AutoTokenizer.from_pretrained(pair_model_ids(name_or_spec)[0])


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=GROUPED_SDPA)
    return model.to(device).eval()


def load_pair(name_or_spec: str = "qwen-coder-small", device: str | None = None,
              dtype: str | torch.dtype | None = None, fast_cpu_kernels: bool = True,
              draft_int8: bool = False) -> ModelPair:
    """Load a named pair (``qwen-coder-small``, ``qwen2.5-7b``, ``tiny``) or ``TARGET,DRAFT`` ids/paths.

    ``draft_int8`` quantizes the draft's Linear layers to int8 (CPU only). The target verifies every
    token, so output stays exactly the target's; only acceptance, and what the draft writes alone in
    sidecar tasks, can change.
    """
    torch_device, torch_dtype = default_device_dtype(device, dtype)
    if name_or_spec == "tiny":
        pair = tiny_pair(torch_device, torch_dtype)
    else:
        target_id, draft_id = pair_model_ids(name_or_spec)
        tokenizer = AutoTokenizer.from_pretrained(target_id)
        check_tokenizers(tokenizer, AutoTokenizer.from_pretrained(draft_id))
        target = load_model(target_id, torch_device, torch_dtype)
        draft = load_model(draft_id, torch_device, torch_dtype)
        pair = ModelPair(name_or_spec, target, draft, tokenizer, torch_device, torch_dtype,
                         eos_ids(tokenizer, target))
    if draft_int8:
        if torch_device.type != "cpu":
            raise PairError("draft_int8 is a CPU option (dynamic int8 quantization); on GPUs use bf16")
        from sidecar.cpu_kernels import quantize_int8

        pair.draft = quantize_int8(pair.draft)
    if fast_cpu_kernels and torch_device.type == "cpu" and torch_dtype == torch.float32:
        from sidecar.cpu_kernels import use_onednn_linear

        use_onednn_linear(pair.target)
        use_onednn_linear(pair.draft)
    return pair


# -- the tiny pair: random models from a config, sharing a small BPE tokenizer trained on the fly --

_TINY_CORPUS = (
    "The city council approved a new budget on Tuesday after a long debate about schools, roads and "
    "public health. Officials said the plan would add jobs at the plant in the north of the state. "
    "Summarize the document in 3 bullets. Keep each bullet under 18 words. Then output 3-5 short "
    "hashtags for the summary. #news #politics #economy #health #climate #sports #technology "
    "You are a concise assistant. The president met leaders in Berlin, Moscow, Beijing and Doha. "
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory. "
)


@cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(vocab_size: int, layers: int, hidden: int, seed_scale: float = 0.3) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        initializer_range=seed_scale, tie_word_embeddings=False, attn_implementation=GROUPED_SDPA,
    )


def tiny_models(vocab_size: int, draft_vocab_size: int | None = None, draft_noise: float = 0.01,
                seed: int = 0) -> tuple[PreTrainedModel, PreTrainedModel]:
    """A random target and a draft that is the target plus noise, so acceptance is neither 0 nor 1.

    The large initializer range makes next-token distributions peaked, so greedy argmax is far from
    ties and batched/unbatched float differences cannot flip it.
    """
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(tiny_config(vocab_size, layers=2, hidden=64)).eval()
    draft = Qwen2ForCausalLM(tiny_config(draft_vocab_size or vocab_size, layers=2, hidden=64)).eval()
    with torch.no_grad():
        for t_param, d_param in zip(target.parameters(), draft.parameters(), strict=True):
            if t_param.shape == d_param.shape:
                d_param.copy_(t_param + draft_noise * t_param.std() * torch.randn_like(t_param))
            else:  # embedding rows differ when vocab sizes differ: share the common rows
                rows = min(t_param.shape[0], d_param.shape[0])
                d_param[:rows].copy_(t_param[:rows])
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
    return target, draft


def tiny_pair(device: torch.device | None = None, dtype: torch.dtype = torch.float32, draft_noise: float = 0.01,
              draft_extra_vocab: int = 0, seed: int = 0) -> ModelPair:
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    target, draft = tiny_models(vocab + 16, vocab + draft_extra_vocab, draft_noise=draft_noise, seed=seed)
    device = device or torch.device("cpu")
    target.to(device=device, dtype=dtype)
    draft.to(device=device, dtype=dtype)
    pair = ModelPair("tiny", target, draft, tokenizer, device, dtype, eos_ids(tokenizer, target))
    return pair

