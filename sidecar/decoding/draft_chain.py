"""A step's draft forwards after its first, as one compiled call (``compile`` and ``cudagraph`` modes).

Forward 0 of a step feeds each draft row its feed (up to several tokens); every later forward is one token wide
per row, fed the token the one before chose. Run one by one, each costs the host a launch (on CUDA graphs one
replay, in eager mode one launch per kernel), and choosing its input from the one before's output is already on
the device. So the chain runs forwards 1 .. n inside one compiled region (``StackRunner.chain``): a loop over
the stack unrolled into the graph, each forward's token fed to the next, the rows' lengths advancing on the
device; the host launches one graph and reads nothing until the step's one read, and commits the cache's host
lengths once, after it.

Each forward chooses its token exactly as ``StepRunner._draft`` does one by one: greedy rows the argmax of the
draft's logits over the target's vocabulary, sampled rows inverse-CDF draws from their warped distribution with
their counter-based uniforms (``sidecar.decoding.randomness``) at the same output positions and purposes
(DRAFT for a main row's proposal, NEXT for a draft-only row's output). The draws are the same numbers, so
seeded sampled rows decode what they decode one forward at a time.

Where a host decision falls between two forwards the chain cannot run, and the step drafts one forward at a
time (``chain_applies``): a constrained draft-only row (its matcher accepts each token and masks the next
forward's logits), a draft-only row asking for logprobs (its logits are kept per forward: a chain returning
them would be a third graph per bucket and length, for a rare request, for warm-up to compile), a sampled
row's nucleus on a CPU (``nucleus_candidates`` checks on the host whether its 512 most likely tokens hold it),
and drafting that stops early by confidence (one read per forward: ``StepPlanner`` turns it off wherever the
draft's forwards are compiled).

A chain's graph is one per batch bucket and length for all-greedy batches and one for batches with sampled rows,
whatever their mix (``chain_flags``); warm-up (``warm_chain``) runs both, so neither compiles mid-run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sidecar.decoding.acceptance import sample_with, warp
from sidecar.decoding.randomness import DRAFT, NEXT, uniforms
from sidecar.decoding.rows import DraftOnlyRow, LiveRow
from sidecar.decoding.sampling import RowSampling
from sidecar.decoding.vocab_align import align_vocab
from sidecar.runtime.capture import ForwardShape, StackRunner
from sidecar.runtime.decoder_stack import LENGTH, VALID, DecoderStack
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.transfers import to_device


def chain_applies(runner: StackRunner | None, rows: Sequence[LiveRow], forwards: int, stop_early: bool) -> bool:
    """Whether a step's draft forwards after its first run as one chain: its draft's forwards compile, there are
    at least two, and nothing between them needs the host (see the module docstring)."""
    if runner is None or not runner.static or forwards < 2 or stop_early:
        return False
    if any(isinstance(r, DraftOnlyRow) and (r.matcher is not None or r.top_logprobs is not None) for r in rows):
        return False
    cpu = runner.stack.cos.device.type == "cpu"
    return not (cpu and any(not r.sampling.greedy and r.sampling.top_p < 1 for r in rows))


def chained_drafts(stack: DecoderStack, head: nn.Module, ids: torch.Tensor, rows: torch.Tensor,
                   keys: list[torch.Tensor], values: list[torch.Tensor], visible: torch.Tensor, span: torch.Tensor,
                   *sampling: torch.Tensor, forwards: int, vocab: int, sampled: bool,
                   nucleus: bool) -> tuple[torch.Tensor, ...]:
    """The chain's body, traced whole (``StackRunner.chain``): ``forwards`` one-token draft forwards from the
    tokens ``ids`` [B] forward 0 chose. Returns tokens [B, n], and when ``sampled`` the warped probabilities
    [B, n, V] (V: the target's vocabulary).

    ``rows`` [B, 3]: each row's state before forward 1 (``sidecar.runtime.decoder_stack``); ``sampling`` when
    ``sampled``: draw keys [B], output positions [B] (of forward 0's token), greedy [B], temperature [B],
    top_p [B] and draft-only [B] (whose tokens are output: draws of purpose NEXT)."""
    batch = ids.shape[0]
    query_span = torch.full((batch, 1), -1, dtype=torch.long, device=ids.device)  # [B, 1]: no hidden span
    advance = (torch.arange(3, device=ids.device) == LENGTH).long()  # [3]: a forward moves only the length
    tokens, probs = [], []
    for k in range(1, forwards + 1):
        hidden = stack.forward(ids[:, None], rows, query_span, keys, values, visible, span)  # [B, 1, H]
        logits = align_vocab(head(hidden[:, 0]).float(), vocab)  # [B, V]
        token = logits.argmax(-1)  # [B]
        if sampled:
            draw_keys, positions, greedy, temperature, top_p, only = sampling
            p = warp(logits, temperature, top_p if nucleus else 1.0)  # [B, V]
            at = (positions + k)[:, None]  # [B, 1]: the output position forward k's token takes
            u = torch.where(only, uniforms(draw_keys, at, NEXT)[:, 0], uniforms(draw_keys, at, DRAFT)[:, 0])
            token = torch.where(greedy, token, sample_with(p, u))
            probs.append(p)
        tokens.append(token)
        ids = token
        rows = rows + rows[:, VALID, None] * advance  # a padding row (VALID 0) stays where it is
    out = [torch.stack(tokens, 1)]
    if sampled:
        out.append(torch.stack(probs, 1))
    return tuple(out)


def chain_flags(sampled: bool, device: torch.device) -> dict[str, bool]:
    """A chain's static flags for a batch with (``sampled``) or without sampled rows: two graphs per batch bucket
    and chain length, whatever a sampled batch's mix, so warm-up covers each. Off a CPU the nucleus always runs
    in the sampled graph: a row whose top_p is 1 (a greedy row's, padding's) keeps its probabilities exactly
    (``warp``), so its tokens are those of a graph without it; on a CPU a nucleus never chains
    (``chain_applies``) and the graph has none."""
    return {"sampled": sampled, "nucleus": sampled and device.type != "cpu"}


def run_chain(runner: StackRunner, cache: RowKVCache, first: torch.Tensor, forwards: int, sampling: RowSampling,
              only: Sequence[bool], target_vocab: int,
              shape: ForwardShape | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft forwards 1 .. ``forwards`` over every row of ``cache`` after forward 0 chose ``first`` [B], as one
    compiled call at ``shape`` (the plan's ``next_draft_shape``); commits their columns. Returns tokens [B, n] and
    probabilities [B, n, V] (None when every row is greedy)."""
    per_row: list[tuple[torch.Tensor, float | bool]] = []
    if not sampling.all_greedy:
        only_mask = to_device(list(only), first.device, torch.bool)
        per_row = [(sampling.keys, 0), (sampling.positions, 0), (sampling.greedy_mask, True),
                   (sampling.temperature, 1.0), (sampling.top_p, 1.0), (only_mask, False)]
    out = list(runner.chain(cache, chained_drafts, first, forwards, per_row, shape, vocab=target_vocab,
                            **chain_flags(not sampling.all_greedy, first.device)))
    cache.commit(forwards)
    return out[0], out[1] if not sampling.all_greedy else None


def warm_chain(runner: StackRunner, cache: RowKVCache, forwards: int, target_vocab: int,
               sampled: bool = False) -> None:
    """One chain of ``forwards`` forwards over every row of ``cache``, uncommitted, greedy or (``sampled``) the
    graph of batches with sampled rows: warm-up's (``sidecar.runtime.warmup.set_chains``), which compiles (in
    ``cudagraph`` mode, records) its graph."""
    batch, device = cache.batch_size, cache.device
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    per_row: list[tuple[torch.Tensor, float | bool]] = []
    if sampled:  # ``run_chain``'s, as ``RowSampling`` makes them: another dtype, or one tensor passed twice
        # (dynamo guards on aliasing), would compile another graph
        fills = [(torch.long, 0), (torch.long, 0), (torch.bool, True), (torch.float32, 1.0), (torch.float32, 1.0),
                 (torch.bool, False)]
        per_row = [(torch.full((batch,), fill, dtype=dtype, device=device), fill) for dtype, fill in fills]
    runner.chain(cache, chained_drafts, ids, forwards, per_row, vocab=target_vocab, **chain_flags(sampled, device))
