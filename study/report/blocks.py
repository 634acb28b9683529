"""Document blocks (headings, paragraphs, bullets, tables, images) and their markdown and HTML renderings.

The report is written once as a list of blocks, so the markdown file and the HTML page say the same in
the same order. The HTML page is self-contained: its images are embedded as data URIs.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Image:
    path: Path
    alt: str


Block = Heading | Paragraph | Bullets | Table | Image


def render_markdown(blocks: Sequence[Block]) -> str:
    parts = []
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            parts.append(block.text)
        elif isinstance(block, Bullets):
            parts.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(block.headers) + " |", "|" + "---|" * len(block.headers)]
            lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in block.rows]
            parts.append("\n".join(lines))
        else:
            parts.append(f"![{block.alt}]({block.path.name})")
    return "\n\n".join(parts) + "\n"


# Compact enough that the verdict table and the plot after it share a laptop's first screen.
_HTML_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 1rem auto; padding: 0 1rem; color: #222; }
h1 { font-size: 1.75rem; margin: 0.5rem 0; }
table { border-collapse: collapse; margin: 0.75rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.6rem; text-align: right; }
td { white-space: nowrap; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1rem 0; }
img { max-width: 100%; max-height: 55vh; }
"""


def render_html(blocks: Sequence[Block], title: str) -> str:
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_HTML_STYLE}</style></head><body>",
    ]
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            parts.append(f"<p>{html.escape(block.text)}</p>")
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
            body = "".join(
                "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in block.rows
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            encoded = base64.b64encode(block.path.read_bytes()).decode("ascii")
            parts.append(f'<figure><img alt="{html.escape(block.alt)}" src="data:image/png;base64,{encoded}"></figure>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def fmt(value: float | None, digits: int = 3) -> str:
    """Significant digits for small numbers, thousands separators for large ones, a dash for none."""
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_usd(value: float | None) -> str:
    return "–" if value is None else f"${value:.4f}"
