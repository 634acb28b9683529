"""The report ``sidecar demo`` ends with: what the run found, readable in 30 seconds in 80 columns.

Per document a summary head and both tag sets, or, for a run with other or several sidecar tasks, every
task's output in both modes; the cost report's headline (the measured verdict, sidecar
against standalone tagger, and under it the attributed device milliseconds per request, line by line, and
per output token it is computed from, the price per million of them, and the KV a request keeps with the
document evicted or attended; the tokens named by the run's tasks, and for several tasks each one's verdict);
the judge's tally, its controls and whether it is reliable; then where to
look further. Every line is cut to the
console's width (at most ``WIDTH``), never wrapped: a table that wraps a summary one word per line is
what this replaces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.rule import Rule
from rich.text import Text

from vocab.task_nouns import tokens_noun

WIDTH = 80
MB = 1e6


@dataclass(frozen=True)
class DemoFindings:
    """What the closing report shows, read from the database and the cost report's files."""

    run_id: str
    db_path: Path
    rows: list[dict[str, Any]]
    # per judge model, prompt version and method: the judge_quality row (its ladder, margin, verdict and
    # note) with Database.judge_tally's counts (none for a method that gave nothing) and ``preference_ci``
    judge: list[dict[str, Any]]
    # the cost report's headline.json (study.report.Headline as a dict); None when it was not written
    headline: dict[str, Any] | None
    html_path: Path | None
    seconds: float
    # judge_headline.verdict: the run's verdict from its trusted methods only (None: nothing judged)
    judge_verdict: str | None = None
    # the run's sidecar tasks by name (Database.sidecar_tasks): the cost section's words come from them
    tasks: tuple[str, ...] = ("hashtags",)
    # every sidecar output of the run (Database.task_outputs: doc_id, task, mode, text, parsed, parse_error)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    # per sidecar task the judge looked at, its judge_verdicts row (status judged / not judged / unreliable,
    # verdict, reason; Database.judge_verdicts)
    judge_tasks: dict[str, dict[str, Any]] = field(default_factory=dict)


def summary_head(summary: str) -> str:
    """The first non-empty line of a summary, without its bullet."""
    for line in summary.splitlines():
        line = line.strip().lstrip("-*•").strip()
        if line:
            return line
    return "(empty summary)"


def tags_text(tags: list[str] | None) -> str:
    return " ".join(f"#{t}" for t in tags) if tags else "(no tags parsed)"


def line(*cells: tuple[str | Text, int | None], width: int = WIDTH) -> Text:
    """One line of ``(text, column width)`` cells, each padded to its width; a None width takes what is left.
    Whatever does not fit is cut with an ellipsis, never wrapped."""
    out = Text(no_wrap=True, overflow="ellipsis")
    for text, cell_width in cells:
        cell = text if isinstance(text, Text) else Text(text)
        if cell_width is not None:
            cell.truncate(cell_width, overflow="ellipsis", pad=True)
        out.append_text(cell)
        out.append(" ")
    out.rstrip()
    out.truncate(width, overflow="ellipsis")
    return out


