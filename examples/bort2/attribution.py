"""Attribution of BORT²'s departures from the authors' code, one switch at a time.

Starting from a finished faithful run (``python examples/bort2/run.py preset=full
output_dir=DIR``; ``--preset``/``--set`` repeat any other settings it had), every switch of
docs/bort2.md's departures table is flipped back to this project's earlier behaviour on its own
(plus the control ``step2.hyper.apply=false``), on the given targets and seeds. Stages
that a switch does not affect (their checkpoint fingerprint, the keys the stage reads, is the same
under both configurations) are reused from the faithful run (copied), so only the affected
stages are trained. The change in target accuracy of every affected row is reported per switch,
with the paired standard deviation over the units.

Usage::

    python examples/bort2/attribution.py --faithful runs/full --out runs/attribution \\
        --targets uci_m syn_m --seeds 0 1 2 --jobs 2

Writes ``attribution.md`` / ``attribution.json`` in ``--out``: per switch and affected row the
paired differences (``diffs``, in the order targets × seeds), their mean, std, 95% t interval,
sign count and the effect detectable at 80% power (``bort2.report.paired_stats``).
``--from-json`` recomputes those statistics and the table from an existing ``attribution.json``
(its per-run ``diffs``) without the run folders::

    python examples/bort2/attribution.py --from-json --out examples/bort2/results/attribution
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from bort2.checkpoint import config_fingerprint
from bort2.config import load_config, to_yaml
from bort2.report import DISPLAY, format_ci, format_signs, mde_sentence, paired_stats
from bort2.runner import load_data, run_units
from bort2.stages_index import SPECS, paper_chain, stage_dir_name
from bort2.trainer import resolve_device

#: the faithful run's stages: the paper's chain, in table order
_STAGE_ORDER = paper_chain()


def _flip(override: str | list[str], what: str) -> tuple[list[str], str]:
    """(overrides, description)."""
    return ([override] if isinstance(override, str) else list(override)), what


FLIPS: dict[str, tuple] = {
    "labels": _flip("step2.labels=gumbel", "Gumbel labels in every inner step"),
    "teacher_ema": _flip("step2.teacher_ema=0", "frozen Stage-B labeler"),
    "bort2_init": _flip("step2.bort2_init=step1", "Stage C from step 1"),
    "sigma_head": _flip("model.sigma_head=linear", "linear μ/σ heads"),
    "hyper_convention": _flip("step2.hyper.convention=library", "α-scaled hypergrad.Neumann"),
    "official_sign": _flip("step2.hyper.official_sign=true", "the authors' +log p"),
    "outer_relu": _flip("step2.hyper.outer_relu=false", "outer loss without ReLU"),
    "labeler_mode": _flip("step2.hyper.labeler_mode=eval", "F_θ in eval mode"),
    "cm_variant": _flip("step1.cm_variant=mixed", "the earlier FixMatch-CM"),
    "views": _flip("data.views=legacy", "the earlier views"),
    "control": _flip("step2.hyper.apply=false", "hypergradient not applied"),
    # with the ReLU the hypergradient is zero, which hides the convention and the sign: these
    # two pairs show what they do once the outer loss is live
    "no_relu+sign": _flip(
        ["step2.hyper.outer_relu=false", "step2.hyper.official_sign=true"],
        "no ReLU, the authors' +log p (their exact update, live)",
    ),
    "no_relu+library": _flip(
        ["step2.hyper.outer_relu=false", "step2.hyper.convention=library"],
        "no ReLU, α-scaled hypergrad.Neumann",
    ),
}


def _base(args) -> list[str]:
    """The faithful run's settings (its preset, ``--set``)."""
    return [f"preset={args.preset}", *args.set]


def affected(args, overrides: list[str]) -> list[str]:
    """The stages of :data:`_STAGE_ORDER` whose results ``overrides`` change: those whose
    checkpoint fingerprint (the keys they read, declared beside each key) differs from the
    faithful run's; the others are reused from it."""
    base = load_config(None, _base(args))
    flipped = load_config(None, [*_base(args), *overrides])
    return [
        name
        for name in _STAGE_ORDER
        if config_fingerprint(base, name) != config_fingerprint(flipped, name)
    ]


def _methods(step: str) -> str:
    return ",".join(SPECS[n].method for n in _STAGE_ORDER if SPECS[n].step == step)


def _acc(run_dir: Path, stage: str) -> float | None:
    path = run_dir / stage_dir_name(stage) / "metrics.json"
    return json.loads(path.read_text())["acc"] if path.is_file() else None


