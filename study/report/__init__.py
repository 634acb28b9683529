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
        reference_batch=None,    # batch size of the $ plot; default: the most common measured one, else 32
    )
    report.markdown              # the report as markdown (also at report.markdown_path)
    report.markdown_path, report.html_path      # cost_report.md, cost_report.html (PNGs embedded)
    report.headline, report.headline_path       # the first measured verdict and KV per request; headline.json
    report.plot_paths            # {"step_time": ..., "usd_per_mtok": ..., "acceptance": ...} PNG paths
    report.cost_rows             # dicts with storage.records.CostRecord's fields: rows for `cost_estimates`
    report.verdicts              # list[Verdict], one per GPU type (and pair, when measured), each with its
                                 # prefill and decode seconds per request (sidecar_split, standalone_split)

Measurement rows need ``gpu_type``, ``mode`` (sidecar | sidecar_attended | standalone), ``phase`` and
``batch_size``; they may carry ``pair``, ``run_id``, ``tokens_per_s`` (whole batch), ``ms_per_step``,
``acceptance_rate``, ``tokens`` or ``new_tokens``, ``seconds`` or ``wall_s``, ``requests``, ``batches``,
``mean_kv_bytes``, ``prompt_tokens``, ``prefill_s``, ``decode_s`` and ``longest_row_tokens`` - the
throughput view's columns are accepted as they come. Phase ``main`` is the speculative summary; every
other phase, and every ``standalone`` row, is tagging work, which is what the costs compare. Without
``ms_per_step`` a tagging row's step time is its decode time over the decode steps of its batches' longest
rows (prefill excluded); a row with neither has no step time.

Each measured pair is projected from its draft's config (``draft_config``) in the dtype ``load_pair`` gives
it on a CUDA device, with the measured mean prompt, summary and tag tokens per request; measured step
times are calibrated against that projection only. A pair whose config is not on this machine (or rows
without a pair) gets no projection and no calibration, and the report says why. The study workload is
projected on every catalog GPU as well, labelled as such.

The report opens with the verdict: the measured verdicts, the $ per 1M tag tokens plot, then the projected
verdicts and every verdict's prefill and decode per request side by side; how they were reached (what was
measured and projected, the calibration, what the roofline leaves out) follows. A projected verdict prices
the whole tagging phase on the roofline of ``study.cost``: the standalone tagger's prompt prefill and the
sidecar's few fed tokens, then the decode steps. Modules, in the order the
data flows: ``measurements`` (rows, pooled), ``projections`` (a roofline workload per measured pair),
``verdicts``, ``assemble`` (all figures, before any text), ``sections`` (the report as document blocks),
``blocks`` (markdown and HTML), ``plots`` and ``write`` (the files and the cost rows).
"""

from study.report.headline import Headline
from study.report.measurements import MeasuredGroup, Measurement, group_measurements
from study.report.verdicts import Verdict
from study.report.write import CostReport, write_cost_report

__all__ = [
    "CostReport",
    "Headline",
    "MeasuredGroup",
    "Measurement",
    "Verdict",
    "group_measurements",
    "write_cost_report",
]