def output_text(output: dict[str, Any]) -> str:
    """A task's output on one line: tags as #tags, a list joined, an object as compact JSON, a string as it is;
    one that did not parse as its raw text, marked."""
    value = output.get("parsed")
    if value is None:
        raw = " ".join((output.get("text") or "").split())
        return f"(not parsed) {raw}" if raw else "(empty)"
    if output["task"] == "hashtags" and isinstance(value, list):
        return tags_text(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ", ".join(value)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _task_outputs(findings: DemoFindings) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """doc_id -> task -> mode -> output."""
    by_doc: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for output in findings.outputs:
        by_doc.setdefault(output["doc_id"], {}).setdefault(output["task"], {})[output["mode"]] = output
    return by_doc


def documents_section(findings: DemoFindings) -> Group:
    """Per document its title and summary head, then its sidecar outputs: the two tag sets for a hashtags run,
    else each task's output in each mode, named by the task."""
    if {o["task"] for o in findings.outputs} - {"hashtags"}:
        return _tasks_section(findings)
    lines = [Text(f"{len(findings.rows)} documents: title, summary head, sidecar and standalone tags", style="bold")]
    for row in findings.rows:
        lines += [
            line((Text(row["doc_id"], style="bold"), 12), (Text(row.get("title") or "", style="bold"), None)),
            line(("  summary", 12), (summary_head(row["summary"] or ""), None)),
            line((Text("  sidecar", style="cyan"), 12), (tags_text(row["sidecar_tags"]), None)),
            line((Text("  standalone", style="magenta"), 12), (tags_text(row["standalone_tags"]), None)),
        ]
    return Group(*lines)


# in this order: sidecar, attended, standalone
MODE_STYLES = {"sidecar": "cyan", "sidecar_attended": "blue", "standalone": "magenta"}
MODE_ORDER = {mode: i for i, mode in enumerate(MODE_STYLES)}


def _tasks_section(findings: DemoFindings) -> Group:
    lines = [line((Text(f"{len(findings.rows)} documents: title, summary head, each task's output per mode",
                        style="bold"), None))]
    by_doc = _task_outputs(findings)
    for row in findings.rows:
        lines += [
            line((Text(row["doc_id"], style="bold"), 12), (Text(row.get("title") or "", style="bold"), None)),
            line(("  summary", 12), (summary_head(row["summary"] or ""), None)),
        ]
        for task, by_mode in sorted(by_doc.get(row["doc_id"], {}).items()):
            lines.append(line((Text(f"  {task}", style="bold"), None)))
            lines += [line((Text(f"    {mode}", style=MODE_STYLES.get(mode, "")), 16), (output_text(output), None))
                      for mode, output in sorted(by_mode.items(), key=lambda item: MODE_ORDER.get(item[0], 9))]
    return Group(*lines)


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}"


def _ms(seconds: float | None) -> str:
    """Milliseconds to about three significant digits, a dash for none."""
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.2f} MB"


# each mode's lines, as the cost report's table lists them: what its device seconds per request add up from
LINES = {"sidecar": (("prefill", "prefill_s"), ("decode", "decode_s"), ("instruction", "instruction_s")),
         "standalone": (("prefill", "prefill_s"), ("decode", "decode_s"))}


def _per_request(lines: dict[str, Any], mode: str) -> float:
    return sum(lines.get(key) or 0.0 for _, key in LINES[mode])


def _task_line(task: dict[str, Any]) -> Text:
    """One task's cost verdict in its own words (headline.json's ``tasks``: study.report.task_costs)."""
    if task.get("saving_pct") is None:
        missing = " and ".join(mode for mode in ("sidecar", "standalone") if task.get(f"{mode}_ms_per_token") is None)
        return line((f"  {task['task']}: no verdict, no ledger seconds in {missing}", None))
    saving = task["saving_pct"]
    return line((f"  {task['task']}: a sidecar {task['noun']} token costs {abs(saving):.0f}% "
                 f"{'less' if saving >= 0 else 'more'} ({task['sidecar_ms_per_token']:.2f} vs "
                 f"{task['standalone_ms_per_token']:.2f} ms)", None))


