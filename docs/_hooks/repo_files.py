"""MkDocs hook: links from docs/*.md to files of the repository outside docs/.

The guide pages are written to read well on a repository browser, so some of them link out of
`docs/` (figures in `../benchmarks/results/`, result folders in `../examples/bort2/results/`).
MkDocs only knows the files under `docs/`, and `mkdocs build --strict` refuses such links. This
hook keeps them working on the site without touching the pages:

* a link or image to a *file* of the repository (not a markdown page) is published with the
  site under `_repo/<path in the repository>`, and the link points there;
* a link to a *folder* or to a markdown file outside `docs/` has nothing to point to on the site:
  with `repo_url` set it becomes a link to that path in the repository, otherwise the link is
  dropped and its text (already the path, in the pages) is kept.

A link to a path that does not exist is left alone, so MkDocs still reports it as broken.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

#: Where published repository files go inside the built site.
SITE_PREFIX = "_repo"

# [text](target) and ![alt](target), target without spaces; an optional "title" may follow.
_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)"
)
_FENCE = re.compile(r"^(```|~~~)")


def _repo_root(config: Any) -> str:
    return os.path.dirname(os.path.abspath(config.config_file_path))


def _outside_target(config: Any, src_uri: str, target: str) -> tuple[str, str] | None:
    """(path relative to the repository root, absolute path) of a link leaving docs/, else None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("/", "#")):
        return None  # external, absolute or same-page
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None
    docs_dir = os.path.abspath(config.docs_dir)
    root = _repo_root(config)
    abs_path = os.path.normpath(os.path.join(docs_dir, os.path.dirname(src_uri), path))
    if abs_path == docs_dir or abs_path.startswith(docs_dir + os.sep):
        return None  # inside docs/: MkDocs handles it
    if not abs_path.startswith(root + os.sep) or not os.path.exists(abs_path):
        return None  # outside the repository or missing: let MkDocs report it
    return os.path.relpath(abs_path, root).replace(os.sep, "/"), abs_path


def _published(abs_path: str) -> bool:
    return os.path.isfile(abs_path) and not abs_path.endswith(".md")


def _links(markdown: str):
    """Markdown links outside fenced code blocks and inline code spans."""
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        without_code = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)
        yield from _LINK.finditer(without_code)


def on_files(files: Files, config: Any) -> Files:
    """Publish every repository file that a page links to from outside docs/."""
    seen: set[str] = set()
    for page_file in list(files.documentation_pages()):
        for match in _links(page_file.content_string):
            found = _outside_target(config, page_file.src_uri, match.group("target"))
            if found is None or not _published(found[1]):
                continue
            rel, abs_path = found
            src_uri = posixpath.normpath(
                posixpath.join(posixpath.dirname(page_file.src_uri), match.group("target"))
            ).split("#", 1)[0]
            if src_uri in seen:
                continue
            seen.add(src_uri)
            # src_uri is what MkDocs resolves the page's link to ("../benchmarks/x.png"), so the
            # link validates and is rewritten to the published copy.
            published = File.generated(
                config, src_uri, abs_src_path=abs_path, inclusion=InclusionLevel.INCLUDED
            )
            published.dest_uri = f"{SITE_PREFIX}/{rel}"
            files.append(published)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Turn links to folders (or markdown files) outside docs/ into repository links or text."""
    lines = markdown.split("\n")
    in_fence = False
    for i, line in enumerate(lines):
        if _FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if in_fence or "](" not in line:
            continue

        def replace(match: re.Match[str]) -> str:
            found = _outside_target(config, page.file.src_uri, match.group("target"))
            if found is None or _published(found[1]) or match.group("bang"):
                return match.group(0)
            rel = found[0] + ("/" if os.path.isdir(found[1]) else "")
            if config.repo_url:
                kind = "tree" if os.path.isdir(found[1]) else "blob"
                url = f"{config.repo_url.rstrip('/')}/{kind}/HEAD/{rel}"
                return f"[{match.group('text')}]({url})"
            return match.group("text") or f"`{rel}`"

        lines[i] = _LINK.sub(replace, line)
    return "\n".join(lines)
