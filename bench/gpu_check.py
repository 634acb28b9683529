"""One prepared GPU check: identity, synchronisations, SDPA kernels, peak memory and tokens/s, within a deadline.

    python -m bench.gpu_check                                 # `make gpu-check`: on a GPU, bf16, at most 8 minutes
    python -m bench.gpu_check --pair tiny --device cpu --quick    # the same code path on the tiny random pair

For each pair (default: ``qwen-coder-small`` and ``qwen2.5-7b``, those on disk; nothing is fetched, and with
neither on disk the tiny pair runs and the report says so) it runs these parts, in this order:

1. identity: the engine's greedy output at one batch against HF ``generate`` on the target alone, one prompt
   at a time. bf16 rounding differs between batch shapes, so a near-tie can flip: every divergence is listed
   with its position and the target's top-2 logit gap there, and the match rate is what it is.
2. syncs (CUDA): device-to-host synchronisations of one decode, counted from the warnings of
   ``torch.cuda.set_sync_debug_mode("warn")`` plus explicit ``torch.cuda.synchronize`` calls, per target
   forward and by source line, next to HF generate's per step.
3. sdpa: the attention kernels one engine decode runs (profiler), and which SDPA backends alone can run it.
4. memory (CUDA): ``torch.cuda.max_memory_allocated`` of the engine and of HF generate at the largest batch.
5. throughput: tokens/s of HF plain (batched), HF assisted (``assistant_model=``, batch 1 only) and the
   engine under each of ``ENGINE_SCHEDULES`` at each batch size.

A global deadline (``--budget-s``) bounds the whole check: each pair gets an equal share of what is left, each
part a share of its pair's time, and a measurement that would not end in time is skipped and says so. A
measurement in progress is never interrupted, so the check can overrun by at most one of them.
Prompts are real news articles when data/news.parquet exists (``make corpus``), else built-in texts.
Writes bench/results/gpu_check.json and .md (other devices, pairs and sizes get suffixed names).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import (
    NEWS,
    REPO,
    Stopwatch,
    add_profile_arguments,
    apply_profile,
    environment,
    markdown_table,
    news_documents,
    profile_suffix,
    write_results,
)
from bench.engine import hf_assisted_one, hf_plain_batched, hf_plain_one
from sidecar.engine import SidecarEngine, SidecarRequest
from sidecar.fetch import is_fetched
from sidecar.models import NAMED_PAIRS, ModelPair, default_device_dtype, load_pair, pair_model_ids, tiny_pair
from sidecar.speculative import GenerationOutput, SpeculativeDecoder

DEFAULT_PAIRS = ("qwen-coder-small", "qwen2.5-7b")
SYNC_WARNING = "synchronizing CUDA operation"  # what set_sync_debug_mode("warn") says at each sync
NO_CUDA = "skipped: no CUDA"

SIZES = {
    "quick": {"identity_prompts": 2, "batches": "1,2", "max_new_tokens": 8, "chars": 400, "assisted_documents": 1,
              "sync_batches": "1,2"},
    "standard": {"identity_prompts": 8, "batches": "1,8,32,64", "max_new_tokens": 64, "chars": 1500,
                 "assisted_documents": 4, "sync_batches": "1,8,32"},
    "full": {"identity_prompts": 16, "batches": "1,8,32,64,128", "max_new_tokens": 128, "chars": 1500,
             "assisted_documents": 8, "sync_batches": "1,8,32,64"},
}

# Used when data/news.parquet is absent (a lent GPU machine has no network to build it): short news-style
# texts written for this check, cycled when a batch needs more prompts than there are texts.
BUILTIN_TEXTS = (
    "The regional water authority said on Monday that reservoir levels had fallen to 41 percent, the lowest "
    "autumn reading in twelve years, and asked households in three districts to cut use by a fifth. Farmers "
    "in the valley, who draw on the same supply for irrigation, warned that a second dry winter would force "
    "them to leave fields fallow. The authority plans to open an emergency pipeline from the northern lake by "
    "March, at a cost of 180 million, and will review prices for heavy users next month.",
    "A court in the capital on Thursday ordered the release of two journalists held for six weeks without "
    "charge, after their lawyers argued that the detention breached the constitution. The interior ministry "
    "said it would appeal. The reporters had been covering protests over fuel prices, which have doubled "
    "since the government ended subsidies in the spring. Press freedom groups welcomed the ruling but said "
    "at least nine other reporters remain in custody across the country.",
    "Shares in the country's largest carmaker rose 7 percent after it reported quarterly profit well above "
    "forecasts, helped by strong sales of its electric models in Europe and a weaker currency. The company "
    "said it would build a battery plant near the port city, creating about 2,400 jobs, and raised its "
    "outlook for the full year. Analysts cautioned that new tariffs discussed in Washington could hurt "
    "exports, which make up almost half of its revenue.",
    "Health officials confirmed 312 new cases of measles in the past month, most of them in children under "
    "five who had not been vaccinated. The ministry will send mobile clinics to rural areas where coverage "
    "has dropped below 70 percent and extend opening hours at city hospitals. Doctors said rumours spread on "
    "social media had kept many parents away. The outbreak began in a border town in August and has reached "
    "eleven provinces.",
    "The national football team qualified for the World Cup for the first time in 24 years after a 2-1 win "
    "away from home on Tuesday night. The winning goal came in the 88th minute from a substitute who plays "
    "in the country's second division. Thousands of fans gathered in the main square of the capital to "
    "celebrate, and the president declared Wednesday a public holiday. The coach, appointed only in January, "
    "dedicated the result to the players' families.",
    "Scientists at the university's marine institute said a heatwave in the bay this summer killed about a "
    "third of its seagrass, which shelters young fish and stores carbon. Water temperatures stayed above 28 "
    "degrees for five weeks. The team will replant test plots with seeds collected from cooler waters to see "
    "whether they survive better. Local fishing cooperatives, which have reported smaller catches of "
    "shrimp, are helping to fund the work.",
)


# -- the deadline --

@dataclass
class Deadline:
    """A point in time (``time.monotonic``) that work must end by."""

    end: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.end - time.monotonic()

    def share(self, fraction: float) -> Deadline:
        """A deadline ``fraction`` of the time left from now, never later than this one."""
        return Deadline(time.monotonic() + max(self.left(), 0.0) * fraction)

    def skip_reason(self, estimate_s: float = 0.0) -> str | None:
        """Why work that takes about ``estimate_s`` should not start, or None when it fits."""
        left = self.left()
        if left <= 0:
            return "skipped: deadline reached"
        if estimate_s > left:
            return f"skipped: ~{estimate_s:.0f} s estimated, {left:.0f} s left before the deadline"
        return None


# -- pairs and prompts --

def local_model_dir(model_id: str) -> Path | None:
    """A local directory with ``model_id``'s config and every weight file, or None: a path, or a complete
    snapshot in the Hugging Face cache (looked up offline)."""
    path = Path(model_id)
    if not path.is_dir():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            path = Path(snapshot_download(model_id, local_files_only=True))
        except (LocalEntryNotFoundError, ValueError, OSError):
            return None
    index = path / "model.safetensors.index.json"
    if index.exists():
        import json

        shards = set(json.loads(index.read_text())["weight_map"].values())
        weights = all((path / s).exists() for s in shards)
    else:
        weights = any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").exists()
    return path if (path / "config.json").exists() and weights else None


def resolve_pair(name: str) -> tuple[str | None, str]:
    """(what ``load_pair`` should load, None when absent; why absent or where it is) for a pair name or spec."""
    if name == "tiny":
        return "tiny", "random tiny pair, built in memory"
    if name == "qwen-coder-small" and not is_fetched(name):
        return None, "not fetched: `sidecar models fetch --pair qwen-coder-small` (needs network) first"
    ids = pair_model_ids(name)
    dirs = [local_model_dir(i) for i in ids]
    missing = [i for i, d in zip(ids, dirs, strict=True) if d is None]
    if missing:
        return None, f"not on disk: {', '.join(missing)} (nothing is fetched here; download them into the " \
                     "Hugging Face cache first)"
    return f"{dirs[0]},{dirs[1]}", f"{dirs[0]} and {dirs[1]}"


def load_check_pair(name: str, spec: str, device: str, dtype: torch.dtype) -> ModelPair:
    if spec == "tiny":
        # a draft with the target's vocabulary size, so that HF assisted generation accepts the pair
        torch_device, torch_dtype = default_device_dtype(device, dtype)
        return tiny_pair(torch_device, torch_dtype, draft_extra_vocab=16)
    pair = load_pair(spec, device=device, dtype=dtype)
    pair.name = name
    return pair


def documents(count: int, chars: int) -> tuple[list[str], str]:
    """``count`` documents cut to ``chars`` and where they come from."""
    if NEWS.exists():
        found = news_documents(count, chars)
        source = f"real news articles ({NEWS.relative_to(REPO)})"
    else:
        found, source = [], "built-in texts (data/news.parquet absent)"
    found = found or list(BUILTIN_TEXTS)
    return [found[i % len(found)][:chars] for i in range(count)], source


# -- small measurements --

def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """The first position where the token lists differ (a length difference counts), None when equal."""
    for position, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return position
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def top2_gap(pair: ModelPair, context: list[int], tokens: list[int | None]) -> dict:
    """The target's next-token logits after ``context``, from one forward at batch 1: the top-1 minus top-2
    logit gap, and each of ``tokens``' rank there (0: the argmax)."""
    with torch.inference_mode():
        logits = pair.target(torch.tensor([context], device=pair.device)).logits[0, -1].float()
    top = logits.topk(2)
    ranks = [None if t is None else int((logits > logits[t]).sum()) for t in tokens]
    return {"top2_gap": float(top.values[0] - top.values[1]), "ranks": ranks}


