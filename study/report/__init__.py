"""The cost report: measured sidecar vs standalone tagging, roofline projections, calibration and plots.

Plain data in, files out. The Prefect flow reads storage and publishes what this writes::

    from study.report import write_cost_report

    report = write_cost_report(
        measurements,            # rows of the storage `throughput` view: list of dicts (see below)
        out_dir,                 # created if missing
        catalog=None,            # dict[str, cost.GPU]; default: study/cost/gpus.json
        acceptance=(),           # rows of Database.request_acceptance(): per-request acceptance to plot
        draft_config=cost.draft_config,    # pair name -> its draft's config (raises CostInputError if absent)
        study_workload=cost.STUDY_WORKLOAD,  # the extra projection with the source study's shapes
        batches=cost.DEFAULT_BATCHES,
        reference_batch=None,    # batch of the $ plot, projected beside 32-128; default: the most common measured
        host_overhead=None,      # bench.host_overhead's result (host floors); default: the committed one, if any
        tasks=(),                # the sidecar tasks measured: they name the tokens (vocab.task_nouns); none: "tag"
        task_costs=(),           # one run's Database.task_costs rows: a cost verdict per sidecar task
    )
    report.markdown              # the report as markdown (also at report.markdown_path)
    report.markdown_path, report.html_path      # cost_report.md, cost_report.html (PNGs embedded)
    report.headline, report.headline_path       # the first measured verdict with its lines; headline.json
    report.plot_paths            # {"step_time": ..., "usd_per_mtok": ..., "acceptance": ...} PNG paths
    report.cost_rows             # dicts with storage.records.CostRecord's fields: rows for `cost_estimates`
    report.verdicts              # list[Verdict], one per GPU type, pair and batch size, each with the two
                                 # modes' lines per request (sidecar, standalone: study.report.TaggingCost)

Measurement rows need ``gpu_type``, ``mode`` (sidecar | sidecar_attended | standalone), ``phase`` and
``batch_size``; they may carry ``pair``, ``run_id``, ``ms_per_step``, ``acceptance_rate``, ``tokens`` or
``new_tokens``, ``seconds`` or ``wall_s``, ``requests``, ``batches``, ``mean_kv_bytes``, ``prompt_tokens``,
``prefill_s``, ``decode_s``, ``longest_row_tokens``, ``mean_first_token_s`` and the device-time ledger:
``ledger_requests``, ``ledger_new_tokens``, ``prefill_device_s``, ``decode_device_s``,
``instruction_device_s``, ``prefill_tokens``, ``instruction_tokens`` - the throughput view's columns are
accepted as they come. Phase ``main`` is the speculative summary; every other phase, and every
``standalone`` row, is tagging work, which is what the costs compare.

Cost is attributed device seconds and nothing else: the engine's ledger (``sidecar/runtime/ledger.py``)
shares each forward's device time among the rows it served in proportion to their tokens in it. A verdict
holds each mode's lines per request (``study.report.tagging_cost``): a sidecar's prefill (catch-up and bridge
feed), decode and instruction line (its masked instruction's share of the main row's draft prefill), a
standalone tagger's prefill (its whole prompt) and decode; its rates, prices and saving are computed from
those lines, which the report prints under it, so the two cannot disagree. Rows without a ledger (an older
engine) get no rate and no verdict; wall-clock columns are latency only (the decode step time, which the
calibration compares, and the first token). Without ``ms_per_step`` a tagging row's step time is its decode
wall time over the decode steps of its batches' longest rows (prefill excluded).

Each measured pair is projected from its draft's config (``draft_config``) in the dtype ``load_pair`` gives
it on a CUDA device, with the measured mean prompt, summary and tag tokens per request (and, where the ledger
counted them, the sidecar's instruction and feed tokens); measured step times are calibrated against that
projection only. A pair whose config is not on this machine (or rows without a pair) gets no projection and
no calibration, and the report says why. The study workload is projected on every catalog GPU as well,
labelled as such. Every projected forward pays the captured host floor (``study.cost.host_floor``: a captured
forward's own, 0 and a lower bound where no CUDA-graph measurement exists, and the step's host work around its
forwards at its rows), and the report says so; a section sets eager against
captured for speculation with Qwen2.5-7B/1.5B at the measured acceptance and says where eager speculation is
slower than plain decoding.

The tokens are named by the run's tasks: tag tokens for hashtags, "headline tokens" for a headline task, output
tokens for several tasks together (``vocab.task_nouns``). Given ``task_costs``, the report adds a verdict per
sidecar task under the verdict table, in each task's words, from the ledger seconds of that task's own tokens
(``task_costs``), priced at the rent of the run's GPU type.

The report opens with the verdict table: per GPU type, pair and basis a row, per batch size a column, the
measured rows at the batch they ran and the projected ones at that batch and at 32, 64 and 128 (the batch
sizes nightly jobs on GPUs run), with a note saying which is which; then the $ per 1M tag tokens plot, then
the lines each measured verdict adds up. A projected verdict prices the same lines on the roofline of
``study.cost``. How they were reached (what was measured and projected, the calibration, what the roofline
leaves out) follows. Modules, in the order the data flows: ``measurements`` (rows, pooled),
``tagging_cost`` (a mode's lines per request), ``projections`` (a roofline workload per measured pair),
``verdicts``, ``capture`` (the host floors the projections assume, eager against captured for speculation),
``assemble`` (all figures, before any text), ``sections`` (what each section shows, every sum and choice of
rows made), ``render`` (the Jinja2 templates under ``templates/``, one text rendered as markdown and as
autoescaped HTML; ``filters``: the named number formats they use), ``plots`` and ``write`` (the files and the
cost rows).
"""

from study.report.headline import Headline
from study.report.measurements import MeasuredGroup, Measurement, group_measurements
from study.report.tagging_cost import TaggingCost
from study.report.verdicts import Verdict
from study.report.write import CostReport, write_cost_report

__all__ = [
    "CostReport",
    "Headline",
    "MeasuredGroup",
    "Measurement",
    "TaggingCost",
    "Verdict",
    "group_measurements",
    "write_cost_report",
]
