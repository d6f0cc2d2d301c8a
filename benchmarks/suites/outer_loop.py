"""The whole outer loop of the two real-data examples under each adjoint option: CG products and
hypergradient time per outer step, and the final test accuracy.

``examples/hyper_cleaning.py`` (implicit part only, ``--no-unrolled``) cold, with ``--warm-start``
(the previous adjoint) and ``--warm-start extrapolate`` (``2 x_k - x_(k-1)``);
``examples/weight_decay.py`` with the same three, ``--precond dense`` (``hg.DensePreconditioner``),
``--solver exact`` and ``--solver compiled-exact`` (compiled once per shape of theta, the
compilation in the first call's time).
Each configuration runs in a fresh process (one torch thread; inductor's cache as it is).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import kit

RUNS_ = {
    "hyper_cleaning": {
        "cold CG": [],
        "warm start": ["--warm-start"],
        "extrapolated warm start": ["--warm-start", "extrapolate"],
    },
    "weight_decay": {
        "cold CG": [],
        "warm start": ["--warm-start"],
        "extrapolated warm start": ["--warm-start", "extrapolate"],
        "dense preconditioner": ["--precond", "dense"],
        "Exact": ["--solver", "exact"],
        "compiled Exact": ["--solver", "compiled-exact"],
    },
}
EXTRA = {"hyper_cleaning": ["--no-unrolled", "--no-progress"], "weight_decay": []}
OPTIONS = dict(examples=list(RUNS_))
QUICK = dict()


def series(example: str, out: Path) -> dict:
    """Per outer step: hypergradient wall time and CG iterations; final test accuracy."""
    res = json.loads((out / "results.json").read_text())
    if example == "hyper_cleaning":
        hist = json.loads((out / "history.json").read_text())
        acc = res["test_accuracy"]
        return {
            "phases": {
                "implicit": {
                    "time_s": [h["hypergrad_time_s"] for h in hist],
                    "cg_iterations": [h["cg_iterations"] for h in hist],
                    "test_acc": acc["cleaner"],
                }
            }
        }
    phases = {}
    for d in res["results"]:
        for part in ("scalar", "per_feature"):
            r = d[part]
            phases[f"{d['dataset']} {part}"] = {
                "time_s": [h["hypergrad_time_s"] for h in r["history"]],
                "cg_iterations": [h["cg_iterations"] for h in r["history"]],
                "test_acc": r["test_acc"],
            }
    return {"phases": phases}


def measure(o: dict, out: Path, name: str) -> None:
    runs = []
    for example in o["examples"]:
        for label, args in RUNS_[example].items():
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, f"examples/{example}.py", *args, *EXTRA[example]]
                cmd += ["--out", tmp] + (["--quick"] if o["quick"] else [])
                kit.log(" ".join(cmd[1:]))
                t0 = time.perf_counter()
                subprocess.run(cmd, cwd=kit.ROOT, check=True, capture_output=True, text=True)
                rec = {"example": example, "config": label, "args": args}
                rec.update(series(example, Path(tmp)), wall_s=time.perf_counter() - t0)
            runs.append(rec)
            kit.save(out / f"{name}.json", {"options": o, "runs": runs})
