"""What a pair's name means on disk or on the hub: the fetched offline pair, a named hub pair, or ``TARGET,DRAFT``.

Without torch or transformers, so that what only needs a pair's files (its tokenizer, its config) does not pay
for them (seconds)."""

from __future__ import annotations

from sidecar.errors import PairError
from sidecar.models.fetch import is_fetched, pair_dir

NAMED_PAIRS: dict[str, tuple[str, str]] = {
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"),
}


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
