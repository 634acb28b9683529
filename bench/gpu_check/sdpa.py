"""The sdpa part: the attention kernels one engine decode runs (profiler), and which SDPA backends alone can run it."""

from __future__ import annotations

import re
import warnings

from bench.gpu_check.check import Check
from bench.gpu_check.deadline import Deadline


def sdpa(check: Check, deadline: Deadline) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    prompts, max_new = check.prompts[:2], min(check.args.max_new_tokens, 8)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if check.cuda else [])]
    with profile(activities=activities) as prof:
        check.decoder.generate(prompts, max_new_tokens=max_new, batch_size=len(prompts))
    # the aten op names the backend SDPA dispatched to; the GPU kernel names say the same at the device
    pattern = re.compile(r"flash|fmha|efficient|cudnn|attention|sdpa", re.IGNORECASE)
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")
           or e.key.startswith(("aten::_flash", "aten::_efficient", "aten::_cudnn_attention"))}
    kernels = {}
    if check.cuda:
        kernels = {e.key[:120]: e.count for e in prof.key_averages()
                   if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"
                   and pattern.search(e.key) and not e.key.startswith("aten::")}
    backends = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        if reason := deadline.skip_reason():
            backends[backend.name] = reason
            continue
        # SDPA warns why each backend it was allowed cannot take the inputs, then raises "No available kernel"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    check.decoder.generate(prompts, max_new_tokens=max_new, batch_size=len(prompts))
                backends[backend.name] = "works"
            except RuntimeError as exc:
                why = dict.fromkeys(line[:160] for w in caught for line in str(w.message).strip().splitlines()[:1]
                                    if re.search(r"attention|kernel|sdp|flash|cudnn", line, re.IGNORECASE))
                backends[backend.name] = "fails: " + "; ".join([*why][:3] or [str(exc).strip().splitlines()[0]])
    return {"aten_ops": ops, "cuda_kernels": kernels, "backends_alone": backends,
            "attn_implementation": check.pair.target.config._attn_implementation}