def source_line(filename: str, lineno: int) -> str:
    path = Path(filename)
    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else "/".join(path.parts[-2:])
    return f"{where}:{lineno}"


class SyncCounter:
    """Counts device-to-host synchronisations inside ``with``, per source line: the implicit ones (``.item()``,
    ``.tolist()``, ``int(tensor)``...) from ``torch.cuda.set_sync_debug_mode("warn")``'s warnings, and explicit
    ``torch.cuda.synchronize()`` calls, which that mode does not report, at the line that asked for them (not in
    a ``synchronize`` helper). The stopwatches of bench/ are left out."""

    def __enter__(self) -> SyncCounter:
        self.sites: Counter = Counter()
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")  # the same line warns every time, not once
        self._synchronize = torch.cuda.synchronize

        def counted(*args, **kwargs):
            caller = sys._getframe(1)
            while caller.f_back is not None and caller.f_code.co_name == "synchronize":  # helpers that wrap it
                caller = caller.f_back
            where = source_line(caller.f_code.co_filename, caller.f_lineno)
            if not where.startswith("bench/"):  # the check's own stopwatches are not the code measured
                self.sites[where + " synchronize()"] += 1
            return self._synchronize(*args, **kwargs)

        torch.cuda.synchronize = counted
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize = self._synchronize
        self._warnings.__exit__(*exc)
        for w in self._caught:
            if SYNC_WARNING in str(w.message):
                self.sites[source_line(w.filename, w.lineno)] += 1
            else:  # not ours to swallow
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    @property
    def count(self) -> int:
        return sum(self.sites.values())


