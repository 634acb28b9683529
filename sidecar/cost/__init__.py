"""Roofline cost model for the draft model's tagging phase.

A decode step at the batch sizes sidecar runs is memory-bandwidth bound: it streams the weights once and
every request's KV cache once (see ``projection``). The modes differ only in the KV cache a tagging step
reads (see ``workload``). Units are decimal (see ``units``). Importing this package loads no torch or
transformers; the functions that need them import them when called.

Python API::

    load_catalog(path=None) -> dict[str, GPU]            # sidecar/cost/gpus.json by default
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

from sidecar.cost.calibration import CalibrationRow, MeasuredStep, calibrate
from sidecar.cost.catalog import GPU, find_gpu, get_gpu, load_catalog, usd_per_million_tokens
from sidecar.cost.errors import CostInputError, UnknownGPUError
from sidecar.cost.facts import ModelFacts, default_dtype, draft_config
from sidecar.cost.projection import (
    DEFAULT_BATCHES,
    ProjectionRow,
    RooflineRow,
    check_batches,
    project,
    roofline_table,
)
from sidecar.cost.units import DTYPE_BYTES, GB, MB, TB
from sidecar.cost.workload import STUDY_WORKLOAD, TagTokens, Workload
from sidecar.modes import MODES, Mode

__all__ = [
    "DEFAULT_BATCHES",
    "DTYPE_BYTES",
    "GB",
    "GPU",
    "MB",
    "MODES",
    "STUDY_WORKLOAD",
    "TB",
    "CalibrationRow",
    "CostInputError",
    "MeasuredStep",
    "Mode",
    "ModelFacts",
    "ProjectionRow",
    "RooflineRow",
    "TagTokens",
    "UnknownGPUError",
    "Workload",
    "calibrate",
    "check_batches",
    "default_dtype",
    "draft_config",
    "find_gpu",
    "get_gpu",
    "load_catalog",
    "project",
    "roofline_table",
    "usd_per_million_tokens",
]
