"""Constrained outputs: a task's ``choices``, ``regex`` or ``json_schema`` as a grammar, and a tokenizer's
token space that grammars are compiled against.

The grammars are llguidance's (why llguidance and not xgrammar or outlines-core: docs/constraints.md). A
``Constraint`` is checked when it is made, without a tokenizer, so a bad regex or schema is an error naming
its field before anything decodes. ``token_space`` wraps a tokenizer once (about a second for Qwen's
151,643 tokens) and is cached per tokenizer; each space caches one compiled matcher per grammar, which new
rows copy (microseconds) instead of compiling again (about a millisecond). Matching itself is
``sidecar.decoding.matcher``.

llguidance and jsonschema are imported where a constraint is made, checked or enforced, not with this module:
the engine imports it, and runs where only torch and transformers are installed (the GPU check on a stock
image) as long as no row is constrained.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import regex

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

ConstraintKind = Literal["choices", "regex", "json_schema"]
CONSTRAINT_FIELDS: tuple[ConstraintKind, ...] = ("choices", "regex", "json_schema")

# JSON as json.dumps writes it: one way to space it, so a model cannot spend its tokens on whitespace, and
# the separators are the ones models have seen most
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 1000
COMPILED_PER_SPACE = 256  # compiled grammars kept per token space; the least recently used go first


class ConstraintError(ValueError):
    """A constraint that cannot be enforced; ``field`` names the task field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class Constraint:
    """What a row's output must be, as llguidance's grammar (a JSON document); ``spec`` is what the task
    gave (the choices, the regex, the schema) for parsing the output afterwards."""

    kind: ConstraintKind
    grammar: str
    spec: Any


def check_choices(choices: Sequence[str]) -> list[str]:
    """The choices, or a ``ConstraintError`` naming ``choices``: 1 to 1000 distinct non-empty strings."""
    values = list(choices)
    if not values:
        raise ConstraintError("choices", "give at least one choice")
    if len(values) > MAX_CHOICES:
        raise ConstraintError("choices", f"at most {MAX_CHOICES} choices, got {len(values)}")
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value:
            raise ConstraintError("choices", f"choice {i} must be a non-empty string, got {value!r}")
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise ConstraintError("choices", f"duplicate choices {duplicates}")
    return values


def choices_constraint(choices: Sequence[str]) -> Constraint:
    import llguidance

    values = check_choices(choices)
    # a Lark alternation of literals; JSON string escapes are Lark's, so any text is quoted exactly
    grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in values))
    return _checked(Constraint("choices", grammar, values))


def regex_constraint(pattern: str) -> Constraint:
    """The whole output matches ``pattern`` (Rust regex syntax, as llguidance reads it: no look-around or
    back-references). The pattern must also compile in Python's ``regex``, which parses the output."""
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError("regex", "give a non-empty pattern")
    try:
        regex.compile(pattern)
    except regex.error as error:
        raise ConstraintError("regex", f"invalid pattern {pattern!r}: {error}") from None
    import llguidance

    return _checked(Constraint("regex", llguidance.LLMatcher.grammar_from_regex(pattern), pattern))


def json_schema_constraint(schema: dict[str, Any], lenient: bool = False) -> Constraint:
    """The output is one JSON value valid under ``schema`` (JSON Schema, checked against its own draft's
    meta-schema first), laid out as ``json.dumps`` writes it. A keyword llguidance does not enforce is an
    error, unless ``lenient`` (OpenAI's non-strict schemas): then it is left unenforced, the rest still is."""
    import jsonschema
    import llguidance

    if not isinstance(schema, dict):
        raise ConstraintError("json_schema", f"must be a JSON object (a schema), got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ConstraintError("json_schema", f"not a valid JSON Schema: {error.message}") from None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT,
                                                            overrides={"lenient": True} if lenient else None)
    return _checked(Constraint("json_schema", grammar, schema))