def static_batches(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new: int,
                   batch: int) -> list[GenerationOutput]:
    """Today's schedule: fixed chunks of ``batch`` prompts, each decoded until its last row finishes."""
    return decoder.generate(prompts, max_new_tokens=max_new, batch_size=batch)


# How the engine is fed prompts; the throughput part times every entry at every batch size.
EngineSchedule = Callable[[SpeculativeDecoder, list[list[int]], int, int], list[GenerationOutput]]
ENGINE_SCHEDULES: dict[str, EngineSchedule] = {"static": static_batches}


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


# -- the parts --

def identity(check: Check, deadline: Deadline) -> dict:
    prompts = check.prompts[: check.args.identity_prompts]
    references = []
    for prompt in prompts:
        if reason := deadline.skip_reason():
            return {"skipped": f"{reason} after {len(references)} of {len(prompts)} HF reference runs"}
        references.append(hf_plain_one(check.pair, prompt, check.args.max_new_tokens)["tokens"])
    if reason := deadline.skip_reason():
        return {"skipped": reason}
    outs = check.decoder.generate(prompts, max_new_tokens=check.args.max_new_tokens, batch_size=len(prompts))
    rows, matched, total = [], 0, 0
    for i, (prompt, reference, out) in enumerate(zip(prompts, references, outs, strict=True)):
        position = first_divergence(reference, out.token_ids)
        total += len(reference)
        matched += len(reference) if position is None else position
        row = {"prompt": i, "prompt_tokens": len(prompt), "hf_tokens": len(reference),
               "engine_tokens": len(out.token_ids), "identical": position is None}
        if position is not None:
            hf_token = reference[position] if position < len(reference) else None
            engine_token = out.token_ids[position] if position < len(out.token_ids) else None
            gap = top2_gap(check.pair, prompt + reference[:position], [hf_token, engine_token])
            row |= {"position": position, "hf_token": hf_token, "engine_token": engine_token,
                    "top2_gap": gap["top2_gap"], "hf_token_rank": gap["ranks"][0],
                    "engine_token_rank": gap["ranks"][1]}
        rows.append(row)
    return {"batch": len(prompts), "rows_identical": sum(r["identical"] for r in rows), "rows": len(rows),
            "match_rate": sum(r["identical"] for r in rows) / len(rows),
            "tokens_before_divergence": matched / total if total else 1.0,
            "divergences": [r for r in rows if not r["identical"]], "per_row": rows}


