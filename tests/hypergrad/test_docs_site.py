"""The documentation site (mkdocs.yml): it builds with --strict and documents the public API."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from helpers import ROOT

import hypergrad

pytest.importorskip(
    "mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' to build the site"
)


class _Collector(HTMLParser):
    """Ids of the mkdocstrings object headings and every local link / image of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.object_ids: set[str] = set()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "doc-heading" in (a.get("class") or "").split() and a.get("id"):
            self.object_ids.add(a["id"])
        url = a.get("href") if tag == "a" else a.get("src") if tag == "img" else None
        if url:
            self.urls.append(url)


def _parse(page: Path) -> _Collector:
    collector = _Collector()
    collector.feed(page.read_text(encoding="utf-8"))
    return collector


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _expected_id(name: str) -> str:
    """The heading id of ``hypergrad.<name>`` in the reference.

    A re-exported name that is also a submodule's name (``hypergrad.implicit``) is documented
    at its defining path: Griffe gives the submodule precedence over the re-export.
    """
    obj = getattr(hypergrad, name)
    if not inspect.ismodule(obj) and importlib.util.find_spec(f"hypergrad.{name}") is not None:
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"hypergrad.{name}"


def _public_submodules() -> list[str]:
    """Submodules that ``hypergrad/__init__.py`` re-exports as ``from . import name as name``."""
    tree = ast.parse(Path(hypergrad.__file__).read_text(encoding="utf-8"))
    return [
        f"hypergrad.{alias.name}"
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None
        for alias in node.names
        if alias.asname == alias.name
    ]


def test_reference_documents_every_public_name(site: Path) -> None:
    ids = _parse(site / "reference" / "api" / "index.html").object_ids
    missing = [n for n in hypergrad.__all__ if _expected_id(n) not in ids]
    assert not missing, f"hypergrad.__all__ names missing from docs/reference/api.md: {missing}"
    submodules = _public_submodules()
    assert "hypergrad.testing" in submodules
    for mod_name in submodules:
        module = importlib.import_module(mod_name)
        names = getattr(module, "__all__", None)
        assert names, f"{mod_name} has no __all__ to document"
        missing = [n for n in names if f"{mod_name}.{n}" not in ids]
        assert not missing, f"{mod_name} names missing from docs/reference/api.md: {missing}"


def test_reference_renders_docstring_conventions(site: Path) -> None:
    html = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    # Sphinx roles are rewritten to code spans (docs/_hooks/griffe_conventions.py)
    for role in (":class:", ":func:", ":meth:", ":mod:", ":attr:", ":data:"):
        assert role not in html, f"a raw Sphinx role {role} is shown in the reference"
    # "Example:" sections render as Examples with doctest code blocks, not a run-on paragraph
    prose = re.sub(r"<pre.*?</pre>|<code.*?</code>", "", html, flags=re.S)
    assert "&gt;&gt;&gt;" not in prose, "doctest lines rendered as prose, not as code"
    assert html.count('doc-section-title">Examples') >= 10


def test_local_links_and_images_resolve(site: Path) -> None:
    broken = []
    for page in sorted(site.rglob("*.html")):
        for url in _parse(page).urls:
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            path = unquote(parts.path)
            # 404.html links from the site root (it is served at any depth)
            base = site if path.startswith("/") else page.parent
            target = (base / path.lstrip("/")).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {url}")
    assert not broken, "broken links in the built site:\n" + "\n".join(broken)


def test_docstring_conventions_rewrite() -> None:
    pytest.importorskip("griffe", reason="griffe comes with mkdocstrings[python] (the docs extra)")
    spec = importlib.util.spec_from_file_location(
        "griffe_conventions", ROOT / "docs" / "_hooks" / "griffe_conventions.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = "\n".join(
        [
            "Summary, see :class:`~hypergrad.SolveInfo` and :func:`hypergrad.implicit_grad`.",
            "",
            "Args:",
            "    a, b: shared",
            "        continued.",
            "    c: own.",
            "",
            "Example (a title):",
            "    >>> 1 + 1",
            "    2",
        ]
    )
    assert module.rewrite(doc).split("\n") == [
        "Summary, see `SolveInfo` and `hypergrad.implicit_grad`.",
        "",
        "Args:",
        "    a: shared",
        "        continued.",
        "    b: shared",
        "        continued.",
        "    c: own.",
        "",
        "Examples:",
        "    a title:",
        "",
        "    >>> 1 + 1",
        "    2",
    ]


def _load_hook(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_signatures_are_formatted(site: Path) -> None:
    """Signatures are laid out one parameter a line by the formatter the docs extra installs
    (ruff), not printed as one long line cut off at the code block's edge."""
    html = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    sigs = re.findall(r'<div class="doc-signature[^"]*"[^>]*>(.*?)</div>', html, flags=re.S)
    assert sigs, "no separate signatures in the reference"
    texts = [re.sub(r"<[^>]+>", "", s) for s in sigs]
    first = next(t for t in texts if t.lstrip().startswith("implicit_grad("))
    assert "\n    inner_loss: Loss," in first, first
    longest = max(len(line) for t in texts for line in t.splitlines())
    assert longest <= 80, f"a signature line of {longest} characters (line_length is 76)"


def test_table_identifiers_break_only_at_separators(site: Path) -> None:
    """Identifiers in table cells are not broken mid-word (docs/stylesheets/extra.css) and may
    break after their dots and underscores (docs/_hooks/table_breaks.py)."""
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert "word-break: normal" in css
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'href="../../stylesheets/extra.css"' in page
    assert re.search(r"<td\b[^>]*>\s*<code\b[^>]*>\w+_<wbr>\w", page), "no break points in tables"
    module = _load_hook("table_breaks")
    assert module.break_points("info.extras[x_y]") == "info.<wbr>extras[<wbr>x_<wbr>y]"
    assert module.break_points("0.999 1.5e-3 a.b") == "0.999 1.5e-3 a.<wbr>b"
    html = "<td><code>a.b</code> c.d</td><td><pre><code>e.f</code></pre></td><p><code>g.h</code>"
    assert module.add_table_breaks(html) == (
        "<td><code>a.<wbr>b</code> c.d</td><td><pre><code>e.f</code></pre></td><p><code>g.h</code>"
    )
