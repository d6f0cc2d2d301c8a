"""Griffe extension used by the API reference (mkdocs.yml): docstring conventions Griffe lacks.

hypergrad's docstrings are Google style, with two habits that Griffe's Google parser does not
understand and would render badly. This extension rewrites them in the text that the API
reference renders (never in the source), and does nothing to a docstring without them:

* ``Example:`` and ``Example (a title):`` section headers. Griffe knows only ``Examples:``; the
  singular (which Napoleon and the Google style guide accept) becomes a plain admonition whose
  ``>>>`` lines run together into one paragraph. They become ``Examples:``, the title (if any)
  becoming the section's first line of text, so doctest lines render as code blocks.
* Items naming several parameters or attributes at once (``lr, betas, eps: ...``, which Napoleon
  accepts): Griffe takes ``lr, betas, eps`` for one unknown name and warns. Each name gets its
  own item, with the shared description.
* Sphinx roles such as ``:class:`~hypergrad.SolveInfo``` and ``:func:`implicit_grad```, which
  Markdown shows with the role name and backticks. They become code spans, shown as Sphinx shows
  them (a leading ``~`` keeps the last dotted component only).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(?P<indent>\s*)Example(?:\s*\((?P<title>.*)\))?:\s*$")
_FIELDS = re.compile(
    r"^\s*(?:Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Parameters"
    r"|Attributes):\s*$"
)
_MULTI = re.compile(
    r"^(?P<indent>\s+)(?P<names>[\w*]+(?:\s*,\s*[\w*]+)+)(?P<rest>\s*(?:\([^)]*\))?:.*)$"
)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(?P<target>[^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match.group("target").strip()
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_items(lines: list[str]) -> list[str]:
    """Expand ``a, b: text`` items of parameter / attribute sections into one item per name."""
    out: list[str] = []
    section_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() and section_indent is not None and _indent(line) <= section_indent:
            section_indent = None
        if _FIELDS.match(line):
            section_indent = _indent(line)
            out.append(line)
            i += 1
            continue
        multi = _MULTI.match(line) if section_indent is not None else None
        if multi is None:
            out.append(line)
            i += 1
            continue
        item_indent = len(multi.group("indent"))
        j = i + 1  # continuation lines: blank or indented deeper than the item
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > item_indent):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():
            j -= 1
        for name in (n.strip() for n in multi.group("names").split(",")):
            out.append(f"{multi.group('indent')}{name}{multi.group('rest')}")
            out.extend(lines[i + 1 : j])
        i = j
    return out


def rewrite(text: str) -> str:
    """The docstring ``text`` with the conventions above rewritten."""
    lines = _split_items(text.split("\n"))
    out: list[str] = []
    for i, line in enumerate(lines):
        header = _HEADER.match(line)
        if header is None:
            out.append(line)
            continue
        indent = header.group("indent")
        out.append(f"{indent}Examples:")
        title = header.group("title")
        if title:
            body = next((nxt for nxt in lines[i + 1 :] if nxt.strip()), indent + "    ")
            body_indent = body[: len(body) - len(body.lstrip())]
            out.extend([f"{body_indent}{title.strip()}:", ""])
    return _ROLE.sub(_role, "\n".join(out))


class DocstringConventions(griffe.Extension):
    """Apply :func:`rewrite` to every docstring Griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
