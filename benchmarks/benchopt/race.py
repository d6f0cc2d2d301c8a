"""The race on benchopt's ``benchmark_bilevel``: hypergrad's solvers beside the benchmark's own,
on its harness and its metrics (``python -m benchmarks benchopt --bench-dir PATH``).

Given a local checkout of ``benchopt/benchmark_bilevel`` (its code is never copied here), this

1. installs our files into the checkout: ``solvers/hypergrad_*.py``, ``datasets/hg_regsel.py``,
   ``benchmark_utils/hypergrad_problems.py`` (``torch_problems.py``) and
   ``benchmark_utils/hypergrad_solver.py`` (``hg_solver.py``);
2. writes Fashion-MNIST as the checkout's ``mnist.pkl`` (the file its ``mnist`` dataset reads
   before it would download MNIST), from the Debian package ``dataset-fashion-mnist``;
3. runs, per problem, one ``benchopt run`` of all solvers (one thread: ``OMP_NUM_THREADS=1``,
   XLA's CPU pool off, ``torch.set_num_threads(1)``) through ``launch.py``, whose timer waits
   for JAX's asynchronous results before reading the clock;
4. reads the result parquet into time-to-suboptimality tables (``tables.py``), curves and the
   loss check (torch losses against ``f_inner`` / ``f_outer`` at random points), written to
   ``benchmarks/results/benchopt/`` (``--quick``: ``.../quick/``).

The solver settings are the benchmark's tuned ones (``config/*_021424_best_params.yml`` of the
checkout; SOBA's from ``*_best_params.yml``), ours the same numbers in hypergrad's terms.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "benchopt"

INSTALL = {
    "torch_problems.py": "benchmark_utils/hypergrad_problems.py",
    "hg_solver.py": "benchmark_utils/hypergrad_solver.py",
    "hg_regsel.py": "datasets/hg_regsel.py",
    **{f"hypergrad_{s}.py": f"solvers/hypergrad_{s}.py"
       for s in ("soba", "saba", "srba", "amigo", "stocbio", "f2sa", "implicit")},
}

# The benchmark's tuned settings (config/quadratics_021424_best_params.yml and friends), one
# dict per solver; ours take the same values. eval_freq is the config's.
QUADRATIC = {
    "SABA": dict(batch_size=64, eval_freq=64, outer_ratio=1.0, step_size=0.1),
    "SRBA": dict(batch_size=64, eval_freq=64, outer_ratio=1.0, period_frac=0.5, step_size=0.1),
    "SOBA": dict(batch_size=64, eval_freq=64, outer_ratio=1.0, step_size=0.1),  # as SABA
    "AmIGO": dict(batch_size=64, eval_freq=16, n_inner_steps=10, outer_ratio=0.1,
                  step_size=0.01),
    "StocBiO": dict(batch_size=64, eval_freq=16, n_inner_steps=10, n_shia_steps=10,
                    outer_ratio=1.0, step_size=0.1),
    "F2SA": dict(batch_size=64, eval_freq=16, delta_lmbda=0.01, lmbda0=1, n_inner_steps=10,
                 outer_ratio=1.0, step_size=0.1),
}
REGSEL = {  # ijcnn1_021424_best_params.yml (SOBA: ijcnn1_best_params.yml; F2SA: untuned)
    "SABA": dict(batch_size=64, eval_freq=1024, outer_ratio=1.0, step_size=0.25),
    "SRBA": dict(batch_size=64, eval_freq=1024, outer_ratio=1.0, period_frac=0.5, step_size=0.5),
    "SOBA": dict(batch_size=64, eval_freq=1024, outer_ratio=0.01, step_size=0.03125),
    "AmIGO": dict(batch_size=64, eval_freq=128, n_inner_steps=10, outer_ratio=0.1,
                  step_size=0.125),
    "StocBiO": dict(batch_size=64, eval_freq=128, n_inner_steps=10, n_shia_steps=10,
                    outer_ratio=1.0, step_size=0.25),
    "F2SA": dict(batch_size=64, eval_freq=128, delta_lmbda=0.1, lmbda0=1, n_inner_steps=10,
                 outer_ratio=1.0, step_size=0.1),
}
DATACLEANING = {  # datacleaning0_5_021424_best_params.yml (SOBA: datacleaning0_5_best_params)
    "SABA": dict(batch_size=64, eval_freq=512, outer_ratio=1e-3, step_size=0.1),
    "SRBA": dict(batch_size=64, eval_freq=512, outer_ratio=1e-5, period_frac=512.0,
                 step_size=0.001),
    "SOBA": dict(batch_size=64, eval_freq=512, outer_ratio=1e-4, step_size=1.0),
    "AmIGO": dict(batch_size=64, eval_freq=64, n_inner_steps=10, outer_ratio=1e-6,
                  step_size=0.001),
    "StocBiO": dict(batch_size=64, eval_freq=64, n_inner_steps=10, n_shia_steps=10,
                    outer_ratio=1e-5, step_size=0.01),
    "F2SA": dict(batch_size=64, eval_freq=64, delta_lmbda=1.0, lmbda0=1.0, n_inner_steps=10,
                 outer_ratio=1e-4, step_size=0.1),
}

PROBLEMS: dict[str, dict[str, Any]] = {
    "quadratic": dict(
        dataset="simulated[n_samples_inner=4096,n_samples_outer=1024,dim_inner=100,"
        "dim_outer=10,mu_inner=0.1,L_cross_inner=0.1,L_cross_outer=0.1]",
        quick_dataset="simulated[n_samples_inner=1024,n_samples_outer=1024,dim_inner=100,"
        "dim_outer=10,mu_inner=0.1,L_cross_inner=0.1,L_cross_outer=0.1]",
        settings=QUADRATIC, metrics=["objective_value", "objective_inner_distance"],
        jaxopt=dict(inner_solver="lbfgs", n_inner_steps=100, step_size_outer=[1.0, 10.0]),
        implicit=dict(outer="lbfgs", step_size_outer=1.0), timeout=12,
    ),
    "regsel": dict(
        dataset="hg_regsel[n_train=49990,n_val=91701]",
        quick_dataset="hg_regsel[n_train=5000,n_val=5000]",
        settings=REGSEL, metrics=["objective_value_func", "objective_value"],
        jaxopt=dict(inner_solver="lbfgs", n_inner_steps=100, step_size_outer=[1.0, 10.0]),
        implicit=dict(outer="lbfgs", step_size_outer=1.0), timeout=15,
    ),
    "datacleaning": dict(
        dataset="mnist[ratio=0.5,random_state=32,reg=0.2]",
        quick_dataset="mnist[ratio=0.5,random_state=32,reg=0.2]",
        settings=DATACLEANING, metrics=["objective_test_accuracy", "objective_value"],
        jaxopt=dict(inner_solver="lbfgs", n_inner_steps=100, step_size_outer=[1.0, 10.0]),
        implicit=dict(outer="lbfgs", step_size_outer=1.0), timeout=15,
    ),
}
THEIRS = ["SABA", "SRBA", "SOBA", "AmIGO", "StocBiO", "F2SA"]
OURS = ["SABA", "SOBA"]  # hg_SRBA, hg_AmIGO, hg_StocBiO, hg_F2SA are installed too: --ours
QUICK_SOLVERS = ["SABA", "SOBA"]
METRIC_NAMES = {
    "objective_func": "exact outer value h(x) = F(z*(x), x)",
    "objective_value": "the dataset's `value` metric (quadratic: exact squared norm of the "
    "hypergradient; hyper-cleaning: validation error)",
    "objective_inner_distance": "exact squared distance of z to z*(x)",
    "objective_value_func": "outer value F(z*(x), x) at the L-BFGS inner solution",
    "objective_test_accuracy": "test error (the benchmark's 'accuracy' is an error rate)",
}


def spec(name: str, params: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        return "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v)

    return f"{name}[" + ",".join(f"{k}={val(v)}" for k, v in sorted(params.items())) + "]"


def solver_specs(problem: dict[str, Any], seeds: int, quick: bool, which: list[str],
                 ours: list[str] | None = None) -> list[str]:
    rs = list(range(1, seeds + 1))
    out = []
    for s in which:
        p = problem["settings"][s]
        out.append(spec(s, {**p, "random_state": rs}))
        if s in (which if ours is None else ours):
            out.append(spec(f"hg_{s}", {**p, "random_state": rs}))
    out.append(spec("jaxopt_GD", problem["jaxopt"]))
    out.append(spec("hg_implicit", problem["implicit"]))
    return out


def install(bench: Path, link: bool = False) -> list[str]:
    """Copy (or symlink) our solver, dataset and helper files into the checkout."""
    done = []
    for src, dst in INSTALL.items():
        target = bench / dst
        if target.is_symlink() or target.exists():
            target.unlink()
        if link:
            target.symlink_to(HERE / src)
        else:
            shutil.copyfile(HERE / src, target)
        done.append(dst)
    return done


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_head(path: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def env(threads: int, checks: Path, block: bool) -> dict[str, str]:
    e = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        e[k] = str(threads)
    e["XLA_FLAGS"] = (e.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                      f"intra_op_parallelism_threads={threads}").strip()
    e["HG_RACE_CHECKS"] = str(checks)
    e["HG_RACE_BLOCK"] = "1" if block else "0"
    e.pop("PYTHONPATH", None)
    return e


def run_problem(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import pandas as pd

    from benchmarks.benchopt import tables

    pb = PROBLEMS[name]
    which = QUICK_SOLVERS if args.quick else (args.solvers or THEIRS)
    seeds = args.seeds or (2 if args.quick else 5)
    timeout = args.timeout or (3 if args.quick else pb["timeout"])
    dataset = pb["quick_dataset"] if args.quick else pb["dataset"]
    cfg = {
        "objective": ["Bilevel Optimization"],
        "dataset": [dataset],
        "solver": solver_specs(pb, seeds, args.quick, which,
                               None if args.quick else (args.ours or OURS)),
    }
    bench = args.bench_dir
    tag = "quick_" if args.quick else ""
    cfg_path = out / f"{tag}{name}_config.yml"
    cfg_path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    checks = out / f"{tag}{name}_checks.jsonl"
    checks.unlink(missing_ok=True)
    output = f"hg_race_{tag}{name}"
    cmd = [args.python, str(HERE / "launch.py"), "run", str(bench), "--config", str(cfg_path),
           "--no-plot", "--no-html", "--no-cache", "-r", "1", "-n", str(args.max_runs),
           "--timeout", str(timeout), "--output", output]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=bench, env=env(1, checks, not args.no_block), check=True)
    wall = time.perf_counter() - t0
    df = pd.read_parquet(bench / "outputs" / f"{output}.parquet")
    df.to_csv(out / f"{tag}{name}_curves.csv.gz", index=False,
              columns=[c for c in ["solver_name", "stop_val", "time", *pb["metrics"]]
                       if c in df.columns])
    result: dict[str, Any] = {"problem": name, "dataset": dataset, "timeout_s": timeout,
                              "seeds": seeds, "wall_s": round(wall, 1), "solvers": cfg["solver"]}
    records = df.to_dict("records")
    result["tables"] = [tables.time_to_levels(records, m) for m in pb["metrics"]
                        if m in df.columns]
    result["winners"] = {str(k): v for k, v in tables.winners(result["tables"][0]).items()}
    result["loss_check"] = [json.loads(x) for x in checks.read_text().splitlines()] \
        if checks.exists() else []
    result["status"] = (df.groupby("solver_name")["time"].max().round(2).to_dict())
    plot(df, result, out / f"{tag}{name}.png", pb["metrics"][0])
    return result


def plot(df: Any, result: dict[str, Any], path: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from benchmarks.benchopt import tables

    best = result["tables"][0]["best"]
    tmax = float(df["time"].max())
    grid = np.geomspace(1e-3, max(tmax, 1e-2), 200)
    curves = tables.median_curve(df.to_dict("records"), metric, best, grid)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fam, c in sorted(curves.items()):
        ls = "-" if fam.startswith("hg_") else "--"
        ax.loglog(grid, np.maximum(c, 1e-7), ls, label=fam.split("[")[0])
    for lvl in tables.LEVELS:
        ax.axhline(lvl, color="grey", lw=0.5)
    ax.set_xlabel("time (s), benchopt's timer with a wait on JAX results")
    ax.set_ylabel(f"{metric} - best (median over seeds)")
    ax.set_title(f"{result['problem']}: {result['dataset'].split('[')[0]}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    from benchmarks.benchopt import tables

    lines = [f"# The race on benchopt's bilevel benchmark{' (quick)' if meta['quick'] else ''}",
             "", f"benchmark_bilevel commit `{meta['peer_commit']}`; hypergrad `{meta['hg']}`; "
             f"CPU {meta['cpu']}; one thread; {meta['date']}.", "",
             f"Command: `{meta['command']}`", ""]
    for r in results:
        lines += [f"## {r['problem']}: `{r['dataset']}`", "",
                  f"timeout {r['timeout_s']} s per run, {r['seeds']} seeds per stochastic "
                  f"solver, wall time of the benchopt run {r['wall_s']} s.", ""]
        for t in r["tables"]:
            lines += [tables.markdown(t, METRIC_NAMES.get(t["metric"], t["metric"])), ""]
        lines += ["Fastest per level (first table's metric): "
                  + "; ".join(f"{lvl}: ours {w['ours'].split('[')[0]} "
                              f"{tables.fmt_time(w['ours_time'])}, the benchmark's "
                              f"{w['peer'].split('[')[0]} {tables.fmt_time(w['peer_time'])}"
                              f" ({'target met' if w['target_met'] else 'target missed'})"
                              for lvl, w in r["winners"].items()), ""]
        if r["loss_check"]:
            lines += ["Loss check (largest relative difference of our torch losses from the "
                      "benchmark's `f_inner` / `f_outer`, float32, 3 random points, a random "
                      "batch of 64 and the full batch): "
                      + "; ".join(f"inner {c['inner']:.1e}, outer {c['outer']:.1e}"
                                  for c in r["loss_check"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m benchmarks benchopt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-dir", type=Path, help="a local checkout of benchmark_bilevel")
    ap.add_argument("--quick", action="store_true", help="a smoke run of a couple of minutes")
    ap.add_argument("--problems", nargs="+", choices=sorted(PROBLEMS), default=None)
    ap.add_argument("--solvers", nargs="+", choices=THEIRS, default=None,
                    help="the benchmark's solvers to race, each beside ours (default: all)")
    ap.add_argument("--ours", nargs="+", choices=THEIRS, default=None,
                    help=f"hypergrad's stochastic solvers to race (default: {' '.join(OURS)})")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per stochastic solver")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per solver run")
    ap.add_argument("--max-runs", type=int, default=100_000)
    ap.add_argument("--python", default=sys.executable,
                    help="the Python of the environment with benchopt, jax and hypergrad")
    ap.add_argument("--fashion-dir", type=Path, default=None,
                    help="Fashion-MNIST idx files (default /usr/share/datasets/fashion-mnist)")
    ap.add_argument("--no-block", action="store_true",
                    help="benchopt's timer as shipped (no wait on JAX's asynchronous results)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--install-only", action="store_true")
    args = ap.parse_args(argv)
    if args.bench_dir is None:
        ap.error("--bench-dir PATH is required: a local checkout of benchopt/benchmark_bilevel "
                 "(git clone https://github.com/benchopt/benchmark_bilevel)")
    args.bench_dir = args.bench_dir.resolve()
    if not (args.bench_dir / "objective.py").is_file() or not (args.bench_dir / "solvers").is_dir():
        ap.error(f"--bench-dir {args.bench_dir}: not a benchmark_bilevel checkout "
                 "(no objective.py and solvers/)")
    if args.seeds is not None and args.seeds < 1:
        ap.error("--seeds must be >= 1")
    installed = install(args.bench_dir)
    print("installed: " + ", ".join(installed), flush=True)
    if args.install_only:
        return 0
    from benchmarks.benchopt import fashion

    problems = args.problems or list(PROBLEMS)
    if "datacleaning" in problems:
        fashion.write_pickle(args.bench_dir / "mnist.pkl", args.fashion_dir or fashion.FASHION_DIR)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    hg_where = subprocess.run([args.python, "-c", "import hypergrad, pathlib; "
                               "p = pathlib.Path(hypergrad.__file__).parent.parent; "
                               "c = p / 'COMMIT'; print(c.read_text().strip() if c.exists() "
                               "else p)"], capture_output=True, text=True, cwd="/").stdout.strip()
    meta = {"peer_commit": git_head(args.bench_dir), "cpu": cpu_model(), "quick": args.quick,
            "hg": hg_where, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python -m benchmarks benchopt " + " ".join(
                a for a in (argv if argv is not None else sys.argv[1:]))}
    results = []
    tag = "quick_" if args.quick else ""
    for name in problems:
        results.append(run_problem(name, args, out))
        (out / f"{tag}{name}.json").write_text(json.dumps({"meta": meta, **results[-1]}, indent=1,
                                                         default=_json))
    (out / f"{tag}race.md").write_text(render(results, meta))
    print(f"results in {out}", flush=True)
    return 0


def _json(o: Any) -> Any:
    if isinstance(o, float) and math.isinf(o):
        return "inf"
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