def run_flip(name: str, args, bench, device) -> None:
    overrides, _ = FLIPS[name]
    changed = affected(args, overrides)
    reuse = [stage_dir_name(n) for n in _STAGE_ORDER if n not in changed]
    out = args.out / name
    units = [(t, s) for t in args.targets for s in args.seeds]
    for target, seed in units:
        src, dst = args.faithful / target / f"seed{seed}", out / target / f"seed{seed}"
        for stage in reuse:
            if not (dst / stage / "metrics.json").is_file():
                if not (src / stage / "metrics.json").is_file():
                    raise FileNotFoundError(f"{src / stage} is not a finished stage")
                shutil.rmtree(dst / stage, ignore_errors=True)
                shutil.copytree(src / stage, dst / stage)
    cfg = load_config(
        None,
        [
            f"preset={args.preset}",
            *overrides,
            # every stage of the faithful run; those copied above are finished and reused
            f"step1.methods=[{_methods('step1')}]",
            f"step2.methods=[{_methods('step2')}]",
            *args.set,
            f"jobs={args.jobs}",
            "resume=true",
            "progress=false",
            "tsne=false",
            f"output_dir={out}",
        ],
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))  # the resolved configuration of this switch
    t0 = time.perf_counter()
    run_units(cfg, units, out, bench, device)
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)


def _row(diffs: list[float]) -> dict:
    """One affected row: :func:`bort2.report.paired_stats` of the paired differences (points),
    and the differences themselves."""
    return {**paired_stats(np.array(diffs)), "diffs": list(diffs)}


def restat(summary: dict) -> dict:
    """The statistics of every row recomputed from its ``diffs`` (``--from-json``)."""
    return {
        name: {**entry, "rows": {st: _row(r["diffs"]) for st, r in entry["rows"].items()}}
        for name, entry in summary.items()
    }


def summarize(args) -> dict:
    """Per switch and affected row: the change in target accuracy (points), paired by unit."""
    units = [(t, s) for t in args.targets for s in args.seeds]
    out: dict = {}
    for name, (overrides, what) in FLIPS.items():
        stages = affected(args, overrides)
        rows = {}
        for stage in stages:
            diffs = []
            for target, seed in units:
                a = _acc(args.out / name / target / f"seed{seed}", stage)
                b = _acc(args.faithful / target / f"seed{seed}", stage)
                if a is not None and b is not None:
                    diffs.append(100.0 * (a - b))
            if diffs:
                rows[stage] = _row(diffs)
        out[name] = {"what": what, "rows": rows}
    return out


def markdown(summary: dict, args) -> str:
    n = len(args.targets) * len(args.seeds)
    lines = [
        f"Change in target test accuracy (points) when one switch is flipped back, paired over "
        f"{n} runs ({', '.join(args.targets)} × seeds {', '.join(map(str, args.seeds))}): mean, "
        "95% Student-t interval of the mean difference, and the runs where it was > 0 "
        "(positive: the project's earlier choice was better); rows not listed are not affected "
        "by the switch.",
        "",
        "| switch flipped | restores | " + " | ".join(DISPLAY[s] for s in _STAGE_ORDER) + " |",
        "|---|---|" + "---:|" * len(_STAGE_ORDER),
    ]
    for name, entry in summary.items():
        cells = []
        for stage in _STAGE_ORDER:
            r = entry["rows"].get(stage)
            cells.append("" if r is None else _cell(r))
        lines.append(f"| `{name}` | {entry['what']} | " + " | ".join(cells) + " |")
    rows = [r for entry in summary.values() for r in entry["rows"].values()]
    sentence = mde_sentence([r for r in rows if r.get("std", 0) > 0])
    return "\n".join(lines) + "\n" + (f"\n{sentence}\n" if sentence else "")


def _cell(r: dict) -> str:
    """``+1.9 [+1.0, +2.7], 6 / 6``; one run has no interval and says so (never ``± 0``)."""
    r = {"helped": 0, "ties": 0, **r}  # rows of an older attribution.json lack the sign count
    return f"{r['mean']:+.1f} {format_ci(r)}, {format_signs(r)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faithful", type=Path, help="output_dir of the faithful run")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--targets", nargs="+", default=["uci_m", "syn_m"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--preset", default="full", help="the faithful run's preset")
    ap.add_argument("--only", nargs="*", default=None, help="switches to run (default: all)")
    ap.add_argument(
        "--set", nargs="*", default=[], help="key=value overrides the faithful run also had"
    )
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument(
        "--from-json",
        action="store_true",
        help="recompute the statistics and attribution.md from --out's attribution.json only",
    )
    args = ap.parse_args(argv)
    if args.from_json:
        summary = restat(json.loads((args.out / "attribution.json").read_text()))
        return _write(summary, args)
    if args.faithful is None:
        ap.error("--faithful is required (unless --from-json)")
    bad = [n for n in (args.only or []) if n not in FLIPS]
    if bad:
        ap.error(f"unknown switches {bad}; valid: {', '.join(FLIPS)}")
    if not args.summary_only:
        cfg = load_config(None, [f"preset={args.preset}", "progress=false", *args.set])
        bench, device = load_data(cfg), resolve_device(cfg.device)
        for name in args.only or list(FLIPS):
            run_flip(name, args, bench, device)
    return _write(summarize(args), args)


def _write(summary: dict, args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attribution.json").write_text(json.dumps(summary, indent=2))
    table = markdown(summary, args)
    (args.out / "attribution.md").write_text("# BORT² attribution\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