def syncs(check: Check, deadline: Deadline) -> dict:
    if not check.cuda:
        return {"skipped": NO_CUDA}
    batches = [int(b) for b in check.args.sync_batches.split(",") if b]
    runs = []
    for batch in batches:
        if reason := deadline.skip_reason():
            runs.append({"batch": batch, "skipped": reason})
            continue
        prompts = check.prompts[:batch]
        with SyncCounter() as engine:
            outs = check.decoder.generate(prompts, max_new_tokens=check.args.max_new_tokens, batch_size=batch)
        with SyncCounter() as hf:
            rows = hf_plain_batched(check.pair, prompts, check.args.max_new_tokens)["tokens"]
        target = max(o.stats.target_forwards for o in outs)  # rows share forwards: the longest row saw all
        draft = max(o.stats.draft_forwards for o in outs)
        hf_steps = max(map(len, rows))
        runs.append({"batch": batch, "syncs": engine.count, "target_forwards": target, "draft_forwards": draft,
                     "syncs_per_target_forward": engine.count / target,
                     # the goal: one per target forward plus one per draft forward, whatever the batch
                     "within_budget": engine.count <= target + draft,
                     "top_sites": dict(engine.sites.most_common(8)),
                     "hf_plain_syncs": hf.count, "hf_plain_steps": hf_steps,
                     "hf_plain_syncs_per_step": hf.count / hf_steps})
    return {"runs": runs}


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


def memory(check: Check, deadline: Deadline) -> dict:
    if not check.cuda:
        return {"skipped": NO_CUDA}
    batch = max(int(b) for b in check.args.batches.split(","))
    prompts = check.prompts[:batch]
    weights = torch.cuda.memory_allocated(check.pair.device) / 2**30
    result = {"batch": batch, "max_new_tokens": check.args.max_new_tokens, "weights_gb": weights}
    for name, run in (("engine_static", lambda: check.timed_engine(prompts, batch)),
                      ("hf_plain", lambda: check.timed_hf_plain(prompts))):
        if reason := deadline.skip_reason():
            result[name] = reason
            continue
        try:
            result[f"{name}_peak_gb"] = run()["peak_gb"]
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            result[name] = f"out of memory: {str(exc).splitlines()[0][:160]}"
    return result


