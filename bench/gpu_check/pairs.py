"""The pairs the check loads and the prompts it feeds them.

A pair is a name (``tiny``, a named pair, or ``TARGET,DRAFT``) resolved to what is on disk: nothing is fetched,
because a lent GPU machine has no network. Prompts are real news articles when data/news.parquet exists and
pyarrow can read it (the stock GPU image has torch, transformers and numpy), else ``BUILTIN_TEXTS``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import NEWS, REPO, news_documents
from sidecar.models.fetch import is_fetched
from sidecar.models.loading import default_device_dtype, load_pair, pair_model_ids
from sidecar.models.pair import ModelPair
from sidecar.models.tiny import tiny_pair

# checked when no --pair is given, those on disk; with neither on disk the tiny pair runs instead
DEFAULT_PAIRS = ("qwen-coder-small", "qwen2.5-7b")

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
    """The pair ``spec`` (from ``resolve_pair``) on ``device`` in ``dtype``, called ``name``."""
    if spec == "tiny":
        # a draft with the target's vocabulary size, so that HF assisted generation accepts the pair
        torch_device, torch_dtype = default_device_dtype(device, dtype)
        return tiny_pair(torch_device, torch_dtype, draft_extra_vocab=16)
    pair = load_pair(spec, device=device, dtype=dtype)
    pair.name = name
    return pair


def pyarrow_present() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def documents(count: int, chars: int) -> tuple[list[str], str]:
    """``count`` documents cut to ``chars`` and where they come from."""
    if not NEWS.exists():
        found, source = [], "built-in texts (data/news.parquet absent)"
    elif not pyarrow_present():
        found, source = [], "built-in texts (no pyarrow to read data/news.parquet)"
    else:
        found = news_documents(count, chars)
        source = f"real news articles ({NEWS.relative_to(REPO)})"
    found = found or list(BUILTIN_TEXTS)
    return [found[i % len(found)][:chars] for i in range(count)], source
