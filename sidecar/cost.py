"""Roofline cost model for the draft model's tagging phase, and the ``sidecar cost`` commands.

A decode step at the batch sizes sidecar runs is memory-bandwidth bound: it streams the weights once and
every request's KV cache once, so

    bytes per step = weight bytes read per step + batch x KV bytes per request
    seconds per step = bytes per step / bandwidth
    tokens/s = batch / seconds per step          (one new token per request per step)
    $ per 1M tokens = $/GPU-hour / 3600 / tokens/s x 1e6

The three modes stored per document (see docs/CONTRACTS.md) differ only in the KV cache a tagging step
reads: ``sidecar_attended`` keeps the document, ``sidecar`` has evicted it, ``standalone`` is the draft model
alone given just the summary. Units are decimal: GB = 1e9 bytes, MB = 1e6 bytes, TB/s = 1e12 bytes/s.

Python API::

    load_catalog(path=None) -> dict[str, GPU]            # sidecar/data/gpus.json by default
    find_gpu(name, catalog) -> GPU | None                # catalog name or a device name torch reports
    get_gpu(name, catalog) -> GPU                        # raises UnknownGPUError listing the known names
    ModelFacts.from_config(config, dtype_bytes=2)        # counts parameters from a HF config's shapes
    ModelFacts.from_config_file(path, dtype_bytes=2)     # a config.json (or the folder holding it)
    draft_config(pair) -> PretrainedConfig               # a run's pair's draft config, no weights loaded
    default_dtype(device) -> (name, bytes)               # the dtype load_pair gives a pair on a device
    TagTokens(document, summary, ...).mean_context(mode) # KV entries a tagging step reads, per request
    TagTokens.from_measured(main_prompt, summary, tags)  # from a run's mean token counts per request
    Workload.from_model(facts, tokens, name) / STUDY_WORKLOAD   # weights + KV bytes per request per mode
    project(workload, gpu, batches) -> list[ProjectionRow]           # one row per mode x batch
    roofline_table(workload, bandwidth_bytes_s, batches, usd_per_hour=None) -> list[RooflineRow]
    calibrate(measured_steps, workload, catalog) -> list[CalibrationRow]   # measured / projected
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.modes import MODES, Mode

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GB = 1e9
MB = 1e6
TB = 1e12

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


class CostInputError(ValueError):
    """Inputs the cost model cannot use (non-positive sizes, unsupported model type, bad mode)."""


class UnknownGPUError(CostInputError):
    """A GPU name that is not in the catalog."""


# -- GPU catalog -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth_gb_s: float
    usd_per_hour: float
    source: str
    device_names: tuple[str, ...] = ()
    usd_per_hour_quoted: tuple[float, float] | None = None

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * GB


def load_catalog(path: Path | None = None) -> dict[str, GPU]:
    """The GPU catalog keyed by name, from ``path`` or the packaged ``sidecar/data/gpus.json``."""
    if path is None:
        text = resources.files("sidecar").joinpath("data/gpus.json").read_text(encoding="utf-8")
    else:
        text = path.read_text(encoding="utf-8")
    catalog: dict[str, GPU] = {}
    for entry in json.loads(text)["gpus"]:
        quoted = entry.get("usd_per_hour_quoted")
        gpu = GPU(
            name=entry["name"],
            bandwidth_gb_s=float(entry["bandwidth_gb_s"]),
            usd_per_hour=float(entry["usd_per_hour"]),
            source=entry["source"],
            device_names=tuple(entry.get("device_names", ())),
            usd_per_hour_quoted=(float(quoted[0]), float(quoted[1])) if quoted else None,
        )
        if gpu.bandwidth_gb_s <= 0 or gpu.usd_per_hour <= 0:
            raise CostInputError(f"catalog entry {gpu.name!r}: bandwidth and price must be positive")
        catalog[gpu.name] = gpu
    return catalog


def _normalised(name: str) -> str:
    return " ".join(name.lower().split())


def find_gpu(name: str, catalog: Mapping[str, GPU]) -> GPU | None:
    """The catalog entry whose name or one of whose device names equals ``name`` (case-insensitive)."""
    wanted = _normalised(name)
    for gpu in catalog.values():
        if wanted == _normalised(gpu.name) or wanted in {_normalised(d) for d in gpu.device_names}:
            return gpu
    return None


def get_gpu(name: str, catalog: Mapping[str, GPU]) -> GPU:
    gpu = find_gpu(name, catalog)
    if gpu is None:
        raise UnknownGPUError(f"unknown GPU {name!r}; known: {', '.join(catalog)}")
    return gpu


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    return usd_per_hour / 3600 / tokens_per_s * 1e6


# -- model facts -------------------------------------------------------------------------------------------

# Which attention projections carry a bias, per supported architecture: (q/k/v bias, o bias).
# Qwen2 hard-codes biased q/k/v and an unbiased o_proj; Llama applies `attention_bias` to all four.
_SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def _attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
    if config.model_type == "qwen2":
        return True, False
    biased = bool(getattr(config, "attention_bias", False))
    return biased, biased


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of one decoder-only model, counted from its config's shapes."""

    model_type: str
    parameters: int
    embedding_parameters: int
    tied_embeddings: bool
    kv_bytes_per_token: int
    dtype_bytes: int

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.dtype_bytes

    @property
    def weight_bytes_per_step(self) -> int:
        """Weight bytes a decode step streams from memory.

        A step gathers only ``batch`` rows of the input embedding table, so an untied table is not read
        in full; a tied one is, because the LM head multiplies by the whole matrix.
        """
        if self.tied_embeddings:
            return self.weight_bytes
        return (self.parameters - self.embedding_parameters) * self.dtype_bytes

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype_bytes: int = 2) -> ModelFacts:
        if config.model_type not in _SUPPORTED_MODEL_TYPES:
            raise CostInputError(
                f"model type {config.model_type!r} is not modelled; supported: {', '.join(_SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "use_sliding_window", False):
            raise CostInputError("sliding-window attention caps the KV cache and is not modelled")
        if dtype_bytes <= 0:
            raise CostInputError(f"dtype_bytes must be positive, got {dtype_bytes}")
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        layers = config.num_hidden_layers
        intermediate = config.intermediate_size
        tied = bool(config.tie_word_embeddings)

        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        qkv_bias, o_bias = _attention_biases(config)
        attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
        attention += qkv_bias * (q_width + 2 * kv_width) + o_bias * hidden
        mlp = 3 * hidden * intermediate  # gate, up, down
        mlp += bool(getattr(config, "mlp_bias", False)) * (2 * intermediate + hidden)
        norms = 2 * hidden  # RMSNorm before attention and before the MLP
        embedding = config.vocab_size * hidden
        lm_head = 0 if tied else config.vocab_size * hidden
        parameters = embedding + layers * (attention + mlp + norms) + hidden + lm_head  # + final norm
        return cls(
            model_type=config.model_type,
            parameters=parameters,
            embedding_parameters=embedding,
            tied_embeddings=tied,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,  # K and V
            dtype_bytes=dtype_bytes,
        )

    @classmethod
    def from_config_file(cls, path: Path, dtype_bytes: int = 2) -> ModelFacts:
        """Facts from a ``config.json`` file or a model folder holding one."""
        from transformers import AutoConfig  # deferred: importing transformers takes seconds

        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise CostInputError(f"no model config at {config_path}")
        return cls.from_config(AutoConfig.from_pretrained(str(config_path)), dtype_bytes)


def draft_config(pair: str) -> PretrainedConfig:
    """The draft model's config of a pair named as ``load_pair`` takes it (a run's ``pair``), without its weights.

    Only what is on this machine is read: a fetched offline pair, a local path or the Hugging Face cache.
    Raises :class:`CostInputError` saying why when the config is not there.
    """
    # deferred: sidecar.models imports torch and transformers, which take seconds
    from transformers import AutoConfig

    from sidecar.models import pair_model_ids, tiny_pair

    if pair == "tiny":
        # The tiny pair has no files: its models are built from a config with random weights, in milliseconds.
        return tiny_pair().draft.config
    try:
        _, draft = pair_model_ids(pair)
        return AutoConfig.from_pretrained(draft, local_files_only=True)
    except (OSError, ValueError) as exc:  # OSError: no such path, not cached; PairError: unknown, not fetched
        raise CostInputError(f"the config of pair {pair!r}'s draft is not on this machine: {exc}") from exc


def default_dtype(device: str) -> tuple[str, int]:
    """Name and bytes per element of the dtype ``load_pair`` gives a pair on ``device`` when none is asked
    for, which is how the nightly flow loads it."""
    from sidecar.models import default_device_dtype

    _, dtype = default_device_dtype(device, None)
    return str(dtype).removeprefix("torch."), dtype.itemsize


# -- workloads ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TagTokens:
    """Token counts of one request at the tagging phase.

    The defaults are estimates for the study's prompts under Qwen's ChatML template: ``system`` is the
    template and system line, ``instruction`` the summarize instruction with its turn markers,
    ``sidecar_instruction`` the hashtag instruction (the study's n ~ 25), ``tags`` the sidecar's token budget.
    Pass measured counts where you have them.
    """

    document: int
    summary: int
    system: int = 14
    instruction: int = 21
    sidecar_instruction: int = 25
    tags: int = 32

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0:
                raise CostInputError(f"{name} tokens must not be negative, got {value}")
        if self.tags < 1:
            raise CostInputError("tags must be at least 1 token")

    @classmethod
    def from_measured(cls, main_prompt: float, summary: float, tags: float) -> TagTokens:
        """From a run's mean counts per request: the main task's prompt as the target sees it (system,
        document and instruction), the summary and the tags. The document is that prompt less the template
        estimates, which, like the hashtag instruction, keep their defaults."""
        return cls(
            document=max(0, round(main_prompt) - cls.system - cls.instruction),
            summary=round(summary),
            tags=max(1, round(tags)),
        )

    def mean_context(self, mode: Mode) -> float:
        """KV entries per request that a tagging decode step reads, averaged over the tag tokens."""
        # Tag token i is generated reading the prompt plus i earlier tag tokens.
        tags_so_far = (self.tags - 1) / 2
        standalone = self.system + self.summary + self.sidecar_instruction + tags_so_far
        if mode == "standalone":
            return standalone
        evicted = standalone + self.instruction  # the sidecar keeps the main instruction's entries
        if mode == "sidecar":
            return evicted
        if mode == "sidecar_attended":
            return evicted + self.document
        raise CostInputError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


@dataclass(frozen=True)
class Workload:
    """What one tagging decode step reads: the weights once, and each request's KV cache per mode.

    ``name`` labels projections (the ``pair`` column of stored cost estimates).
    """

    name: str
    weight_bytes_per_step: float
    kv_bytes_per_request: Mapping[Mode, float]
    description: str

    def __post_init__(self) -> None:
        if self.weight_bytes_per_step <= 0:
            raise CostInputError("weight bytes per step must be positive")
        for mode, kv_bytes in self.kv_bytes_per_request.items():
            if mode not in MODES:
                raise CostInputError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
            if kv_bytes <= 0:
                raise CostInputError(f"KV bytes per request for {mode} must be positive")

    @classmethod
    def from_model(cls, facts: ModelFacts, tokens: TagTokens, name: str) -> Workload:
        return cls(
            name=name,
            weight_bytes_per_step=facts.weight_bytes_per_step,
            kv_bytes_per_request={m: tokens.mean_context(m) * facts.kv_bytes_per_token for m in MODES},
            description=(
                f"{facts.model_type} draft, {facts.weight_bytes_per_step / GB:.2f} GB of weights per step, "
                f"{facts.kv_bytes_per_token / 1024:.0f} KiB of KV per token; {tokens.document} document, "
                f"{tokens.summary} summary and {tokens.tags} tag tokens per request"
            ),
        )

    def step_bytes(self, mode: Mode, batch: int) -> float:
        return self.weight_bytes_per_step + batch * self.kv_bytes_per_request[mode]

    def step_seconds(self, mode: Mode, batch: int, bandwidth_bytes_s: float) -> float:
        return self.step_bytes(mode, batch) / bandwidth_bytes_s


STUDY_WORKLOAD = Workload(
    name="source study shapes: Qwen2.5-7B/1.5B",
    weight_bytes_per_step=3.09 * GB,
    kv_bytes_per_request={"sidecar_attended": 18 * MB, "sidecar": 3.7 * MB, "standalone": 3 * MB},
    description=(
        "the source study's figures: Qwen2.5-1.5B draft in bf16 (3.09 GB of weights per step), "
        "KV per request 18 MB with the document, 3.7 MB evicted, 3 MB standalone"
    ),
)


# -- projections -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectionRow:
    gpu_type: str
    mode: Mode
    batch: int
    gb_per_step: float
    ms_per_step: float
    tokens_per_s: float
    usd_per_gpu_hour: float | None
    usd_per_million_tokens: float | None


def _projection_row(
    workload: Workload, gpu_type: str, mode: Mode, batch: int, bandwidth_bytes_s: float, usd_per_hour: float | None
) -> ProjectionRow:
    seconds = workload.step_seconds(mode, batch, bandwidth_bytes_s)
    tokens_per_s = batch / seconds
    return ProjectionRow(
        gpu_type=gpu_type,
        mode=mode,
        batch=batch,
        gb_per_step=workload.step_bytes(mode, batch) / GB,
        ms_per_step=seconds * 1000,
        tokens_per_s=tokens_per_s,
        usd_per_gpu_hour=usd_per_hour,
        usd_per_million_tokens=None if usd_per_hour is None else usd_per_million_tokens(usd_per_hour, tokens_per_s),
    )


def _check_batches(batches: Sequence[int]) -> None:
    if not batches or any(b < 1 for b in batches):
        raise CostInputError(f"batch sizes must be positive integers, got {list(batches)}")


def project(workload: Workload, gpu: GPU, batches: Sequence[int] = DEFAULT_BATCHES) -> list[ProjectionRow]:
    """One row per mode the workload knows and per batch size, on ``gpu``."""
    _check_batches(batches)
    return [
        _projection_row(workload, gpu.name, mode, batch, gpu.bandwidth_bytes_s, gpu.usd_per_hour)
        for mode in MODES
        if mode in workload.kv_bytes_per_request
        for batch in batches
    ]


@dataclass(frozen=True)
class RooflineRow:
    """Document attended (full KV) against evicted (masked KV) at one batch size; standalone if known."""

    batch: int
    full_gb_per_step: float
    masked_gb_per_step: float
    full_ms_per_step: float
    masked_ms_per_step: float
    full_tokens_per_s: float
    masked_tokens_per_s: float
    speedup_pct: float
    standalone_gb_per_step: float | None
    standalone_ms_per_step: float | None
    standalone_tokens_per_s: float | None
    usd_per_million_full: float | None
    usd_per_million_masked: float | None
    usd_per_million_standalone: float | None


def roofline_table(
    workload: Workload, bandwidth_bytes_s: float, batches: Sequence[int], usd_per_hour: float | None = None
) -> list[RooflineRow]:
    if bandwidth_bytes_s <= 0:
        raise CostInputError("bandwidth must be positive")
    for mode in ("sidecar", "sidecar_attended"):
        if mode not in workload.kv_bytes_per_request:
            raise CostInputError(f"the workload needs KV bytes per request for {mode}")
    _check_batches(batches)
    rows = []
    for batch in batches:
        full, masked = (
            _projection_row(workload, "", mode, batch, bandwidth_bytes_s, usd_per_hour)
            for mode in ("sidecar_attended", "sidecar")
        )
        alone = (
            _projection_row(workload, "", "standalone", batch, bandwidth_bytes_s, usd_per_hour)
            if "standalone" in workload.kv_bytes_per_request
            else None
        )
        alone_values = (
            (None, None, None, None)
            if alone is None
            else (alone.gb_per_step, alone.ms_per_step, alone.tokens_per_s, alone.usd_per_million_tokens)
        )
        rows.append(
            RooflineRow(
                batch=batch,
                full_gb_per_step=full.gb_per_step,
                masked_gb_per_step=masked.gb_per_step,
                full_ms_per_step=full.ms_per_step,
                masked_ms_per_step=masked.ms_per_step,
                full_tokens_per_s=full.tokens_per_s,
                masked_tokens_per_s=masked.tokens_per_s,
                speedup_pct=(full.ms_per_step / masked.ms_per_step - 1) * 100,
                standalone_gb_per_step=alone_values[0],
                standalone_ms_per_step=alone_values[1],
                standalone_tokens_per_s=alone_values[2],
                usd_per_million_full=full.usd_per_million_tokens,
                usd_per_million_masked=masked.usd_per_million_tokens,
                usd_per_million_standalone=alone_values[3],
            )
        )
    return rows


# -- calibration -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredStep:
    """A measured tagging-phase decode speed: give ``ms_per_step`` or ``tokens_per_s`` (whole batch)."""

    gpu_type: str
    mode: Mode
    batch: int
    ms_per_step: float | None = None
    tokens_per_s: float | None = None

    @property
    def step_ms(self) -> float | None:
        if self.ms_per_step is not None and self.ms_per_step > 0:
            return self.ms_per_step
        if self.tokens_per_s is not None and self.tokens_per_s > 0:
            # Draft-only decoding adds one token per request per step.
            return self.batch / self.tokens_per_s * 1000
        return None


@dataclass(frozen=True)
class CalibrationRow:
    gpu_type: str
    catalog_gpu: str
    mode: Mode
    batch: int
    measured_ms_per_step: float
    projected_ms_per_step: float

    @property
    def measured_over_projected(self) -> float:
        """Above 1: slower than the bandwidth roofline (the usual case)."""
        return self.measured_ms_per_step / self.projected_ms_per_step


def calibrate(measured: Iterable[MeasuredStep], workload: Workload, catalog: Mapping[str, GPU]) -> list[CalibrationRow]:
    """Measured ÷ projected step time, for measurements on catalogued GPUs in modes the workload knows."""
    rows = []
    for step in measured:
        gpu = find_gpu(step.gpu_type, catalog)
        step_ms = step.step_ms
        if gpu is None or step_ms is None or step.mode not in workload.kv_bytes_per_request:
            continue
        projected = workload.step_seconds(step.mode, step.batch, gpu.bandwidth_bytes_s) * 1000
        rows.append(CalibrationRow(step.gpu_type, gpu.name, step.mode, step.batch, step_ms, projected))
    return rows