def throughput(check: Check, deadline: Deadline) -> dict:
    batches = [int(b) for b in check.args.batches.split(",") if b]
    last: dict[str, tuple[int, float]] = {}  # method -> (batch, seconds) of its latest run

    def skip(method: str, batch: int) -> str | None:
        # a run's time grows at most linearly with its batch: the latest smaller run bounds the next
        estimate = last[method][1] * batch / last[method][0] if method in last else 0.0
        return deadline.skip_reason(estimate)

    # HF assisted generation takes one prompt at a time, so it has a batch-1 figure only; it runs first, so that
    # a large batch that uses up the time leaves the batch-1 comparison whole
    assisted: dict = {"documents": 0, "tokens": 0, "seconds": 0.0}
    for prompt in check.prompts[: check.args.assisted_documents]:
        estimate = assisted["seconds"] / assisted["documents"] if assisted["documents"] else 0.0
        if reason := deadline.skip_reason(estimate):
            assisted["stopped"] = reason
            break
        run = hf_assisted_one(check.pair, prompt, check.args.max_new_tokens, check.decoder.gamma)
        assisted["documents"] += 1
        assisted["tokens"] += len(run["tokens"])
        assisted["seconds"] += run["wall_s"]
    if assisted["documents"]:
        assisted["tps"] = assisted["tokens"] / assisted["seconds"]
    rows = []
    for batch in batches:
        prompts = check.prompts[:batch]
        row: dict = {"batch": batch}
        if batch == 1 and "tps" in assisted:
            row["hf_assisted_tps"] = assisted["tps"]
        if reason := skip("hf_plain", batch):
            row["hf_plain"] = reason
            hf = None
        else:
            hf = check.timed_hf_plain(prompts)
            last["hf_plain"] = (batch, hf["seconds"])
            row |= {"hf_plain_tps": hf["tokens"] / hf["seconds"], "hf_plain_peak_gb": hf["peak_gb"]}
        for schedule in ENGINE_SCHEDULES:
            key = f"engine_{schedule}"
            if reason := skip(key, batch):
                row[key] = reason
                continue
            run = check.timed_engine(prompts, batch, schedule)
            last[key] = (batch, run["seconds"])
            row |= {f"{key}_tps": run["tokens"] / run["seconds"], f"{key}_peak_gb": run["peak_gb"]}
            if hf is not None:
                row[f"{key}_vs_hf_plain"] = row[f"{key}_tps"] / row["hf_plain_tps"]
                # bf16 batched HF and the engine may break near-ties differently; the identity part says where
                row[f"{key}_rows_identical_to_hf_plain"] = sum(
                    o.token_ids == h for o, h in zip(run["outs"], hf["rows"], strict=True))
        rows.append(row)
    return {"rows": rows, "hf_assisted_one_at_a_time": assisted, "schedules": list(ENGINE_SCHEDULES)}


# (name, function, share of the pair's time left when the part starts)
PARTS: list[tuple[str, Callable[[Check, Deadline], dict], float]] = [
    ("identity", identity, 0.2),
    ("syncs", syncs, 0.1),
    ("sdpa", sdpa, 0.1),
    ("memory", memory, 0.15),
    ("throughput", throughput, 1.0),
]


def failure(exc: BaseException) -> str:
    """The exception in one line, with the innermost line of this repository it passed through."""
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).is_relative_to(REPO)]
    where = f" (at {source_line(ours[-1].filename, ours[-1].lineno)})" if ours else ""
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}{where}"


