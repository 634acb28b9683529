"""Roofline cost model for the draft model's tagging phase.

A forward takes the longer of its FLOPs over the GPU's peak dense FLOP/s and its bytes over its bandwidth
(see ``roofline``). A decode step at the batch sizes sidecar runs is memory-bandwidth bound: it streams the
weights once and every request's KV cache once (see ``projection``); a prefill of a prompt at batch is
compute-bound. The modes differ in the KV cache a tagging step reads and in what they prefill: the
standalone tagger its whole prompt, a sidecar a few tokens (see ``workload``). Units are decimal (see
``units``). Importing this package loads no torch or transformers; the functions that need them import them
when called.

Python API::

    load_catalog(path=None) -> dict[str, GPU]            # study/cost/gpus.json by default
    find_gpu(name, catalog) -> GPU | None                # catalog name or a device name torch reports
    get_gpu(name, catalog) -> GPU                        # raises UnknownGPUError listing the known names
    ModelFacts.from_config(config, dtype_bytes=2)        # counts parameters from a HF config's shapes
    ModelFacts.from_config_file(path, dtype_bytes=2)     # a config.json (or the folder holding it)
    draft_config(pair) -> PretrainedConfig               # a run's pair's draft config, no weights loaded (the tiny
                                                         # pair's: a SimpleNamespace of its fields, without torch)
    default_dtype(device) -> (name, bytes)               # the dtype load_pair gives a pair on a device
    TagTokens(document, summary, ...).mean_context(mode) # KV entries a tagging step reads, per request
    TagTokens.prefill(mode) -> (tokens fed, entries cached)  # the forward that yields the first tag token
    TagTokens.from_measured(main_prompt, summary, tags)  # from a run's mean token counts per request
    Workload.from_model(facts, tokens, name) / STUDY_WORKLOAD   # weights + KV bytes per request per mode
    Workload.tagging_time(mode, batch, gpu) -> TaggingTime       # one batch's prefill_s and decode_s
    prefill_seconds(facts, gpu, batch, tokens, context=0)        # one prefill forward's roofline time
    decode_step_seconds(facts, gpu, batch, context)              # one decode step's roofline time
    forward_seconds(facts, gpu, batch, tokens, context, logits=1) / forward_flops / forward_bytes
    Peaks(bandwidth_bytes_s, flops_s)                    # a device outside the catalog, for the above
    project(workload, gpu, batches) -> list[ProjectionRow]           # one row per mode x batch
    roofline_table(workload, bandwidth_bytes_s, batches, usd_per_hour=None, flops_s=None) -> list[RooflineRow]
    calibrate(measured_steps, workload, catalog) -> list[CalibrationRow]   # measured / projected
    load_step_costs(path) -> StepCosts                   # ms per forward the GPU check timed (its step-cost table)
    StepCosts.seconds(model, kind, tokens, batch)        # a measured forward, in place of the roofline's
    replay(records, target, draft, device, steps=None, host=None)   # a run's forwards priced (``study.cost.replay``)
    load_host_floors(path=None) -> HostFloors            # eager and captured host floor per forward (``host_floor``)
    HostFloors.of("eager" | "captured") -> HostFloor     # pass as host= to forward_seconds, project, replay, ...
    speculation_vs_plain(target, draft, gpu, batch, context, acceptance, host, gamma=4) -> SpeculationRow
"""

from study.cost.calibration import CalibrationRow, MeasuredStep, calibrate
from study.cost.catalog import GPU, find_gpu, get_gpu, load_catalog, usd_per_million_tokens
from study.cost.errors import CostInputError, UnknownGPUError, count, number
from study.cost.facts import ModelFacts, default_dtype, draft_config
from study.cost.host_floor import CAPTURES, Capture, HostFloor, HostFloors, default_host_overhead_path, load_host_floors
from study.cost.projection import (
    DEFAULT_BATCHES,
    ProjectionRow,
    RooflineRow,
    check_batches,
    project,
    roofline_table,
)
from study.cost.roofline import (
    Device,
    Peaks,
    decode_step_seconds,
    forward_bytes,
    forward_flops,
    forward_seconds,
    prefill_seconds,
)
from study.cost.speculation import DEFAULT_GAMMA, SpeculationRow, speculation_vs_plain
from study.cost.step_costs import StepCosts, load_step_costs
from study.cost.units import DTYPE_BYTES, GB, MB, TB, TERA
from study.cost.workload import STUDY_WORKLOAD, TaggingTime, TagTokens, Workload
from vocab.modes import MODES, Mode

__all__ = [
    "CAPTURES",
    "DEFAULT_BATCHES",
    "DEFAULT_GAMMA",
    "DTYPE_BYTES",
    "GB",
    "GPU",
    "MB",
    "MODES",
    "STUDY_WORKLOAD",
    "TB",
    "TERA",
    "CalibrationRow",
    "Capture",
    "CostInputError",
    "Device",
    "HostFloor",
    "HostFloors",
    "MeasuredStep",
    "Mode",
    "ModelFacts",
    "Peaks",
    "ProjectionRow",
    "RooflineRow",
    "SpeculationRow",
    "StepCosts",
    "TagTokens",
    "TaggingTime",
    "UnknownGPUError",
    "Workload",
    "calibrate",
    "check_batches",
    "count",
    "decode_step_seconds",
    "default_dtype",
    "default_host_overhead_path",
    "draft_config",
    "find_gpu",
    "forward_bytes",
    "forward_flops",
    "forward_seconds",
    "get_gpu",
    "load_catalog",
    "load_host_floors",
    "load_step_costs",
    "number",
    "prefill_seconds",
    "project",
    "roofline_table",
    "speculation_vs_plain",
    "usd_per_million_tokens",
]
