"""The built wheel is what a user gets: every package file, the PEP 561 marker, and a working
quickstart when installed into a fresh environment.

The wheel is built with ``python -m build --wheel --no-isolation --skip-dependency-check``:
isolation would download setuptools, and the test must run offline; the dependency check is
skipped because ``[build-system] requires`` lists ``wheel``, which setuptools >= 70.1 no longer
needs (it builds wheels itself and vendors ``wheel``), so an environment with a recent setuptools
and no separate ``wheel`` distribution builds fine but fails the check. The build runs in a
clean copy of the packaging inputs (``pyproject.toml``, ``README.md``, ``hypergrad/``) under
``tmp_path``, not in the checkout: a build in the checkout reuses ``build/lib``, whose stale
copies of earlier builds' files would be zipped too and could hide a package file that the
current configuration no longer ships.

It is installed with ``pip install --no-deps --no-index`` into a fresh venv that sees the
*running interpreter's* packages (torch, torchopt, numpy come from there, nothing is
downloaded): the venv is made without system site-packages and a ``.pth`` file in its
site-packages lists the running interpreter's site-packages folders. ``--system-site-packages``
would not do: when the tests run in a virtual environment (what most users do, and what
``.ci/run`` does), the "system" site-packages are those of the base Python, which need not have
torch at all. A ``.pth`` line that is a folder only appends that folder to ``sys.path``, after
the venv's own site-packages, and does not process the ``.pth`` files inside it, so the
checkout's editable install (an ``__editable__.torch_hypergrad-*.pth`` import hook there) is not
activated in the venv. The test does not rely on that reasoning alone: it runs from a working
directory outside the checkout without ``PYTHONPATH`` and asserts that the resolved
``hypergrad.__file__`` (and a subpackage's) lies in the venv, and that torch is importable there.
The same works when the tests run on a system Python (its site-packages are listed the same way).

Time: 13-16 s measured on a 2-core CPU machine (venv with pip ~4 s, wheel build and install
under 1 s each, the import probe ~2.5 s, the quickstart ~3.5 s, pytest overhead), well under a
minute, so it is not marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "hypergrad"


def _env() -> dict[str, str]:
    """The current environment without anything that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc


def _source_files() -> set[str]:
    """Every ``hypergrad/**/*.py`` of the checkout, as wheel member names."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        PACKAGE, src / "hypergrad", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
            "--outdir", str(dist),
        ],
        cwd=src,
    )  # fmt: skip
    wheels = sorted(dist.glob("torch_hypergrad-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {dist}, got {wheels}"
    return wheels[0]


def _venv_python(env_dir: Path) -> Path:
    sub = "Scripts/python.exe" if os.name == "nt" else "bin/python"
    return env_dir / sub


def _parent_site_dirs() -> list[str]:
    """The running interpreter's site-packages folders (a venv's or a system Python's, and the
    user site when enabled), plus any other ``site-packages``/``dist-packages`` folder on
    ``sys.path``; never the checkout itself."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs += [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    out: list[str] = []
    for d in dirs:
        path = Path(d).resolve()
        if path.is_dir() and path != ROOT.resolve() and str(path) not in out:
            out.append(str(path))
    return out


def _make_venv(env_dir: Path) -> Path:
    """A fresh venv (with pip) whose imports fall back on the running interpreter's packages."""
    venv.EnvBuilder(system_site_packages=False, with_pip=True).create(env_dir)
    python = _venv_python(env_dir)
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=env_dir,
    ).stdout.strip()
    (Path(purelib) / "_hypergrad_test_parent_site.pth").write_text(
        "".join(d + "\n" for d in _parent_site_dirs())
    )
    return python


def test_wheel_installs_and_runs_quickstart(tmp_path: Path) -> None:
    assert (PACKAGE / "py.typed").is_file(), "hypergrad/py.typed is missing from the checkout"
    wheel = _build_wheel(tmp_path)

    with zipfile.ZipFile(wheel) as zf:
        members = set(zf.namelist())
    missing = sorted(_source_files() - members)
    assert not missing, f"the wheel lacks package files: {missing}"
    assert "hypergrad/py.typed" in members, "the wheel lacks hypergrad/py.typed (PEP 561)"
    top = {m.split("/", 1)[0] for m in members}
    strays = sorted(t for t in top if t != "hypergrad" and not t.endswith(".dist-info"))
    assert not strays, f"the wheel ships more than the hypergrad package: {strays}"

    env_dir = tmp_path / "venv"
    python = _make_venv(env_dir)
    _run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        cwd=tmp_path,
    )

    work = tmp_path / "work"  # outside the checkout: no implicit `import hypergrad` from cwd
    work.mkdir()
    probe = (
        "import json, pathlib, sys, torch, hypergrad, hypergrad.solvers\n"
        "print(json.dumps({'file': str(pathlib.Path(hypergrad.__file__).resolve()),\n"
        "                  'solvers': str(pathlib.Path(hypergrad.solvers.__file__).resolve()),\n"
        "                  'prefix': str(pathlib.Path(sys.prefix).resolve())}))\n"
    )
    found = json.loads(_run([str(python), "-c", probe], cwd=work).stdout.strip().splitlines()[-1])
    venv_root = env_dir.resolve()
    assert Path(found["prefix"]) == venv_root, found
    for key in ("file", "solvers"):
        path = Path(found[key])
        assert path.is_relative_to(venv_root), (
            f"hypergrad imported from {path}, not from the venv {venv_root}: the checkout "
            "(editable install or cwd) shadows the installed wheel"
        )
        assert not path.is_relative_to(ROOT), path
    assert (Path(found["file"]).parent / "py.typed").is_file(), "py.typed not installed"

    quickstart = work / "quickstart.py"
    shutil.copy2(ROOT / "examples" / "quickstart.py", quickstart)
    out = _run([str(python), str(quickstart)], cwd=work).stdout
    assert "closed form:" in out, out
    assert "CG(tol=1e-12)" in out and "unrolled SGD" in out, out