def prepare(name: str, spec: str, args: argparse.Namespace) -> tuple[Check, dict]:
    """Load the pair, build its prompts and warm it up; the report's header for the pair."""
    began = time.monotonic()
    pair = load_check_pair(name, spec, args.device, args.dtype)
    loaded = time.monotonic() - began
    engine = SidecarEngine(pair)
    texts, source = documents(max(args.identity_prompts, args.assisted_documents,
                                  *(int(b) for b in args.batches.split(",")),
                                  *(int(b) for b in args.sync_batches.split(","))), args.chars)
    prompts = [engine.prompts(SidecarRequest(t))[0].token_ids for t in texts]
    check = Check(pair, prompts, SpeculativeDecoder(pair, gamma=args.gamma), args)
    # first calls pay one-off allocation and kernel selection costs
    warm = prompts[0][:64]
    hf_plain_one(pair, warm, 4)
    check.decoder.generate([warm, warm], max_new_tokens=4, batch_size=2)
    return check, {"pair": name, "loaded_from": spec, "load_s": loaded, "device": str(pair.device),
                   "dtype": str(pair.dtype).replace("torch.", ""), "prompts": source,
                   "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts)}


def check_pair(name: str, spec: str, args: argparse.Namespace, deadline: Deadline) -> dict:
    try:
        check, result = prepare(name, spec, args)
    except Exception as exc:  # reported, and fails the check; the next pair still runs
        return {"pair": name, "loaded_from": spec, "error": failure(exc)}
    for part, run, share in PARTS:
        if reason := deadline.skip_reason():
            result[part] = {"skipped": reason}
            continue
        began = time.monotonic()
        try:
            result[part] = run(check, deadline.share(share))
        except Exception as exc:  # one failing part must not cost the others: it is reported, and fails the check
            result[part] = {"error": failure(exc)}
            if check.cuda:
                torch.cuda.empty_cache()
        result[part]["seconds"] = time.monotonic() - began
        print(f"{name} {part}: {result[part]}", flush=True)
    del check
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# -- the report --

def identity_markdown(ident: dict, r: dict) -> str:
    lines = [f"Identity (engine at batch {ident['batch']} vs HF `generate` on the target alone, batch 1, greedy): "
             f"{ident['rows_identical']}/{ident['rows']} rows identical, {ident['tokens_before_divergence']:.1%} of "
             f"reference tokens before the first divergence. Reduced precision rounds differently at different "
             f"batch shapes, so where the target's top-2 gap is small a flip is rounding, not a bug; a large gap "
             f"would be one."]
    if ident["divergences"]:
        lines.append("\n" + markdown_table(ident["divergences"], [
            ("prompt", "prompt"), ("position", "first divergence"), ("hf_token", "HF token"),
            ("engine_token", "engine token"), ("top2_gap", "target top-2 logit gap"),
            ("engine_token_rank", "engine token's rank")]))
    return "\n".join(lines)


def syncs_markdown(result: dict, r: dict) -> str:
    runs = [x | {"where": ", ".join(f"{k} ×{v}" for k, v in list(x.get("top_sites", {}).items())[:3])}
            for x in result["runs"]]
    return ("Device-to-host synchronisations of one decode (`torch.cuda.set_sync_debug_mode(\"warn\")` and "
            "`torch.cuda.synchronize` calls), budget: one per target forward plus one per draft forward:\n\n"
            + markdown_table(runs, [
                ("batch", "batch"), ("syncs", "syncs"), ("target_forwards", "target forwards"),
                ("draft_forwards", "draft forwards"), ("syncs_per_target_forward", "per target forward"),
                ("within_budget", "within budget"), ("hf_plain_syncs_per_step", "HF plain per step"),
                ("where", "top sources"), *([("skipped", "skipped")] if any("skipped" in x for x in runs) else [])]))


def sdpa_markdown(s: dict, r: dict) -> str:
    ops = ", ".join(f"`{k}` ×{v}" for k, v in s["aten_ops"].items()) or "none seen"
    kernels = ", ".join(f"`{k}`" for k in s["cuda_kernels"]) or "–"
    alone = "; ".join(f"{k}: {v}" for k, v in s["backends_alone"].items())
    return f"SDPA ({s['attn_implementation']}): ops {ops}; attention kernels {kernels}. Each backend alone: {alone}."


def memory_markdown(m: dict, r: dict) -> str:
    def gb(key: str) -> str:
        return f"{m[key]:.1f} GB" if key in m else m.get(key.removesuffix("_peak_gb"), "–")

    return (f"Peak memory at batch {m['batch']} ({m['max_new_tokens']} new tokens, `torch.cuda.max_memory_allocated`): "
            f"engine {gb('engine_static_peak_gb')}, HF plain {gb('hf_plain_peak_gb')}; weights "
            f"{m['weights_gb']:.1f} GB.")


def throughput_markdown(t: dict, r: dict) -> str:
    columns = [("batch", "batch"), ("hf_plain_tps", "HF plain tok/s"), ("hf_assisted_tps", "HF assisted tok/s")]
    for schedule in t["schedules"]:
        key = f"engine_{schedule}"
        columns += [(f"{key}_tps", f"engine {schedule} tok/s"), (f"{key}_vs_hf_plain", "vs HF plain"),
                    (f"{key}_rows_identical_to_hf_plain", "rows = HF plain"),
                    *([(f"{key}_peak_gb", "peak GB")] if r["device"].startswith("cuda") else [])]
    # the string values of a row are the reasons its measurements were skipped
    notes = [f"{k} at batch {row['batch']}: {v}" for row in t["rows"] for k, v in row.items() if isinstance(v, str)]
    if "stopped" in t["hf_assisted_one_at_a_time"]:
        notes.append(f"HF assisted: {t['hf_assisted_one_at_a_time']['stopped']}")
    text = ("Tokens/s end to end (prefill included); HF assisted runs one prompt at a time, so it has a batch-1 "
            "figure only:\n\n" + markdown_table(t["rows"], columns))
    return text + ("\n\n" + "; ".join(notes) + "." if notes else "")


RENDERERS = {"identity": identity_markdown, "syncs": syncs_markdown, "sdpa": sdpa_markdown,
             "memory": memory_markdown, "throughput": throughput_markdown}


def pair_markdown(r: dict) -> str:
    if "error" in r:
        return f"### `{r['pair']}`\n\nCould not be loaded and warmed up: {r['error']}."
    lines = [f"### `{r['pair']}` ({r['dtype']} on {r['device']}, loaded in {r['load_s']:.0f} s; prompts: "
             f"{r['prompts']}, mean {r['mean_prompt_tokens']:.0f} tokens)"]
    for part, _, _ in PARTS:
        value = r.get(part)
        if value is None:
            continue
        if "skipped" in value or "error" in value:
            lines.append(f"\n{part}: {value.get('skipped') or 'error: ' + value['error']}.")
        elif part in RENDERERS:
            lines.append("\n" + RENDERERS[part](value, r))
    return "\n".join(lines)


def markdown(payload: dict) -> str:
    env = payload["environment"]
    lines = [f"GPU check on {env['device']} ({payload['args']['profile']} sizes, {payload['args']['max_new_tokens']} "
             f"new tokens, budget {payload['args']['budget_s']:.0f} s, took {payload['seconds']:.0f} s)."]
    for name, reason in payload["absent"].items():
        lines.append(f"\n`{name}`: skipped, {reason}.")
    if payload.get("fallback"):
        lines.append(f"\n{payload['fallback']}")
    lines += ["\n" + pair_markdown(r) for r in payload["pairs"]]
    return "\n".join(lines)


def errors(payload: dict) -> list[str]:
    """Every pair that failed to load and every part that raised: what makes the check exit non-zero."""
    return [f"{r['pair']}: {r['error']}" for r in payload["pairs"] if "error" in r] + [
        f"{r['pair']} {part}: {r[part]['error']}" for r in payload["pairs"] for part, _, _ in PARTS
        if "error" in r.get(part, {})]


def result_file_name(args: argparse.Namespace, device: torch.device, default_pairs: bool) -> str:
    """gpu_check on a GPU with the default pairs at standard sizes; gpu_check_cpu_tiny_quick and so on otherwise."""
    name = "gpu_check" + ("" if device.type == "cuda" else f"_{device.type}")
    if not default_pairs:
        name += "_" + re.sub(r"[^A-Za-z0-9]+", "-", "+".join(args.pair)).strip("-")[:40]
    return name + profile_suffix(args.profile)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", action="append",
                        help="a pair to check (repeatable): tiny, qwen-coder-small, "
                             f"{', '.join(NAMED_PAIRS)} or TARGET,DRAFT; default: {', '.join(DEFAULT_PAIRS)} where "
                             "on disk, else the tiny pair")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--budget-s", type=float, default=480.0, help="global deadline in seconds (default 8 min)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--identity-prompts", type=int)
    parser.add_argument("--batches", help="comma-separated batch sizes for throughput; the largest for memory")
    parser.add_argument("--sync-batches", help="comma-separated batch sizes for the sync count")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--chars", type=int, help="cut each document to this many characters")
    parser.add_argument("--assisted-documents", type=int, help="prompts HF assisted generation decodes, one by one")
    add_profile_arguments(parser)
    args = parser.parse_args(argv)
    apply_profile(args, SIZES)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a lent GPU machine has no network: use what is on disk
    started = time.monotonic()
    deadline = Deadline.after(args.budget_s)
    device, dtype = default_device_dtype(args.device, args.dtype)
    args.device, args.dtype = str(device), dtype
    default_pairs = args.pair is None
    names = list(DEFAULT_PAIRS) if default_pairs else args.pair
    resolved = {name: resolve_pair(name) for name in names}
    present = [(name, spec) for name, (spec, _) in resolved.items() if spec is not None]
    absent = {name: where for name, (spec, where) in resolved.items() if spec is None}
    fallback = None
    if default_pairs and not present:
        present = [("tiny", "tiny")]
        fallback = ("No real pair is on disk, so the tiny random pair ran instead: its identity, syncs and code "
                    "paths are real, its speeds and kernel choices (at its tiny shapes) say nothing about real models.")
    pairs = []
    for i, (name, spec) in enumerate(present):
        if reason := deadline.skip_reason():
            absent[name] = reason.removeprefix("skipped: ")
            continue
        # each pair gets an equal share of what is left; what one leaves unused goes to the next
        pairs.append(check_pair(name, spec, args, deadline.share(1 / (len(present) - i))))
    payload = {"environment": environment(device, dtype),
               "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(args).items()},
               "absent": absent, "fallback": fallback, "pairs": pairs, "seconds": time.monotonic() - started}
    write_results(result_file_name(args, device, default_pairs), payload, markdown(payload))
    return payload


if __name__ == "__main__":
    failures = errors(main())
    if failures:
        sys.exit("gpu check parts failed: " + "; ".join(failures))
