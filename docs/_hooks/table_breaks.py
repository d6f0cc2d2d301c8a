"""MkDocs hook: identifiers in table cells break only at their dots, underscores and brackets.

Material lets a code span break anywhere (`code { word-break: break-word }`), so a narrow table
column splits `step2.hyper_convention` or `HypergradInfo` mid-word. `docs/stylesheets/extra.css`
turns that off for tables; this hook then gives long identifiers their natural break points
back, so that a table still fits the page: a `<wbr>` (an optional line break) after every `.`,
`_`, `/`, `[` or `(` that stands between two word characters (not a number's point) inside a
`<code>` of a `<td>` (`step2.hyper.<wbr>official_<wbr>sign`). Only the text between tags is
touched; code blocks (`<pre>`) and everything outside table cells are left alone.
"""

from __future__ import annotations

import re
from typing import Any

_CELL = re.compile(r"(<td\b[^>]*>)(.*?)(</td>)", re.S)
_CODE = re.compile(r"(<code\b[^>]*>)(.*?)(</code>)", re.S)
_TAG = re.compile(r"(<[^>]+>)")
# a separator between word characters, except the point of a number (0.999, 1.5e-3)
_BREAK = re.compile(r"(?<=\w)(?<!\d(?=\.\d))([._/\[(])(?=\w)")


def break_points(text: str) -> str:
    """`text` (HTML without tags) with `<wbr>` after each separator between word characters."""
    return _BREAK.sub(r"\1<wbr>", text)


def _code(match: re.Match[str]) -> str:
    parts = _TAG.split(match.group(2))  # text at even indices, tags at odd ones
    body = "".join(p if i % 2 else break_points(p) for i, p in enumerate(parts))
    return match.group(1) + body + match.group(3)


def _cell(match: re.Match[str]) -> str:
    if "<pre" in match.group(2):
        return match.group(0)
    return match.group(1) + _CODE.sub(_code, match.group(2)) + match.group(3)


def add_table_breaks(html: str) -> str:
    """Every table cell's code spans with break points after their separators."""
    return _CELL.sub(_cell, html)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return add_table_breaks(html)
