"""One pair loaded, prompted and warmed up (``Check``): what every part measures, and ``prepare``, which builds it.

``Check`` times the engine and HF generate the same way for every part, with the peak memory of each run on CUDA.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from bench.common import Stopwatch
from bench.gpu_check.pairs import documents, load_check_pair
from bench.gpu_check.schedules import ENGINE_SCHEDULES
from bench.hf_baselines import hf_plain_batched, hf_plain_one
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.models.dtype_choice import choose_dtype
from sidecar.models.loading import target_shape
from sidecar.models.pair import ModelPair, dtype_name
from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION, build_prompt

NO_CUDA = "skipped: no CUDA"  # what a CUDA-only part says on another device


@dataclass
class Check:
    """One loaded pair, its prompts, its engine and the command line's sizes."""

    pair: ModelPair
    prompts: list[list[int]]
    decoder: SpeculativeDecoder
    args: argparse.Namespace

    @property
    def cuda(self) -> bool:
        return self.pair.device.type == "cuda"

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.pair.device)
            torch.cuda.reset_peak_memory_stats(self.pair.device)

    def peak_gb(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.pair.device) / 2**30 if self.cuda else None

    def timed_engine(self, prompts: list[list[int]], batch: int, schedule: str = "static") -> dict:
        self.reset_peak()
        with Stopwatch(self.pair.device) as sw:
            outs = ENGINE_SCHEDULES[schedule](self.decoder, prompts, self.args.max_new_tokens, batch)
        return {"outs": outs, "tokens": sum(len(o.token_ids) for o in outs), "seconds": sw.seconds,
                "peak_gb": self.peak_gb()}

    def timed_hf_plain(self, prompts: list[list[int]]) -> dict:
        self.reset_peak()
        hf = hf_plain_batched(self.pair, prompts, self.args.max_new_tokens)
        return {"rows": hf["tokens"], "tokens": sum(map(len, hf["tokens"])), "seconds": hf["wall_s"],
                "peak_gb": self.peak_gb()}


def prepare(name: str, spec: str, args: argparse.Namespace) -> tuple[Check, dict]:
    """Choose the pair's dtype (printed with why), load the pair, build its prompts and warm it up; the report's
    header for the pair."""
    began = time.monotonic()
    choice = choose_dtype(torch.device(args.device), args.dtype, *target_shape(spec))
    print(f"{name}: {dtype_name(choice.dtype)} ({choice.reason})", flush=True)
    pair = load_check_pair(name, spec, args.device, choice.dtype)
    pair.dtype_reason = choice.reason
    loaded = time.monotonic() - began
    texts, source = documents(max(args.identity_prompts, args.assisted_documents,
                                  *(int(b) for b in args.batches.split(",")),
                                  *(int(b) for b in args.sync_batches.split(","))), args.chars)
    # the main output's prompt as the engine builds it (its sidecar tasks are the pipeline's, not the check's)
    prompts = [build_prompt(pair.tokenizer, t, SUMMARIZE_INSTRUCTION, DEFAULT_SYSTEM).token_ids for t in texts]
    check = Check(pair, prompts, SpeculativeDecoder(pair, gamma=args.gamma), args)
    # first calls pay one-off allocation and kernel selection costs
    warm = prompts[0][:64]
    hf_plain_one(pair, warm, 4)
    check.decoder.generate([warm, warm], max_new_tokens=4, batch_size=2)
    return check, {"pair": name, "loaded_from": spec, "load_s": loaded, "device": str(pair.device),
                   "dtype": str(pair.dtype).replace("torch.", ""), "dtype_reason": pair.dtype_reason,
                   "capture": pair.capture_report,
                   "prompts": source,
                   "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts)}