def constraint_from(choices: Sequence[str] | None = None, pattern: str | None = None,
                    json_schema: dict[str, Any] | None = None) -> Constraint | None:
    """The one constraint given (None when none is); two or more are a ``ConstraintError``."""
    given = [name for name, value in zip(CONSTRAINT_FIELDS, (choices, pattern, json_schema), strict=True)
             if value is not None]
    if len(given) > 1:
        raise ConstraintError(given[1], f"{' and '.join(given)} exclude each other: give one")
    if choices is not None:
        return choices_constraint(choices)
    if pattern is not None:
        return regex_constraint(pattern)
    if json_schema is not None:
        return json_schema_constraint(json_schema)
    return None


def parse_constrained(constraint: Constraint, text: str) -> tuple[Any, str | None]:
    """(value, error) of a constrained output: the choice, the regex's match, the JSON value. Text that does
    not satisfy the constraint (an output cut by its token limit, or decoded without the mask) keeps an
    error saying why. Surrounding whitespace is forgiven only when the exact text does not satisfy it."""
    candidates = [text] if text == text.strip() else [text, text.strip()]
    if constraint.kind == "choices":
        for candidate in candidates:
            if candidate in constraint.spec:
                return candidate, None
        return None, f"not one of the {len(constraint.spec)} choices"
    if constraint.kind == "regex":
        for candidate in candidates:
            if regex.fullmatch(constraint.spec, candidate) is not None:
                return candidate, None
        return None, "does not match the regex"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return None, f"not JSON: {error}"
    import jsonschema

    found = jsonschema.validators.validator_for(constraint.spec)(constraint.spec).iter_errors(value)
    first = jsonschema.exceptions.best_match(found)
    if first is not None:
        where = "/".join(str(part) for part in first.absolute_path) or "the value"
        return None, f"does not match the schema at {where}: {first.message}"
    return value, None


def _checked(constraint: Constraint) -> Constraint:
    """The constraint, once llguidance has compiled its grammar without a tokenizer (what it cannot enforce,
    say a schema keyword it does not know, is an error here and not a surprise while decoding)."""
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(constraint.grammar)
    if problem:
        raise ConstraintError(constraint.kind, f"cannot be enforced: {problem.strip()}")
    return constraint


class TokenSpace:
    """A tokenizer as llguidance sees it, over ``vocab_size`` logits: ids past the tokenizer's own (a padded
    embedding, as Qwen's 151,936 logits over 151,665 ids) have no text and are never allowed; the
    ``eos_ids`` are allowed exactly when the output is complete."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Sequence[int]) -> None:
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} ids")
        if not eos_ids:
            raise ValueError("a token space needs at least one end-of-sequence id")
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(set(eos_ids)))
        # llguidance.hf imports transformers and torch (seconds), which checking a task's constraint (a flow's
        # parameters, the CLI) never needs
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(self.eos_ids))
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint``, at the start of the output."""
        import llguidance

        with self._lock:
            compiled = self._compiled.get(constraint.grammar)
            if compiled is None:
                compiled = llguidance.LLMatcher(self.tokenizer, constraint.grammar)
                if compiled.is_error():
                    raise ConstraintError(constraint.kind, f"cannot be enforced: {compiled.get_error()}")
                self._compiled[constraint.grammar] = compiled
                while len(self._compiled) > COMPILED_PER_SPACE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint.grammar)
            return compiled.deep_copy()


_SPACES: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[tuple[int, tuple[int, ...]], TokenSpace]] = (
    weakref.WeakKeyDictionary())
_SPACES_LOCK = threading.Lock()


def token_space(tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Sequence[int]) -> TokenSpace:
    """The tokenizer's token space over ``vocab_size`` logits, made once per (tokenizer, vocab, EOS ids)
    and kept while the tokenizer lives."""
    key = (vocab_size, tuple(sorted(set(eos_ids))))
    with _SPACES_LOCK:
        spaces = _SPACES.setdefault(tokenizer, {})
        space = spaces.get(key)
        if space is None:
            space = spaces[key] = TokenSpace(tokenizer, vocab_size, eos_ids)
        return space
