"""``reproducible=true``: the same numbers whatever CPU level the machine has.

Each run is a subprocess whose environment emulates a CPU of one level: ATen's kernels
(``ATEN_CPU_CAPABILITY``), oneDNN's (``ONEDNN_MAX_CPU_ISA``) and MKL's
(``MKL_ENABLE_INSTRUCTIONS``) capped at that level, as on a CPU that has nothing above it. The
mode must give bitwise identical weights, accuracies and printed tables under every level this
machine can emulate (default, AVX2, and AVX-512 where the CPU has it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import RUN_PY

#: level -> the environment of a CPU that has nothing above it
LEVELS = {
    "default": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}
_ORDER = ["default", "avx2", "avx512"]


def emulated_levels() -> list[str]:
    """The levels this machine can run: every one up to the kernels torch picks here."""
    top = torch.backends.cpu.get_cpu_capability().lower()
    if top not in _ORDER:  # another architecture (ARM, POWER, s390x): nothing to emulate
        return []
    return _ORDER[: _ORDER.index(top) + 1]


def tiny(data_root, out, *extra):
    return [
        "preset=smoke",
        "step1.iters=12",
        "step2.iters=12",
        "checkpoint_every=12",
        "eval_every=12",
        "step2.warmup=2",
        "step2.hyper.every=4",
        "data.max_test=64",
        "progress=false",
        f"data.root={data_root}",
        f"output_dir={out}",
        *extra,
    ]


def run(args: list[str], level: str) -> dict:
    """Run the pipeline under ``level``'s environment; its table, accuracies and weights."""
    env = {k: v for k, v in os.environ.items() if k not in _pinned_names()}
    env.update(LEVELS[level])
    done = subprocess.run(
        [sys.executable, str(RUN_PY), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = Path(next(a for a in args if a.startswith("output_dir=")).split("=", 1)[1])
    payload = json.loads((out / "results.json").read_text())
    h = hashlib.sha256()
    for p in sorted(out.rglob("final.pt")):
        state = torch.load(p, map_location="cpu", weights_only=False)["model"]
        for k in sorted(state):
            h.update(k.encode())
            h.update(state[k].detach().contiguous().numpy().tobytes())
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    return {
        "table": table,
        "acc": [(r["stage"], r["acc"], r["best_acc"]) for r in payload["results"]],
        "weights": h.hexdigest(),
        "environment": payload["environment"],
    }


def _pinned_names() -> tuple[str, ...]:
    from bort2.reproducible import MARKER, pinned_env

    return (*pinned_env(1), MARKER, "MKL_ENABLE_INSTRUCTIONS")


def _check_identical(runs: dict[str, dict]) -> None:
    first, *rest = runs
    for level in rest:
        for what in ("table", "acc", "weights"):
            assert runs[level][what] == runs[first][what], (
                f"reproducible=true: {what} under {level} differs from {first}"
            )
    for r in runs.values():
        env = r["environment"]
        assert env["reproducible"] is True
        assert env["cpu_capability"] == "DEFAULT"
        assert env["deterministic_algorithms"] is True
        assert env["variables"]["MKL_CBWR"] == "COMPATIBLE"
        assert env["threads"] == 1


def test_reproducible_identical_across_cpu_levels(data_root, tmp_path):
    """The lowest and the highest level this machine has: the same bits (a fast variant of the
    slow test below, which adds AVX2, the smoke preset and the runs without the mode)."""
    levels = emulated_levels()
    if len(levels) < 2:
        pytest.skip("this CPU has one level of torch kernels only")
    runs = {
        level: run(tiny(data_root, tmp_path / level, "reproducible=true"), level)
        for level in (levels[0], levels[-1])
    }
    _check_identical(runs)


@pytest.mark.slow
def test_reproducible_smoke_every_level(data_root, tmp_path):
    """``preset=smoke`` under every level: identical with the mode. Without it the levels'
    numbers are recorded (printed), not asserted: they may or may not differ."""
    levels = emulated_levels()
    if len(levels) < 2:
        pytest.skip("this CPU has one level of torch kernels only")
    base = ["preset=smoke", "progress=false", f"data.root={data_root}"]
    pinned = {
        level: run([*base, f"output_dir={tmp_path / ('r_' + level)}", "reproducible=true"], level)
        for level in levels
    }
    _check_identical(pinned)
    free = {level: run([*base, f"output_dir={tmp_path / level}"], level) for level in levels}
    for level, r in free.items():
        assert r["environment"]["reproducible"] is False
        same = r["weights"] == pinned[levels[0]]["weights"]
        print(f"without reproducible=true, {level}: {r['acc']} (equal to the mode's: {same})")


def test_reproducible_refuses_threads_0(data_root, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(RUN_PY),
            *tiny(data_root, tmp_path / "x", "reproducible=true"),
            "threads=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "threads=0" in done.stderr and "fixed thread count" in done.stderr
    assert not (tmp_path / "x").exists()


def test_reproducible_in_process_after_torch_is_refused(monkeypatch):
    """``main([...])`` from Python, torch imported and the variables unset: refused (the pins
    would not take effect), not silently ignored; ``main()`` as a command restarts instead."""
    from bort2 import reproducible
    from bort2.config import ConfigError

    names = _pinned_names()  # a plain copy of the environment: nothing leaks into other tests
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in names})
    with pytest.raises(ConfigError, match="before torch is imported"):
        reproducible.pin(1, entry=False)
    assert "ATEN_CPU_CAPABILITY" not in os.environ

    class Restarted(Exception):
        pass

    def execv(exe, argv):
        raise Restarted(exe, argv)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(Restarted) as restarted:
        reproducible.pin(2, entry=True)
    assert restarted.value.args[0] == sys.executable
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"
    assert os.environ["OMP_NUM_THREADS"] == "2"
    assert os.environ[reproducible.MARKER] == "1"
    reproducible.pin(2, entry=True)  # pinned already (the restarted process): nothing to do


def test_reproducible_is_not_resumable():
    """It changes the numbers: a resume may not switch it, and ``reproducible=true`` is in the
    fingerprints."""
    import dataclasses

    from bort2.checkpoint import config_fingerprint
    from bort2.config import KEYS, flat_keys, load_config, spell
    from bort2.rundir import RESUMABLE_KEYS

    assert "reproducible" not in RESUMABLE_KEYS and not KEYS["reproducible"].resumable
    off, on = load_config(None, []), load_config(None, ["reproducible=true"])
    assert config_fingerprint(off, "step1/source_only") != config_fingerprint(
        on, "step1/source_only"
    )

    # at its default it is left out: checkpoints from before the key existed still match
    def version_1(cfg):  # the layout checkpoint fingerprints hash
        return spell(flat_keys(dataclasses.asdict(cfg)), 1)

    assert "reproducible" not in version_1(off) and version_1(on)["reproducible"] is True
