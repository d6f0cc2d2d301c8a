"""The one entry point of the benchmarks.

    python -m benchmarks [SUITE ...] [--quick] [--set KEY=VALUE ...] [--tag TAG]
    python -m benchmarks report [SUITE ...] [--docs]
    python -m benchmarks benchopt --bench-dir PATH [--quick]   (benchmarks/benchopt/race.py)

Suites (all, in this order, when none is named): peers, time_to_accuracy, outer_loop, overhead,
memory, hvp_cost, solver_accuracy, diagnostics, roots (custom_root / fixed points against jaxopt,
torchopt and torchdeq), gpu (CUDA only: writes nothing without a GPU; see docs/performance.md),
whole_loop (the whole outer loop, time to the same validation loss, against jaxopt and a
torch user loop) and first_call (compile_implicit_grad's first call in fresh processes, cold and
warm inductor cache, against eager implicit_grad).
The BORT² ones are in examples/bort2/scripts/. The peer libraries need the ``[bench]`` extra
(``pip install -e ".[bench]"``); without it their rows are marked unsupported (not installed).
Each writes JSON (``results/<suite><tag>.json``; the peer suite ``results/peers/<problem>.json``),
which the report turns into ``<name>.md`` tables and ``<name>.png`` plots. ``--quick``: reduced
settings, into ``results/quick/``; a no-argument ``--quick`` run leaves out outer_loop (it runs
the two example scripts end to end, nine times: name it to run it). A full run also writes the
suite's variants (``RUNS``, e.g. ``overhead_mlp_reps25``); ``--set`` changes suite options
(``--set ks=5,50 problems=mlp_fashion``) for one run under ``--tag``. ``report --docs`` rewrites
the peer block of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
import warnings
from pathlib import Path

from benchmarks import kit, report

SUITES = "peers time_to_accuracy outer_loop overhead memory hvp_cost solver_accuracy".split()
SUITES.append("diagnostics")
SUITES.append("roots")  # roots and fixed points against jaxopt, torchopt, torchdeq
SUITES.append("gpu")  # the prepared GPU run; device=auto skips it without CUDA
SUITES.append("whole_loop")  # the whole outer loop against jaxopt and a torch user loop
SUITES.append("first_call")  # compile_implicit_grad's first call, cold and warm cache
SUITES.append("meta_cost")  # one HyperStep meta step per method, in forward+backward units
QUICK_SKIP = ["outer_loop"]  # left out of a no-argument --quick run (only when named)


def parse_value(text, default):
    """An option's value from ``--set`` text; a ``RUNS`` entry's value is already typed."""
    if not isinstance(text, str):
        return text
    if isinstance(default, bool):
        return text.lower() in ("1", "true", "yes", "on")
    if isinstance(default, list):
        kind = type(default[0]) if default else str
        return [kind(x) for x in text.split(",") if x]
    return type(default)(text)


def options(mod, quick: bool, changes: dict, threads: int) -> dict:
    o = {**mod.OPTIONS, **(mod.QUICK if quick else {})}
    for key, text in changes.items():  # keys of other named suites are left to them
        if key in o:
            o[key] = parse_value(text, o[key])
    return {**o, "quick": quick, "threads": threads}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["benchopt"]:  # the race on benchopt's benchmark_bilevel: its own CLI
        from benchmarks.benchopt.race import main as race

        return race(argv[1:])
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser("python -m benchmarks", description=__doc__, formatter_class=raw)
    ap.add_argument("suites", nargs="*", metavar="SUITE", help="report, or suites to run")
    quick_help = "reduced settings, into results/quick/; with no SUITE, all but outer_loop"
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="suite options")
    ap.add_argument("--tag", default="", help="suffix of the result names (with --set)")
    ap.add_argument("--threads", type=int, default=1, help="torch and XLA threads (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="results folder")
    ap.add_argument("--docs", action="store_true", help="report: rewrite docs/benchmarks.md")
    args = ap.parse_args(argv)
    render_only = args.suites[:1] == ["report"]
    names = args.suites[1:] if render_only else args.suites
    if unknown := sorted(set(names) - set(SUITES)):
        ap.error(f"unknown suite(s) {unknown}; choose from report, {', '.join(SUITES)}")
    out = args.out or (kit.RESULTS / "quick" if args.quick else kit.RESULTS)
    kit.set_threads(args.threads)
    warnings.filterwarnings("ignore")  # peers' deprecation warnings on every call
    if any("=" not in kv for kv in args.set):
        ap.error("--set takes KEY=VALUE pairs (name the suites before --set)")
    changes = dict(kv.split("=", 1) for kv in args.set)
    default = [s for s in SUITES if not (args.quick and s in QUICK_SKIP)]
    mods = {s: importlib.import_module(f"benchmarks.suites.{s}") for s in names or default}
    known = {k for m in mods.values() for k in m.OPTIONS}
    if set(changes) - known:
        ap.error(f"no option(s) {sorted(set(changes) - known)}; options: {sorted(known)}")
    failed, t_all = [], time.perf_counter()
    for suite, mod in mods.items():
        one_run = args.quick or changes or args.tag
        for tag, change in [(args.tag, changes)] if one_run else getattr(mod, "RUNS", [("", {})]):
            name, t0 = suite + tag, time.perf_counter()
            try:
                if not render_only:
                    kit.log(f"=== {name}")
                    mod.measure(options(mod, args.quick, change, args.threads), out, name)
                md = report.render(suite, out, name)
                if suite == "peers" and args.docs and md:
                    report.update_docs(md)
                kit.log(f"=== {name} done in {time.perf_counter() - t0:.0f} s")
            except Exception as e:  # noqa: BLE001 - the other suites still run
                traceback.print_exc()
                failed.append(f"{name} ({kit.err_text(e)})")
                kit.log(f"=== {name} FAILED: {kit.err_text(e)}")
    kit.log(f"all done in {time.perf_counter() - t_all:.0f} s; results in {out}")
    if failed:
        print("failed:\n  " + "\n  ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
