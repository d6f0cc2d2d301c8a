"""Run every hypergrad benchmark in sequence (each in its own process) and summarise.

Runs ``solver_accuracy.py``, ``overhead.py``, ``hvp_cost.py`` and ``memory.py`` with the same
``--quick`` / ``--threads`` flags, then prints the key numbers read back from the JSON files in
``benchmarks/results/``. ``docs/performance.md`` is written by hand from these numbers (it quotes
them and explains them); re-running this script regenerates the JSON/PNG files it embeds.

Timing benchmarks (overhead, hvp_cost) are sensitive to other load on the machine: they are run
one at a time, never in parallel with each other.

Usage::

    python benchmarks/run_all.py [--quick] [--only overhead hvp_cost] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("solver_accuracy", "overhead", "hvp_cost", "memory")


def summary(quick: bool) -> str:
    suffix = "_quick" if quick else ""
    res = HERE / "results"
    lines = []
    p = res / f"solver_accuracy{suffix}.json"
    if p.exists():
        d = json.loads(p.read_text())
        lines.append(
            "solver_accuracy: log-log slope of iterations to 1e-6 vs kappa: "
            + ", ".join(f"{m} {s:.2f}" for m, s in d["slopes"].items() if s is not None)
        )
    p = res / f"overhead{suffix}.json"
    if p.exists():
        d = json.loads(p.read_text())
        for r in d["records"]:
            lines.append(
                f"overhead: {r['model']} {r['solver']} K={r['K']}: library/hand "
                f"{r['ratio_of_medians']:.3f} (target <= {d['target']})"
            )
    p = res / f"hvp_cost{suffix}.json"
    if p.exists():
        d = json.loads(p.read_text())
        for m, r in d["models"].items():
            rat = r["ratio_to_gradient"]
            lines.append(
                f"hvp_cost: {m}: reuse HVP {rat['reuse_hvp']:.2f}x gradient "
                f"(target <= {d['target_reuse']}), recompute {rat['recompute_hvp']:.2f}x"
            )
    p = res / f"memory{suffix}.json"
    if p.exists():
        d = json.loads(p.read_text())
        for m, f in d["fits"].items():
            lines.append(f"memory: {m}: {f['mib_per_step']:.2f} MiB per inner step")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument(
        "--only", nargs="+", choices=SCRIPTS, default=list(SCRIPTS), help="subset to run"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every benchmark")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    failed = []
    for name in args.only:
        cmd = [sys.executable, str(HERE / f"{name}.py")]
        if args.quick:
            cmd.append("--quick")
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.no_plot:
            cmd.append("--no-plot")
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=HERE).returncode
        print(f"=== {name}: exit {rc} after {time.perf_counter() - t0:.0f}s", flush=True)
        if rc:
            failed.append(name)
    print("\n=== summary\n" + summary(args.quick))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
