"""The report's text from its Jinja2 templates: one template (``templates/cost_report.j2``) written once, rendered
as markdown and as HTML, so the file and the page say the same in the same order.

The template writes its blocks (headings, paragraphs, bullets, tables, images) with the macros of a format:
``templates/markdown.j2`` or ``templates/html.j2``, whose environment autoescapes. Undefined names fail
loudly (``StrictUndefined``); numbers are written by the named filters of ``study.report.filters``. Prose may
be wrapped in a template as it reads best: a paragraph's whitespace is squashed to single spaces, every line is
stripped, and blocks are set apart by one blank line (markdown) or a line break (HTML).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from study.report.filters import FILTERS

Format = Literal["markdown", "html"]
BLOCK = "\ue000"  # a private-use character: where one block of the document ends and the next begins
SEPARATORS: dict[Format, str] = {"markdown": "\n\n", "html": "\n"}


def squash(text: str) -> str:
    """Whitespace runs to single spaces, ends stripped; markup stays markup."""
    squashed = " ".join(text.split())
    return Markup(squashed) if isinstance(text, Markup) else squashed


def md_cell(value: Any) -> str:
    """A markdown table cell: a '|' inside it is escaped."""
    return str(value).replace("|", "\\|")


@functools.cache
def environment(fmt: Format) -> Environment:
    env = Environment(
        loader=PackageLoader("study.report", "templates"),
        autoescape=fmt == "html",
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(FILTERS, squash=squash, md_cell=md_cell)
    env.globals["BLOCK"] = BLOCK
    return env


def render(template: str, fmt: Format, **context: Any) -> str:
    """``template`` rendered in ``fmt``, its blocks laid out as the format wants them."""
    env = environment(fmt)
    doc = env.get_template(f"{fmt}.j2").module
    text = env.get_template(template).render(doc=doc, **context)
    blocks = ("\n".join(line.strip() for line in chunk.splitlines() if line.strip()) for chunk in text.split(BLOCK))
    return SEPARATORS[fmt].join(block for block in blocks if block) + "\n"