def cost_section(headline: dict[str, Any] | None, tasks: tuple[str, ...] = ("hashtags",)) -> Group:
    """The measured verdict, then the lines per request it is computed from: each mode's attributed device
    seconds per request, line by line, and per output token, named from the run's ``tasks`` (a tag token, a
    headline token, an output token of several tasks together: vocab.task_nouns); then, for several tasks, each
    task's own verdict in its words. The verdict's percentage is computed here from the lines printed under it,
    so the two cannot disagree."""
    word = tokens_noun(tasks)
    title = Text("Cost of tagging" if word == "tag" else "Cost of the sidecar outputs" if len(tasks) > 1
                 else f"Cost of the {word} sidecar output", style="bold")
    if headline is None:
        return Group(title, Text("no measured cost verdict: no run measured both modes with the engine's "
                                 "device-time ledger, or the cost-report flow did not complete"))
    if not all(isinstance(headline.get(mode), dict) for mode in LINES):
        return Group(title, Text("the cost report's headline has no device-time lines (an older report)"))
    title.append(f" ({headline['basis']} on {headline['gpu_type']}, batch {headline['batch']}; device time)",
                 style="")
    per_token = {mode: _per_request(headline[mode], mode) / headline[mode]["tag_tokens"] for mode in LINES}
    saving = (1 - per_token["sidecar"] / per_token["standalone"]) * 100
    verdict = (f"a sidecar {word} token costs {abs(saving):.0f}% {'less' if saving >= 0 else 'more'} than a "
               f"standalone one ({_ms(per_token['sidecar'])} vs {_ms(per_token['standalone'])} ms)")
    widths = (14, 14, 14, None)

    def row(*texts: str | Text) -> Text:
        return line(*zip(texts, widths, strict=True))

    short = "tag" if word == "tag" else "out"
    price = f"$ / 1M {short} tok" if headline.get("sidecar_usd_per_mtok") is not None else "$ (no price here)"
    rows = [row(*(Text(h, style="dim") for h in ("", "ms / request", f"ms / {short} tok", price)))]
    for mode in LINES:
        lines = headline[mode]
        rows.append(row(mode, _ms(_per_request(lines, mode)), _ms(per_token[mode]),
                        _usd(headline.get(f"{mode}_usd_per_mtok"))))
        rows += [row(f"  {label}", _ms(lines.get(key)), "", "") for label, key in LINES[mode]]
    note = line((Text(f"{word} tokens per request: {headline['sidecar']['tag_tokens']:.1f} sidecar, "
                      f"{headline['standalone']['tag_tokens']:.1f} standalone", style="dim"), None))
    kv_evicted, kv_attended = headline.get("kv_evicted_bytes"), headline.get("kv_attended_bytes")
    kv = [line((f"KV per request: {_mb(kv_evicted)} evicted, {_mb(kv_attended)} attended, "
                f"{_mb(headline.get('kv_standalone_bytes'))} standalone", None))]
    if kv_evicted and kv_attended:
        kv.append(line((f"evicting the document frees {1 - kv_evicted / kv_attended:.0%} of the KV", None)))
    per_task = headline.get("tasks") or []
    if len(per_task) > 1:
        said = Text("per task, sidecar vs standalone, device ms per token of its own output:", style="dim")
        per_task_lines = [line((said, None)), *(_task_line(task) for task in per_task)]
    else:
        per_task_lines = []
    return Group(line((title, None)), line((verdict, None)), *rows, note, *kv, *per_task_lines)


VERDICTS = {"sidecar": "the sidecar's tags are better", "standalone": "the standalone tags are better",
            "tie": "no difference found", "split": "the trusted methods disagree"}


def _judge_quality_lines(tally: dict[str, Any]) -> list[Text]:
    """The mean preference with its interval, the controls against the margin, the position bias, the smallest
    detectable difference and, plainly, UNRELIABLE."""
    lines = []
    if tally["mean_preference"] is not None:
        ci = tally["preference_ci"]
        interval = "" if ci is None else f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})"
        margin = "" if tally["margin"] is None else f"; tie within {tally['margin']:.3f} of 0.5"
        lines.append(line((f"preference for the sidecar {tally['mean_preference']:.3f}{interval}{margin}", None)))
    elif tally.get("method") == "likelihood" and tally.get("mean_difference") is not None:
        token = "tag token" if tally.get("task", "hashtags") == "hashtags" else "token"
        lines.append(line((f"sidecar minus standalone {tally['mean_difference']:.3f} nats per {token}; tie within "
                           f"{_number(tally['margin'])}", None)))
    bias = "-" if tally["position_bias"] is None else f"{tally['position_bias']:.2f}"
    lines.append(line((f"ladder: {_rungs(tally)}; position bias {bias} (0.5 = none)", None)))
    lines.append(line((f"separation {_number(tally['separation'])} ± {_number(tally['separation_spread'])}, AUC "
                       f"{_number(tally['auc'])}; detectable difference {_number(tally['detectable'])}", None)))
    if tally["reliable"]:
        lines.append(line((f"verdict: {VERDICTS.get(tally['verdict'], tally['verdict'])}", None)))
    else:
        threshold = tally["threshold"] if tally["threshold"] is not None else 0.9
        lines.append(line((Text(f"UNRELIABLE: easy or null rung under {threshold:.0%}; no verdict",
                                style="bold red"), None)))
    return lines


def _rungs(tally: dict[str, Any]) -> str:
    """Each rung's passing and answered documents: easy and hard cleared the margin, null tied."""
    rungs = (("easy", "control_cleared", "control_documents"), ("hard", "hard_cleared", "hard_documents"),
             ("null", "null_tied", "null_documents"))
    return ", ".join(f"{name} {'-' if tally[passed] is None else tally[passed]}/{tally[documents]}"
                     for name, passed, documents in rungs)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _task_verdict(task: str, said: dict[str, Any] | None) -> Text:
    """One task's verdict (judge_verdicts): judged with the verdict, UNRELIABLE with its failed rungs, or not
    judged with why, which is no verdict and not an unreliable one."""
    if said is None or said["status"] == "not judged":
        reason = "nothing stored" if said is None else said["reason"]
        return Text(f"task {task}: not judged: {reason}", style="bold")
    if said["status"] == "unreliable":
        return Text(f"task {task}: UNRELIABLE: {said['reason']}", style="bold red")
    verdict = VERDICTS.get(said["verdict"], said["verdict"])
    if task != "hashtags":
        verdict = verdict.replace(" tags ", " outputs ")
    return Text(f"task {task}: {verdict} (trusted: {', '.join(said['trusted'])})", style="bold")


