"""The default command (the authors' code) against ``preset=paper`` (the paper's equations), one
target and seed: mean log sigma over Stages B and C, the share of hyper steps whose hypergradient
is live (non-zero), the hypergradient norms, and the five-row results table.

Both arms run ``examples/bort2/run.py`` with the same extra overrides (``--set``). Step 1 is trained
once, by the default arm, and copied into the paper arm (``preset=paper`` changes no step-1 key,
so its checkpoints are accepted as the paper arm's own); then the two arms train naive, Stage B
and Stage C side by side, one process and one torch thread each. Everything is
read back from the runs' ``history.json`` / ``metrics.json`` / ``results.json``:

* ``mean_log_sigma``: mean_d log(sigma + 1e-7) of M_psi's training step (train mode, student
  view), logged every 10 iterations of Stages B and C;
* ``hyper_mean_log_sigma``, ``hypergrad_norm``, ``hyper_outer_loss``, ``hyper_outer_zero``: one
  row per hyper step of Stage C (a step is *live* when its hypergradient norm is > 0).

Usage::

    python examples/bort2/scripts/paper_preset.py                    # results/paper_preset.*
    python examples/bort2/scripts/paper_preset.py --set step1.iters=500 step2.iters=300
    python examples/bort2/scripts/paper_preset.py --collect          # read finished runs only
    python examples/bort2/scripts/paper_preset.py --report           # the table from the JSON
    python examples/bort2/scripts/paper_preset.py --flip step2.hinge_reduction=sum --name hinge_sum

``--flip KEY=VALUE ...`` replaces the paper arm by the default configuration with only these
keys changed (arm and files named ``--name``: ``<name>.{json,md}``). It trains no step 1: it
reuses the default arm's finished stages in ``--runs`` (step 1, and the naive stage when the
naive stage reads none of the flipped keys) and trains the remaining step-2 stages in
``--runs/<name>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

NAME = "paper_preset"
HERE = Path(__file__).resolve().parent
RUN = HERE.parent / "run.py"
RESULTS = HERE.parent / "results"
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))
ARMS = {"default": [], "paper": ["preset=paper"]}
from bort2.stages_index import SPECS, STAGE_B, STAGE_C, display, paper_chain, stage_dir_name  # noqa: E402  # noqa: E402

#: Stages B and C by their letter (the mean log sigma section)
STAGE_LETTERS = {"B": STAGE_B, "C": STAGE_C}
STAGES = {letter: stage_dir_name(name) for letter, name in STAGE_LETTERS.items()}
#: the table's rows: the paper's chain, with the registry's display names (B and C lettered)
ROWS = [
    (name, display(name) + "".join(f" (Stage {k})" for k, v in STAGE_LETTERS.items() if v == name))
    for name in paper_chain()
]
#: the step-1 stage folders, trained once and shared by the arms
STEP1_DIRS = [stage_dir_name(name) for name in paper_chain() if SPECS[name].step == "step1"]


def _command(out: Path, preset: list[str], target: str, seed: int, extra: list[str]) -> list[str]:
    cmd = [
        sys.executable, str(RUN), *preset, f"target={target}", f"seed={seed}",
        f"output_dir={out}", "threads=1", "progress=false", "tsne=false", *extra,
    ]  # fmt: skip
    if (out / target / f"seed{seed}").is_dir():
        cmd.append("resume=true")
    return cmd


def train(runs: Path, target: str, seed: int, extra: list[str]) -> dict[str, float]:
    """Step 1 once (in ``runs/step1``), copied into both arms, then both arms' step 2 side by
    side, one process each (resuming what is there). Wall seconds of step 1 and of each arm."""
    wall = {}
    cmd = _command(runs / "step1", [], target, seed, extra) + ["step2.methods=[]"]
    print("+", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall["step1"] = time.perf_counter() - t0
    # preset=paper changes no step-1 key: the same step-1 checkpoints are both arms' own
    src = runs / "step1" / target / f"seed{seed}"
    for arm in ARMS:
        unit = runs / arm / target / f"seed{seed}"
        for stage in STEP1_DIRS:
            if not (unit / stage / "metrics.json").is_file():
                shutil.rmtree(unit / stage, ignore_errors=True)
                shutil.copytree(src / stage, unit / stage)
    procs = {}
    for arm in ARMS:
        cmd = _command(runs / arm, ARMS[arm], target, seed, extra)
        print("+", " ".join(cmd[1:]), flush=True)
        procs[arm] = (subprocess.Popen(cmd), time.perf_counter())
    for arm, (proc, t0) in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"the {arm} arm failed (exit code {proc.returncode})")
        wall[arm] = time.perf_counter() - t0
    return wall


def reused_stages(flip: list[str]) -> list[str]:
    """The default arm's stage folders a flip arm reuses: step 1 always (a flip changes step-2
    keys only), and each step-2 stage of the chain before Stage B that ignores every flipped key
    (``StageSpec.ignores``, from the keys' ``read_by``): the naive stage."""
    keys = [kv.split("=", 1)[0] for kv in flip]
    bad = [k for k in keys if not k.startswith("step2.")]
    if bad:
        raise SystemExit(f"--flip changes step-2 keys only (step 1 is reused): {bad}")
    reuse = list(STEP1_DIRS)
    before_b = paper_chain()[: paper_chain().index(STAGE_B)]
    for name in before_b:
        if SPECS[name].step == "step2" and all(k in SPECS[name].ignores for k in keys):
            reuse.append(stage_dir_name(name))
    return reuse


def train_flip(
    runs: Path, name: str, flip: list[str], target: str, seed: int, extra: list[str]
) -> dict[str, float]:
    """The flip arm: the default arm's finished stages copied in, the rest trained."""
    src = runs / "default" / target / f"seed{seed}"
    unit = runs / name / target / f"seed{seed}"
    for stage in reused_stages(flip):
        if not (src / stage / "metrics.json").is_file():
            raise SystemExit(f"{src / stage} is not finished: run the pair first (without --flip)")
        if not (unit / stage / "metrics.json").is_file():
            shutil.rmtree(unit / stage, ignore_errors=True)
            shutil.copytree(src / stage, unit / stage)
    cmd = _command(runs / name, flip, target, seed, extra)
    print("+", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return {name: time.perf_counter() - t0}


def _history(stage_dir: Path) -> dict[str, list[list[float]]]:
    data = json.loads((stage_dir / "history.json").read_text())
    return data.get("history", data)


def _series(hist: dict, key: str) -> list[list[float]]:
    return [[int(i), float(v)] for i, v in hist.get(key, [])]


def _stats(values: list[float]) -> dict[str, float | None]:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
    }


def collect(
    runs: Path, target: str, seed: int, extra: list[str], wall: dict, arms: dict | None = None
) -> dict:
    arms = ARMS if arms is None else arms
    out: dict = {
        "target": target,
        "seed": seed,
        "overrides": extra,
        "wall_s": wall,
        "arms": {},
    }
    if list(arms) != list(ARMS):  # a flip: the default against one changed configuration
        out["compare"] = list(arms)[1]
    for arm, preset in arms.items():
        unit = runs / arm / target / f"seed{seed}"
        res = json.loads((runs / arm / "results.json").read_text())
        accs = {
            r["stage"]: r for r in res["results"] if r["target"] == target and r["seed"] == seed
        }
        a: dict = {"command": " ".join(["run.py", *preset, *extra]), "table": {}, "stages": {}}
        for stage, _ in ROWS:
            r = accs[stage]
            keys = ("acc", "ci_low", "ci_high", "n", "best_acc", "time_s")
            a["table"][stage] = {k: r.get(k) for k in keys}
        for label, folder in STAGES.items():
            hist = _history(unit / folder)
            metrics = json.loads((unit / folder / "metrics.json").read_text())
            mls = _series(hist, "mean_log_sigma")
            s: dict = {
                "mean_log_sigma": mls,
                "mean_log_sigma_first": mls[0][1] if mls else None,
                "mean_log_sigma_last": mls[-1][1] if mls else None,
                "mean_log_sigma_max": max(v for _, v in mls) if mls else None,
                "mean_log_sigma_min": min(v for _, v in mls) if mls else None,
                "labeler_acc": metrics.get("labeler_acc"),
            }
            if label == "C":
                norms = _series(hist, "hypergrad_norm")
                outer = _series(hist, "hyper_outer_loss")
                zero = _series(hist, "hyper_outer_zero")
                hls = _series(hist, "hyper_mean_log_sigma")
                live = [v > 0.0 for _, v in norms]
                s.update(
                    hyper_steps=len(norms),
                    live_steps=sum(live),
                    live_share=sum(live) / len(live) if live else None,
                    zero_outer_steps=int(sum(v for _, v in zero)),
                    hypergrad_norm=norms,
                    hypergrad_norm_stats=_stats([v for _, v in norms]),
                    hypergrad_norm_live_stats=_stats([v for _, v in norms if v > 0]),
                    hyper_clipped_steps=int(sum(v for _, v in _series(hist, "hyper_clipped"))),
                    hyper_diverged_steps=int(sum(v for _, v in _series(hist, "hyper_diverged"))),
                    hyper_outer_loss=outer,
                    hyper_mean_log_sigma=hls,
                    hyper_mean_log_sigma_stats=_stats([v for _, v in hls]),
                    hyper_mean_log_sigma_positive=sum(v > 0 for _, v in hls),
                )
            a["stages"][label] = s
        out["arms"][arm] = a
    return out


def _f(v: float | None, fmt: str = "+.3f") -> str:
    return "–" if v is None else format(v, fmt)


def _pct(r: dict) -> str:
    return f"{100 * r['acc']:.1f} [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}]"


def render(res: dict) -> str:
    other = res.get("compare", "paper")  # the second arm: preset=paper, or a --flip's name
    d, p = res["arms"]["default"], res["arms"][other]
    stem = NAME if other == "paper" else other
    over = " ".join(res["overrides"]) or "(none: the default budgets)"
    if other == "paper":
        title, shared = "`preset=paper`", "Step 1 is trained once and shared by the two arms."
    else:
        title = "`" + " ".join(res["compare_overrides"]) + "` alone"
        shared = (
            f"The {other} arm is the default configuration with only "
            f"`{' '.join(res['compare_overrides'])}` changed; it reuses the default arm's "
            f"finished stages ({', '.join(res['reused'])}, copied) and trains the rest."
        )
    if "load_avg" in res:
        where = (
            "on the 2-core machine (1-minute load average "
            + " at the start, ".join(f"{v:.2f}" for v in res["load_avg"])
            + " at the end)"
        )
    else:
        where = "on a shared, loaded 2-core machine"
    lines = [
        f"<!-- generated from {stem}.json by examples/bort2/scripts/{NAME}.py --report -->",
        f"# The authors' code (default) against {title}: target `{res['target']}`, "
        f"seed {res['seed']}",
        "",
        f"Extra overrides, both arms: `{over}`. {shared} Stage times (s) {where}: "
        + ", ".join(
            f"{name} {d['table'][stage]['time_s']:.0f}"
            + ("" if stage.startswith("step1/") else f" / {p['table'][stage]['time_s']:.0f}")
            for stage, name in ROWS
            if d["table"][stage].get("time_s") is not None
        )
        + f" (default / {other}).",
        "",
        "## Target test accuracy (final models, 95% Wilson intervals)",
        "",
        f"| method | default (authors' code) | {title.removesuffix(' alone')} |",
        "|---|---|---|",
    ]
    for stage, name in ROWS:
        lines.append(f"| {name} | {_pct(d['table'][stage])} | {_pct(p['table'][stage])} |")
    lines += [
        "",
        "## Mean log σ of M_ψ's training steps (train mode), Stages B and C",
        "",
        "| stage | arm | first | last | min | max |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label in ("B", "C"):
        for arm, a in (("default", d), (other, p)):
            s = a["stages"][label]
            lines.append(
                f"| {label} | {arm} | {_f(s['mean_log_sigma_first'])} | "
                f"{_f(s['mean_log_sigma_last'])} | {_f(s['mean_log_sigma_min'])} | "
                f"{_f(s['mean_log_sigma_max'])} |"
            )
    lines += [
        "",
        "## Stage C's hyper steps",
        "",
        "| arm | hyper steps | live (hypergradient ≠ 0) | outer loss exactly 0 | "
        "mean log σ at the hyper step: median [min, max] | > 0 | hypergradient norm: "
        "median [min, max] | clipped |",
        "|---|---:|---:|---:|---|---:|---|---:|",
    ]
    for arm, a in (("default", d), (other, p)):
        s = a["stages"]["C"]
        h, n = s["hyper_mean_log_sigma_stats"], s["hypergrad_norm_stats"]
        share = s["live_share"]
        lines.append(
            f"| {arm} | {s['hyper_steps']} | {s['live_steps']} "
            f"({_f(share and 100 * share, '.0f')}%)"
            f" | {s['zero_outer_steps']} | {_f(h['median'])} [{_f(h['min'])}, {_f(h['max'])}] | "
            f"{s['hyper_mean_log_sigma_positive']} | {_f(n['median'], '.3g')} "
            f"[{_f(n['min'], '.3g')}, {_f(n['max'], '.3g')}] | {s['hyper_clipped_steps']} |"
        )
    lines += [
        "",
        "| arm | F_θ's target accuracy after Stage B | after Stage C |",
        "|---|---:|---:|",
    ]
    for arm, a in (("default", d), (other, p)):
        b, c = a["stages"]["B"]["labeler_acc"], a["stages"]["C"]["labeler_acc"]
        lines.append(f"| {arm} | {_f(b and 100 * b, '.1f')} | {_f(c and 100 * c, '.1f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("runs") / NAME, help="the two run folders")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where paper_preset.{json,md} go")
    ap.add_argument("--target", default="uci_m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value for both arms")
    ap.add_argument("--report", action="store_true", help="render the table from the JSON only")
    ap.add_argument(
        "--collect", action="store_true", help="read the finished runs in --runs, train nothing"
    )
    ap.add_argument(
        "--flip",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="instead of preset=paper: the default with only these step-2 keys changed "
        "(reuses the default arm's finished stages in --runs)",
    )
    ap.add_argument("--name", default="flip", help="the --flip arm's folder and file name")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = NAME if args.flip is None else args.name
    if args.flip is not None and args.name in ARMS:
        ap.error(f"--name {args.name!r} is taken by an arm of the pair")
    path = args.out / f"{stem}.json"
    if args.report:
        res = json.loads(path.read_text())
    else:
        load0 = os.getloadavg()[0]
        arms = None if args.flip is None else {"default": [], args.name: list(args.flip)}
        if args.collect:
            wall = {}
        elif args.flip is None:
            wall = train(args.runs, args.target, args.seed, args.set)
        else:
            wall = train_flip(args.runs, args.name, args.flip, args.target, args.seed, args.set)
        res = collect(args.runs, args.target, args.seed, args.set, wall, arms)
        if args.flip is not None:
            res["compare_overrides"] = list(args.flip)
            res["reused"] = reused_stages(args.flip)
        if not args.collect:
            res["load_avg"] = [load0, os.getloadavg()[0]]
        path.write_text(json.dumps(res, indent=1) + "\n")
    text = render(res)
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
