"""Hugging Face ``generate`` baselines the benchmarks compare the engine with: plain, assisted and prompt
lookup, timed on the pair's loaded models. Needs only torch and transformers (the GPU check runs them on a
stock image)."""

from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from bench.common import Stopwatch
from sidecar.models.pair import ModelPair


class FirstTokenClock(BaseStreamer):
    """Timestamps when HF generate emits its first new token, i.e. when its prefill ends."""

    def __init__(self) -> None:
        self.calls, self.first_token_at = 0, 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first put is the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def new_tokens_until_eos(row: list[int], eos: set[int], pad: int | None) -> list[int]:
    out = []
    for token in row:
        out.append(token)
        if token in eos:
            break
    return out


def hf_plain_one(pair: ModelPair, prompt: list[int], max_new: int) -> dict:
    clock = FirstTokenClock()
    with torch.inference_mode(), Stopwatch(pair.device) as sw:
        start = time.perf_counter()
        out = pair.target.generate(torch.tensor([prompt], device=pair.device), max_new_tokens=max_new,
                                   do_sample=False, eos_token_id=pair.eos_token_ids, streamer=clock)
    tokens = out[0, len(prompt):].tolist()
    prefill = clock.first_token_at - start
    return {"tokens": tokens, "wall_s": sw.seconds, "prefill_s": prefill, "decode_s": sw.seconds - prefill}


def hf_speculative_one(pair: ModelPair, prompt: list[int], max_new: int, **speculation) -> dict:
    """HF generate with its own speculation: a draft model (assisted) or n-grams of the prompt (lookup)."""
    with torch.inference_mode(), Stopwatch(pair.device) as sw:
        out = pair.target.generate(torch.tensor([prompt], device=pair.device), max_new_tokens=max_new,
                                   do_sample=False, eos_token_id=pair.eos_token_ids, **speculation)
    return {"tokens": out[0, len(prompt):].tolist(), "wall_s": sw.seconds}


def hf_assisted_one(pair: ModelPair, prompt: list[int], max_new: int, gamma: int) -> dict:
    """HF assisted generation with the pair's draft proposing a constant ``gamma`` tokens per step."""
    return hf_speculative_one(pair, prompt, max_new, assistant_model=pair.draft, num_assistant_tokens=gamma,
                              num_assistant_tokens_schedule="constant")


def hf_plain_batched(pair: ModelPair, prompts: list[list[int]], max_new: int) -> dict:
    width = max(map(len, prompts))
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else pair.eos_token_ids[0]
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF decoder-only batching requires
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode(), Stopwatch(pair.device) as sw:
        out = pair.target.generate(ids.to(pair.device), attention_mask=mask.to(pair.device), max_new_tokens=max_new,
                                   do_sample=False, eos_token_id=pair.eos_token_ids, pad_token_id=pad)
    eos = set(pair.eos_token_ids)
    rows = [new_tokens_until_eos(r, eos, pad) for r in out[:, width:].tolist()]
    return {"tokens": rows, "wall_s": sw.seconds}