def judge_section(judge: list[dict[str, Any]], verdict: str | None = None,
                  tasks: dict[str, dict[str, Any]] | None = None) -> Group:
    """Per method its tally and ladder; a run with several tasks, or one the judge could not score, gets each
    task's verdict (``tasks``: judge_verdicts rows) above its methods."""
    tasks = tasks or {}
    per_task = len(tasks) > 1 or any(said["status"] == "not judged" for said in tasks.values())
    title = Text("Judge: sidecar vs standalone " + ("outputs, per task and method" if per_task else
                                                      "tags, per method"), style="bold")
    if not judge and not tasks:
        return Group(title, Text("nothing judged: no document had both tag sets parsed, or the judge flow failed"))
    lines = []
    names = sorted({*tasks, *(tally.get("task", "hashtags") for tally in judge)},
                   key=lambda name: (name != "hashtags", name))
    for name in names:
        if per_task:
            lines.append(_task_verdict(name, tasks.get(name)))  # wrapped, not cut: the reason is the point
        lines += _method_lines([tally for tally in judge if tally.get("task", "hashtags") == name])
    if verdict is not None and not per_task:
        said = "UNRELIABLE: no method's controls passed" if verdict == "UNRELIABLE" else VERDICTS.get(verdict, verdict)
        lines.append(line((Text(f"run verdict (trusted methods only): {said}", style="bold"), None)))
    lines.append(Text("Pairwise: two position-swapped games; likelihood: tag-token log probability given the "
                      "summary less given another's. Ladder: own tags against another's (easy), against half "
                      "another's (hard), against themselves reordered (null, must tie).", style="dim"))
    if per_task:
        lines.append(Text("Another task: its outputs in place of the tags, the judge asked by its instruction; a "
                          "task whose outputs give no control (one label for every document) is not judged.",
                          style="dim"))
    return Group(title, *lines)


def _method_lines(judge: list[dict[str, Any]]) -> list[Text]:
    lines = []
    for tally in judge:
        method = tally.get("method", "pairwise")
        lines.append(line(("judge", 7), (f"{tally['judge_model']} ({method}, prompt {tally['prompt_version']})", None)))
        if not tally.get("documents"):
            note = tally.get("note") or "nothing judged"
            lines.append(line((Text(f"UNRELIABLE: {note}", style="bold red"), None)))
            continue
        decided = tally["documents"] - tally["undecided"]
        consistent = f"; position-consistent {tally['consistent']}/{decided}" if method == "pairwise" else ""
        lines.append(Text(
            f"sidecar {tally['wins']} wins, {tally['ties']} ties, {tally['losses']} losses of {tally['documents']}"
            + consistent + (f"; {tally['undecided']} undecided" if tally["undecided"] else "")))
        lines += _judge_quality_lines(tally)
    return lines


def next_steps_section(findings: DemoFindings) -> Group:
    lines = [Text("Look further", style="bold")]
    if findings.html_path is not None:
        lines.append(Text(f"report  {findings.html_path}"))
    lines += [
        Text(f"SQL     duckdb {findings.db_path}"),
        Text(f"        SELECT * FROM results WHERE run_id = '{findings.run_id}';"),
        Text("        (views: results, throughput, judgements, judge_quality, judge_headline, costs)", style="dim"),
    ]
    return Group(*lines)


def render(findings: DemoFindings, console: Console | None = None) -> None:
    """Print the report; at most ``WIDTH`` columns, narrower on a narrower terminal."""
    console = console or Console()
    console.width = min(console.width, WIDTH)
    console.print(Rule(f"sidecar demo: run {findings.run_id}"))
    for section in (documents_section(findings), cost_section(findings.headline, findings.tasks),
                    judge_section(findings.judge, findings.judge_verdict, findings.judge_tasks),
                    next_steps_section(findings)):
        console.print(section)
        console.print()
    console.print(Rule(f"{findings.seconds:.0f} s in all"))
