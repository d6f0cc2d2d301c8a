"""Structural counts of the library (issue 31's before/after figures).

Usage: python tools/code_metrics.py [PACKAGE_DIR]   (default: hypergrad/ next to this file)

Prints: autograd Function classes, functions over 80 lines, functions with >= 10 parameters,
``type: ignore`` comments, lines of the implicit-differentiation and compiled files, and the
public names of ``hypergrad.__all__`` (read from the source, without importing it).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = [
    "implicit.py", "roots.py", "_core.py", "compiled.py", "compiled_step.py", "implicit/",
]  # fmt: skip


def main(pkg: Path) -> None:
    files = sorted(pkg.rglob("*.py"))
    functions, autograd, long_fns, many_params, ignores = 0, [], [], [], 0
    function_classes: set[str] = set()
    for f in files:
        text = f.read_text(encoding="utf-8")
        ignores += text.count("type: ignore")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(base) for base in node.bases}
                if bases & ({"torch.autograd.Function", "Function"} | function_classes):
                    function_classes.add(node.name)  # a subclass of one counts too
                    autograd.append(f"{f.relative_to(pkg)}:{node.name}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions += 1
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 80:
                    long_fns.append(f"{f.relative_to(pkg)}:{node.name} ({length})")
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                n -= 1 if a.args and a.args[0].arg in ("self", "cls") else 0
                if n >= 10:
                    many_params.append(f"{f.relative_to(pkg)}:{node.name} ({n})")
    core_lines = 0
    for name in CORE:
        p = pkg / name
        if p.is_dir():
            core_lines += sum(len(q.read_text().splitlines()) for q in p.rglob("*.py"))
        elif p.exists():
            core_lines += len(p.read_text().splitlines())
    init = ast.parse((pkg / "__init__.py").read_text())
    public = next(
        (len(n.value.elts) for n in init.body if isinstance(n, ast.Assign)
         and any(getattr(t, "id", "") == "__all__" for t in n.targets)), 0
    )  # fmt: skip
    total = sum(len(f.read_text().splitlines()) for f in files)
    print(f"library lines: {total} in {len(files)} files, {functions} functions")
    print(f"autograd Function classes: {len(autograd)} {autograd}")
    print(f"functions over 80 lines: {len(long_fns)} {long_fns}")
    print(f"functions with >= 10 parameters: {len(many_params)} {many_params}")
    print(f"type: ignore comments: {ignores}")
    print(f"lines of implicit/roots/_core/compiled/compiled_step: {core_lines}")
    print(f"public names (hypergrad.__all__): {public}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "hypergrad")
