"""Loading draft/target pairs: named offline pairs, hub ids or paths, and the tiny random pair for tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from sidecar.errors import PairError
from sidecar.models.attention import GROUPED_SDPA
from sidecar.models.default_dtype import device_default_dtype
from sidecar.models.dtype_choice import DTYPES, choose_dtype, packs, parse_dtype
from sidecar.models.pair import ModelPair, check_tokenizers, dtype_name, eos_ids

# a pair's names and its tokenizer have modules of their own, without torch; their callers also find them here
from sidecar.models.pair_names import NAMED_PAIRS as NAMED_PAIRS
from sidecar.models.pair_names import pair_model_ids as pair_model_ids
from sidecar.models.pair_tokenizer import load_tokenizer as load_tokenizer
from sidecar.models.tiny import tiny_pair
from sidecar.models.tiny_config import TINY_SHAPE
from sidecar.settings import Settings, parse_capture


def default_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def default_device_dtype(device: str | None, dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """The device (default: CUDA if present) and ``dtype``, else the device's default without timing anything
    or reading ``SIDECAR_DTYPE``: bf16 on CUDA (what ``load_pair`` gives there too), fp32 elsewhere. For
    callers that load no pair; ``load_pair`` chooses with ``sidecar.models.dtype_choice``."""
    resolved = default_device(device)
    if isinstance(dtype, str):
        return resolved, parse_dtype(dtype, "the dtype argument")
    return resolved, dtype or DTYPES[device_default_dtype(resolved.type)[0]]


def target_shape(name_or_spec: str) -> tuple[int, int]:
    """(hidden size, intermediate size) of the pair's target, read from its config."""
    if name_or_spec == "tiny":
        return TINY_SHAPE
    config = AutoConfig.from_pretrained(pair_model_ids(name_or_spec)[0])
    return config.hidden_size, config.intermediate_size


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=GROUPED_SDPA)
    return model.to(device).eval()


def load_pair(name_or_spec: str = "qwen-coder-small", device: str | None = None,
              dtype: str | torch.dtype | None = None, fast_cpu_kernels: bool = True,
              draft_int8: bool = False, capture: str | None = None) -> ModelPair:
    """Load a named pair (``qwen-coder-small``, ``qwen2.5-7b``, ``tiny``) or ``TARGET,DRAFT`` ids/paths.

    ``draft_int8`` quantizes the draft's Linear layers to int8 (CPU only). The target verifies every
    token, so output stays exactly the target's; only acceptance, and what the draft writes alone in
    sidecar tasks, can change. ``capture`` (auto, eager, compile, cudagraph, hf; default ``SIDECAR_CAPTURE``,
    else auto) is how a ``SpeculativeDecoder`` over the pair runs its forwards (``sidecar.runtime.capture``).
    """
    capture = parse_capture(capture, "the capture argument")
    torch_device = default_device(device)
    shape = target_shape(name_or_spec)
    choice = choose_dtype(torch_device, dtype, *shape)
    torch_dtype = choice.dtype
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
    pair.dtype_reason = choice.reason
    pair.capture = capture
    if draft_int8:
        if torch_device.type != "cpu":
            raise PairError("draft_int8 is a CPU option (dynamic int8 quantization); on GPUs use bf16")
        if torch_dtype != torch.float32:
            raise PairError(f"draft_int8 needs fp32 (torch's dynamic int8 Linear takes float32 activations); the "
                            f"pair loads in {dtype_name(torch_dtype)} ({choice.reason}): pass dtype='fp32'")
        from sidecar.models.cpu_kernels import quantize_int8

        pair.draft = quantize_int8(pair.draft)
    # inductor lowers each Linear itself and refuses a weight oneDNN already packed (its lowering wants a frozen
    # constant): a pair asked to compile keeps plain Linear layers; auto keeps packed ones eager without timing
    # (``sidecar.decoding.decoder.use_capture``, which unpacks them if compile is asked for later)
    compiles = (capture or Settings().capture) == "compile"
    if (fast_cpu_kernels and torch_device.type == "cpu" and not compiles
            and packs(torch_dtype, *shape)):
        from sidecar.models.cpu_kernels import use_onednn_linear

        use_onednn_linear(pair.target)
        use_onednn_linear(pair.draft)
    return pair
