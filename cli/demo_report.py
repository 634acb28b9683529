"""The report ``sidecar demo`` ends with: what the run found, readable in 30 seconds in 80 columns.

Per document a summary head and both tag sets; the cost report's headline (tag tokens per second and
dollars per million tag tokens, sidecar against standalone, and the KV a request keeps with the
document evicted or attended); the judge's tally, its controls and whether it is reliable; then where to
look further. Every line is cut to the
console's width (at most ``WIDTH``), never wrapped: a table that wraps a summary one word per line is
what this replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.rule import Rule
from rich.text import Text

WIDTH = 80
MB = 1e6


@dataclass(frozen=True)
class DemoFindings:
    """What the closing report shows, read from the database and the cost report's files."""

    run_id: str
    db_path: Path
    rows: list[dict[str, Any]]
    # per judge model and prompt version: Database.judge_tally's row with the judge_quality row's control
    # documents, accuracy, position bias, margin and threshold, and ``preference_ci`` (None without one)
    judge: list[dict[str, Any]]
    # the cost report's headline.json (study.report.Headline as a dict); None when it was not written
    headline: dict[str, Any] | None
    html_path: Path | None
    seconds: float


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


def documents_section(findings: DemoFindings) -> Group:
    lines = [Text(f"{len(findings.rows)} documents: title, summary head, sidecar and standalone tags", style="bold")]
    for row in findings.rows:
        lines += [
            line((Text(row["doc_id"], style="bold"), 12), (Text(row.get("title") or "", style="bold"), None)),
            line(("  summary", 12), (summary_head(row["summary"] or ""), None)),
            line((Text("  sidecar", style="cyan"), 12), (tags_text(row["sidecar_tags"]), None)),
            line((Text("  standalone", style="magenta"), 12), (tags_text(row["standalone_tags"]), None)),
        ]
    return Group(*lines)


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}"


def cost_section(headline: dict[str, Any] | None) -> Group:
    title = Text("Cost of the tagging phase", style="bold")
    if headline is None:
        return Group(title, Text("no cost report headline (the cost-report flow did not complete)"))
    batches = ", ".join(map(str, headline["batch_sizes"]))
    title.append(f" ({headline['basis']} on {headline['gpu_type']}, batch {batches})", style="")
    widths = (12, 11, 16, None)

    def row(*texts: str | Text) -> Text:
        return line(*zip(texts, widths, strict=True))

    kv_evicted, kv_attended = headline.get("kv_evicted_bytes"), headline.get("kv_attended_bytes")
    kv_standalone = headline.get("kv_standalone_bytes")
    rows = [
        row(*(Text(h, style="dim") for h in ("", "tag tok/s", "$ / 1M tag tok", "KV per request"))),
        row("sidecar", _number(headline["sidecar_tokens_per_s"]), _usd(headline["sidecar_usd_per_mtok"]),
            f"{_number(kv_evicted and kv_evicted / MB, 2)} MB evicted"),
        row("", "", "", f"{_number(kv_attended and kv_attended / MB, 2)} MB attended"),
        row("standalone", _number(headline["standalone_tokens_per_s"]), _usd(headline["standalone_usd_per_mtok"]),
            f"{_number(kv_standalone and kv_standalone / MB, 2)} MB"),
    ]
    saving = (1 - headline["standalone_tokens_per_s"] / headline["sidecar_tokens_per_s"]) * 100
    verdict = f"a sidecar tag token costs {abs(saving):.0f}% {'less' if saving >= 0 else 'more'} than a standalone one"
    if kv_evicted and kv_attended:
        verdict += f"; evicting the document frees {1 - kv_evicted / kv_attended:.0%} of the KV"
    if headline["sidecar_usd_per_mtok"] is None:
        verdict += " (no catalog price for this device: compared in device time)"
    return Group(title, *rows, Text(verdict))


def _judge_quality_lines(tally: dict[str, Any]) -> list[Text]:
    """The mean preference with its interval, the controls, the position bias and, plainly, UNRELIABLE."""
    lines = []
    if tally["mean_preference"] is not None:
        ci = tally["preference_ci"]
        interval = "" if ci is None else f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})"
        margin = "" if tally["margin"] is None else f"; tie within {tally['margin']:.3f} of 0.5"
        lines.append(line((f"preference for the sidecar {tally['mean_preference']:.3f}{interval}{margin}", None)))
    accuracy = tally["control_accuracy"]
    bias = "-" if tally["position_bias"] is None else f"{tally['position_bias']:.2f}"
    controls = ("no control answered" if accuracy is None
                else f"accuracy {accuracy:.2f} over {tally['control_documents']} documents")
    lines.append(line((f"controls: {controls}; position bias {bias} (0.5 = none)", None)))
    if not tally["reliable"]:
        threshold = tally["threshold"] if tally["threshold"] is not None else 0.75
        lines.append(line((Text(f"UNRELIABLE: control accuracy below {threshold:.2f}; the verdicts above "
                                "measure nothing", style="bold red"), None)))
    return lines


def judge_section(judge: list[dict[str, Any]]) -> Group:
    title = Text("Judge: sidecar vs standalone tags, two position-swapped games each", style="bold")
    if not judge:
        return Group(title, Text("nothing judged: no document had both tag sets parsed, or the judge flow failed"))
    lines = []
    for tally in judge:
        decided = tally["documents"] - tally["undecided"]
        lines.append(line(("judge", 7), (f"{tally['judge_model']} (prompt {tally['prompt_version']})", None)))
        lines.append(Text(
            f"sidecar {tally['wins']} wins, {tally['ties']} ties, {tally['losses']} losses of {tally['documents']}"
            f"; position-consistent {tally['consistent']}/{decided}"
            + (f"; {tally['undecided']} undecided" if tally["undecided"] else "")))
        lines += _judge_quality_lines(tally)
    lines.append(Text("Controls: each document's own tags against another's, in both orders.", style="dim"))
    return Group(title, *lines)


def next_steps_section(findings: DemoFindings) -> Group:
    lines = [Text("Look further", style="bold")]
    if findings.html_path is not None:
        lines.append(Text(f"report  {findings.html_path}"))
    lines += [
        Text(f"SQL     duckdb {findings.db_path}"),
        Text(f"        SELECT * FROM results WHERE run_id = '{findings.run_id}';"),
        Text("        (views: results, throughput, judgements, judge_quality, costs)", style="dim"),
    ]
    return Group(*lines)


def render(findings: DemoFindings, console: Console | None = None) -> None:
    """Print the report; at most ``WIDTH`` columns, narrower on a narrower terminal."""
    console = console or Console()
    console.width = min(console.width, WIDTH)
    console.print(Rule(f"sidecar demo: run {findings.run_id}"))
    for section in (documents_section(findings), cost_section(findings.headline), judge_section(findings.judge),
                    next_steps_section(findings)):
        console.print(section)
        console.print()
    console.print(Rule(f"{findings.seconds:.0f} s in all"))
