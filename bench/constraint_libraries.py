"""Structured-generation libraries compared on the Qwen2.5 tokenizer: how docs/constraints.md chose llguidance.

    python -m bench.constraint_libraries llguidance      # or xgrammar, outlines-core; prints one JSON object

Only llguidance is a dependency; to measure another, install it in a scratch virtual environment that sees
the project's packages (docs/constraints.md says how) and run this module with that environment's python.
For each library it times the tokenizer's wrapping, then for a constraint of each kind (five topic
labels, a hashtag regex, a nested JSON schema): the grammar's compile, a matcher's making, and the fill of
one next-token bitmask per token (median and max) over three greedy decodes of 120 tokens at most from
random logits over the models' 151,936 logits; every library's mask is applied the same way
(``sidecar.decoding.matcher.apply_bitmask``), so the fills compare alone. ``rollback_ok``: after one
token and a rollback of it, the mask equals the one before.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from sidecar.decoding.matcher import allocate_bitmask, apply_bitmask
from sidecar.models.loading import load_tokenizer

VOCAB = 151_936  # the Qwen2.5 models' logits; the tokenizer has fewer ids
CHOICES = ["politics", "business", "science", "sport", "culture"]
REGEX = r"#[a-z]{2,20}( #[a-z]{2,20}){2,4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
            "required": ["name", "role"], "additionalProperties": False}},
        "places": {"type": "array", "items": {"type": "string"}},
        "year": {"type": "integer"},
    },
    "required": ["people", "places", "year"],
    "additionalProperties": False,
}
KINDS: list[tuple[str, Any]] = [("choices", CHOICES), ("regex", REGEX), ("json_schema", SCHEMA)]


class Library:
    """One library's calls: compile(kind, spec) -> grammar; matcher(grammar); fill(matcher, bitmask [1, W]);
    accept(matcher, token); done(matcher); rollback(matcher, k)."""

    compile: Callable[[str, Any], Any]
    matcher: Callable[[Any], Any]
    fill: Callable[[Any, torch.Tensor], None]
    accept: Callable[[Any, int], Any]
    done: Callable[[Any], bool]
    rollback: Callable[[Any, int], Any]


def llguidance_library(tokenizer, vocab: int) -> Library:
    import llguidance
    import llguidance.hf

    space = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    lib = Library()

    def compile_(kind: str, spec: Any) -> str:
        if kind == "choices":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec),
                                                             defaults={"whitespace_flexible": False})

    lib.compile = compile_
    lib.matcher = lambda grammar: llguidance.LLMatcher(space, grammar)
    lib.fill = lambda m, bitmask: m.unsafe_compute_mask_ptr(bitmask[0].data_ptr(), bitmask[0].numel() * 4)
    lib.accept = lambda m, token: m.consume_token(token)
    lib.done = lambda m: m.is_stopped()
    lib.rollback = lambda m, k: m.rollback(k)
    return lib


def xgrammar_library(tokenizer, vocab: int) -> Library:
    import xgrammar

    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab),
                                        max_threads=1)
    lib = Library()

    def compile_(kind: str, spec: Any) -> Any:
        if kind == "choices":
            return compiler.compile_grammar(xgrammar.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in spec)))
        if kind == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, strict_mode=True)

    lib.compile = compile_
    lib.matcher = lambda grammar: xgrammar.GrammarMatcher(grammar, max_rollback_tokens=8)
    lib.fill = lambda m, bitmask: m.fill_next_token_bitmask(bitmask, 0)
    lib.accept = lambda m, token: m.accept_token(token)
    lib.done = lambda m: m.is_terminated()
    lib.rollback = lambda m, k: m.rollback(k)
    return lib


def outlines_core_library(tokenizer, vocab: int) -> Library:
    import re

    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import fill_next_token_bitmask

    # outlines-core reads a tokenizer only from the model hub (Vocabulary.from_pretrained); offline its
    # vocabulary is given as bytes per token, undoing the byte-level BPE's byte-to-character table
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    to_byte = {chr(c): c for c in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    vocabulary: dict[bytes, list[int]] = {}
    special = set(tokenizer.all_special_tokens)
    for text, token in tokenizer.get_vocab().items():
        if text not in special and all(c in to_byte for c in text):
            vocabulary.setdefault(bytes(to_byte[c] for c in text), []).append(token)
    space = outlines_core.Vocabulary(tokenizer.eos_token_id, vocabulary)
    lib = Library()

    def compile_(kind: str, spec: Any) -> Any:
        if kind == "choices":
            pattern = "(" + "|".join(re.escape(c) for c in spec) + ")"
        elif kind == "regex":
            pattern = spec
        else:
            pattern = build_regex_from_schema(json.dumps(spec))
        return outlines_core.Index(pattern, space)

    lib.compile = compile_
    lib.matcher = lambda index: outlines_core.Guide(index, max_rollback=8)
    lib.fill = lambda m, bitmask: fill_next_token_bitmask(m, bitmask)
    lib.accept = lambda m, token: m.advance(token)
    lib.done = lambda m: m.is_finished()
    lib.rollback = lambda m, k: m.rollback_state(k)
    return lib


LIBRARIES = {"llguidance": llguidance_library, "xgrammar": xgrammar_library, "outlines-core": outlines_core_library}


def measure(name: str, tokenizer, vocab: int = VOCAB) -> dict[str, Any]:
    """One library's times over ``vocab`` logits (tests use the tiny tokenizer's)."""
    started = time.perf_counter()
    lib = LIBRARIES[name](tokenizer, vocab)
    out: dict[str, Any] = {"library": name, "tokenizer_s": round(time.perf_counter() - started, 3)}
    eos = set(tokenizer.all_special_ids)
    bitmask = allocate_bitmask(1, vocab)
    generator = torch.Generator().manual_seed(0)
    for kind, spec in KINDS:
        started = time.perf_counter()
        grammar = lib.compile(kind, spec)
        out[f"{kind}_compile_ms"] = round((time.perf_counter() - started) * 1e3, 2)
        fills, makes = [], []
        for _ in range(3):
            started = time.perf_counter()
            matcher = lib.matcher(grammar)
            makes.append(time.perf_counter() - started)
            for _ in range(120):
                logits = torch.randn(1, vocab, generator=generator)
                started = time.perf_counter()
                lib.fill(matcher, bitmask)
                fills.append(time.perf_counter() - started)
                apply_bitmask(logits, bitmask)
                token = int(logits.argmax(-1))
                if token in eos:
                    break
                lib.accept(matcher, token)
                if lib.done(matcher):
                    break
        out[f"{kind}_matcher_ms"] = round(statistics.median(makes) * 1e3, 3)
        out[f"{kind}_fill_ms_median"] = round(statistics.median(fills) * 1e3, 3)
        out[f"{kind}_fill_ms_max"] = round(max(fills) * 1e3, 3)
        matcher = lib.matcher(grammar)
        lib.fill(matcher, bitmask)
        before = bitmask.clone()
        logits = torch.randn(1, vocab, generator=generator)
        apply_bitmask(logits, bitmask)
        lib.accept(matcher, int(logits.argmax(-1)))
        lib.rollback(matcher, 1)
        lib.fill(matcher, bitmask)
        out[f"{kind}_rollback_ok"] = bool(torch.equal(before, bitmask))
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in LIBRARIES:
        raise SystemExit(f"usage: python -m bench.constraint_libraries {{{','.join(LIBRARIES)}}}")
    print(json.dumps(measure(argv[0], load_tokenizer("qwen-coder-small")), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
