"""Result tables (markdown + JSON), mechanism plots and the t-SNE figure of a BORT2 run."""

from __future__ import annotations

import json
import math
import platform
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import atomic_write_bytes, atomic_write_text, read_json
from .errors import CheckpointError
from .stages_index import BORT2_INITS, SPECS, paper_chain, stage_dir_name

#: display name of every stage, in the order of the results table (from the stages' specs)
DISPLAY = {name: spec.display for name, spec in SPECS.items()}
ORDER = list(DISPLAY)


def _read_stage_json(path: Path) -> Any:
    """A stage's ``history.json`` / ``metrics.json``, verified against its SHA-256 sidecar when
    it has one (folders of older versions have none); None, with a one-line warning, when the
    file is missing or damaged (the analysis then leaves that stage out)."""
    if not path.is_file():
        return None
    try:
        return read_json(path, strict=False)
    except CheckpointError as exc:
        warnings.warn(f"{exc}; left out of the mechanism analysis", stacklevel=2)
        return None


#: the stages of the paper's chain of comparisons, in order (``paper_order`` of the specs)
PAPER_ORDER = paper_chain()


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{stage: {target: {mean, std, n, ci_low, ci_high}}}`` over seeds (accuracy in %)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[(r["stage"], r["target"])].append(r)
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (stage, target), rs in groups.items():
        accs = np.array([100.0 * r["acc"] for r in rs])
        out[stage][target] = {
            "mean": float(accs.mean()),
            "std": float(accs.std(ddof=1)) if len(accs) > 1 else float("nan"),
            "n_seeds": len(accs),
            "ci_low": 100.0 * rs[0]["ci_low"] if len(rs) == 1 else float("nan"),
            "ci_high": 100.0 * rs[0]["ci_high"] if len(rs) == 1 else float("nan"),
            "n_test": int(rs[0]["n"]),
        }
    return out


def _cell(s: dict[str, float]) -> str:
    if s["n_seeds"] > 1:
        return f"{s['mean']:.1f} ± {s['std']:.1f}"
    if not math.isnan(s["ci_low"]):
        return f"{s['mean']:.1f} [{s['ci_low']:.1f}, {s['ci_high']:.1f}]"
    return f"{s['mean']:.1f}"


def markdown_table(results: list[dict[str, Any]], domains: list[str]) -> str:
    """Target test accuracy (%) per method and target, with the mean over targets."""
    summary = summarize(results)
    targets = [d for d in domains if any(d in summary[s] for s in summary)]
    stages = [s for s in ORDER if s in summary] + [s for s in summary if s not in ORDER]
    nseeds = max((v["n_seeds"] for s in summary.values() for v in s.values()), default=1)
    note = (
        f"mean ± std over {nseeds} seeds"
        if nseeds > 1
        else "single seed; brackets: 95% Wilson interval over test images"
    )
    head = "| method | " + " | ".join(targets) + (" | avg |" if len(targets) > 1 else " |")
    sep = "|---" * (len(targets) + 1 + (len(targets) > 1)) + "|"
    best = (
        "; the best over the periodic evaluations (what the authors' code prints) is "
        "`best_acc` in results.json"
        if any("best_acc" in r for r in results)
        else ""
    )
    lines = [
        f"Target test accuracy (%) of the final model, {note}{best}.",
        "",
        head,
        sep,
    ]
    for stage in stages:
        cells = [_cell(summary[stage][t]) if t in summary[stage] else "–" for t in targets]
        row = f"| {DISPLAY.get(stage, stage)} | " + " | ".join(cells)
        if len(targets) > 1:
            vals = [summary[stage][t]["mean"] for t in targets if t in summary[stage]]
            row += f" | {np.mean(vals):.1f}" if len(vals) == len(targets) else " | –"
        lines.append(row + " |")
    return "\n".join(lines) + "\n"


#: two-sided significance level and power of the paired statistics below
ALPHA, POWER = 0.05, 0.8


def t_interval(d: np.ndarray, level: float = 0.95) -> tuple[float, float] | None:
    """Two-sided Student-t confidence interval of the mean of ``d`` (ddof 1, n − 1 degrees of
    freedom): mean ± t_{(1+level)/2, n−1} · std / √n. None for fewer than 2 values (no spread
    to estimate, so no interval)."""
    from scipy import stats

    n = len(d)
    if n < 2:
        return None
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * float(d.std(ddof=1)) / math.sqrt(n)
    return float(d.mean()) - half, float(d.mean()) + half


def paired_t_power(delta: float, std: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` when the true mean difference is
    ``delta`` and the differences' standard deviation is ``std``: P(|T| > t_{1−α/2, n−1}) with
    T noncentral t, n − 1 degrees of freedom, noncentrality delta·√n / std."""
    from scipy import stats

    df, tc = n - 1, float(stats.t.ppf(1 - alpha / 2, n - 1))
    nc = delta * math.sqrt(n) / std
    upper, lower = float(stats.nct.sf(tc, df, abs(nc))), float(stats.nct.cdf(-tc, df, abs(nc)))
    # scipy's nct returns NaN for a vanishing far tail (e.g. the lower one at a large nc)
    return (0.0 if math.isnan(upper) else upper) + (0.0 if math.isnan(lower) else lower)


def minimal_detectable_effect(
    std: float, n: int, power: float = POWER, alpha: float = ALPHA
) -> float | None:
    """The smallest true mean difference (in the units of ``std``) that a two-sided paired
    t-test at level ``alpha`` over ``n`` pairs detects with probability ``power``, taking the
    observed ``std`` of the differences as the true one.

    The exact solve: the noncentrality λ at which :func:`paired_t_power` equals ``power``
    (root of the noncentral-t power, ``scipy.stats.nct``), then MDE = λ · std / √n. It is a
    little larger than the usual normal-style approximation
    (t_{1−α/2, n−1} + t_{power, n−1}) · std / √n. None for fewer than 2 pairs; 0.0 when
    ``std`` is 0 (identical differences: any non-zero shift is resolved).
    """
    from scipy import optimize

    if n < 2 or not math.isfinite(std):
        return None
    if std == 0:
        return 0.0

    def gap(lam: float) -> float:  # power at noncentrality lam, minus the target
        return paired_t_power(lam * std / math.sqrt(n), std, n, alpha) - power

    hi = 1.0
    while gap(hi) < 0:  # the power rises with lam
        hi *= 2.0
    root = optimize.brentq(gap, 0.0, hi, xtol=1e-12)
    return float(root) * std / math.sqrt(n)


def paired_stats(d: np.ndarray) -> dict[str, Any]:
    """Mean, std (ddof 1), 95% t interval, sign count and MDE of paired differences ``d``.

    Keys: ``mean``, ``std`` (nan for one value), ``n``, ``helped`` (d > 0), ``ties`` (d == 0),
    ``hurt`` (d < 0), ``min``, ``max``, ``ci_low``/``ci_high`` (:func:`t_interval`, None for
    one value) and ``mde80`` (:func:`minimal_detectable_effect`, None for one value).
    """
    d = np.asarray(d, dtype=float)
    n = len(d)
    std = float(d.std(ddof=1)) if n > 1 else float("nan")
    ci = t_interval(d)
    return {
        "mean": float(d.mean()),
        "std": std,
        "helped": int((d > 0).sum()),
        "ties": int((d == 0).sum()),
        "hurt": int((d < 0).sum()),
        "n": n,
        "min": float(d.min()),
        "max": float(d.max()),
        "ci_low": None if ci is None else ci[0],
        "ci_high": None if ci is None else ci[1],
        "mde80": minimal_detectable_effect(std, n),
    }


def paired_differences(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each method against the one before it in the paper's ordering, paired by (target, seed).

    Returns one row per consecutive pair with at least 2 paired runs, in accuracy points: the
    keys of :func:`paired_stats` (mean, std, 95% t interval of the mean, runs where it helped,
    ties and runs where it hurt, range, the effect detectable at 80% power) and, when the runs
    cover 2 or more targets, ``per_target``: {target: the same statistics over that target's
    seeds}.
    """
    acc = {(r["stage"], r["target"], r["seed"]): 100.0 * r["acc"] for r in results}
    order = [s for s in PAPER_ORDER if any(k[0] == s for k in acc)]
    rows = []
    for before, after in zip(order, order[1:]):
        units = sorted(
            {(t, s) for st, t, s in acc if st == after}
            & {(t, s) for st, t, s in acc if st == before}
        )
        d = np.array([acc[(after, t, s)] - acc[(before, t, s)] for t, s in units])
        if len(d) < 2:
            continue
        row: dict[str, Any] = {"comparison": f"{DISPLAY[after]} − {DISPLAY[before]}"}
        row.update(paired_stats(d))
        paired_targets = {t for t, _ in units}
        targets = [t for t in dict.fromkeys(r["target"] for r in results) if t in paired_targets]
        if len(targets) > 1:
            row["per_target"] = {
                t: paired_stats(np.array([x for (u, _), x in zip(units, d) if u == t]))
                for t in targets
            }
        rows.append(row)
    return rows


def format_ci(r: dict[str, Any]) -> str:
    """``[−3.1, +4.2]``, or ``no CI (n = 1)`` when there is no interval."""
    if r.get("ci_low") is None:
        return f"no CI (n = {r['n']})"
    return f"[{r['ci_low']:+.1f}, {r['ci_high']:+.1f}]"


def format_signs(r: dict[str, Any]) -> str:
    """``9 / 12``, with ``(1 tie)`` / ``(2 ties)`` when some runs did not change."""
    ties = r.get("ties", 0)
    tie = f" ({ties} tie{'s' if ties != 1 else ''})" if ties else ""
    return f"{r['helped']} / {r['n']}{tie}"


def mde_sentence(rows: list[dict[str, Any]]) -> str:
    """One line stating the smallest effect the rows resolve at 80% power (empty when none)."""
    mdes = [r["mde80"] for r in rows if r.get("mde80") is not None]
    if not mdes:
        return ""
    ns = sorted({r["n"] for r in rows if r.get("mde80") is not None})
    n = " or ".join(str(k) for k in ns)
    lo, hi = f"{min(mdes):.1f}", f"{max(mdes):.1f}"
    span = lo if lo == hi else f"{lo}–{hi}"
    return (
        f"Smallest resolvable effect: with {n} paired runs and each comparison's observed std, "
        f"a two-sided paired t-test at α = 0.05 has 80% power for a true mean difference of "
        f"{span} points (noncentral t); a smaller difference, or an interval that contains 0, "
        "is not resolved by these runs."
    )


def paired_markdown(rows: list[dict[str, Any]]) -> str:
    """The paired differences as a markdown table (empty string when there are none): mean,
    95% t interval of the mean, std, sign count, range, the per-target means when there are
    several targets, the 80%-power MDE, and a line stating the smallest resolvable effect."""
    if not rows:
        return ""
    per_target = any("per_target" in r for r in rows)
    head = "| comparison | mean | 95% CI | std | runs where it helped | range | MDE |"
    sep = "|---|---:|---|---:|---:|---|---:|"
    if per_target:
        head, sep = head + " per target (mean) |", sep + "---|"
    lines = [
        "Paired differences (points) over the (target, seed) runs, each method against the one "
        "before it in the paper's ordering; 95% CI: Student t interval of the mean difference; "
        "MDE: the true difference detected with 80% power:",
        "",
        head,
        sep,
    ]
    for r in rows:
        mde = "–" if r.get("mde80") is None else f"{r['mde80']:.1f}"
        line = (
            f"| {r['comparison']} | {r['mean']:+.1f} | {format_ci(r)} | {r['std']:.1f} "
            f"| {format_signs(r)} | {r['min']:+.1f} … {r['max']:+.1f} | {mde} |"
        )
        if per_target:
            pt = r.get("per_target", {})
            line += " " + ", ".join(f"{t} {v['mean']:+.1f}" for t, v in pt.items()) + " |"
        lines.append(line)
    sentence = mde_sentence(rows)
    return "\n".join(lines) + "\n" + (f"\n{sentence}\n" if sentence else "")


def machine_info() -> dict[str, Any]:
    """What decides the arithmetic of a run (the same seed gives different numbers on machines
    with other vector kernels or thread counts; see docs/bort2.md, Reproducibility)."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }


def results_markdown(payload: dict[str, Any], domains: list[str]) -> str:
    """results.md from a results.json payload: the table, the paired differences with their
    intervals (recomputed from the per-run ``results``), and the arithmetic line when the
    payload records the machine."""
    results = payload["results"]
    table = markdown_table(results, domains)
    paired = paired_differences(results)
    extra = "\n" + paired_markdown(paired) if paired else ""
    machine = payload.get("machine")
    where = (
        f"\nArithmetic: torch {machine['torch']}, CPU kernels {machine['cpu_capability']}, "
        f"{machine['threads']} thread(s) in the process that wrote this table.\n"
        if machine
        else ""
    )
    return "# BORT² results\n\n" + table + extra + where


def write_results(results: list[dict[str, Any]], domains: list[str], out_dir: Path) -> str:
    """Write results.json and results.md (the table, and paired differences when there are
    several runs); return the markdown table."""
    payload = {
        "results": results,
        "summary": summarize(results),
        "paired": paired_differences(results),
    }
    payload["machine"] = machine_info()
    atomic_write_text(json.dumps(payload, indent=2), out_dir / "results.json")
    atomic_write_text(results_markdown(payload, domains), out_dir / "results.md")
    return markdown_table(results, domains)


def rewrite_results(out_dir: Path, domains: list[str] | None = None) -> str:
    """Rewrite ``out_dir``'s results.md (and results.json's ``paired``) from the per-run
    results in its results.json, without training: how committed tables get the statistics of
    a newer report. ``domains`` orders the columns (default: the order of the runs). Every
    other key of results.json is kept as it is; a ``Mode:`` line at the end of the old
    results.md (written by ``reproducible``) is kept. Returns the new results.md."""
    out_dir = Path(out_dir)
    payload = json.loads((out_dir / "results.json").read_text())
    results = payload["results"]
    domains = domains or list(dict.fromkeys(r["target"] for r in results))
    payload["paired"] = paired_differences(results)
    md = results_markdown(payload, domains)
    old = out_dir / "results.md"
    if old.is_file():
        mode = [ln for ln in old.read_text().splitlines() if ln.startswith("Mode: ")]
        md += "".join(ln + "\n" for ln in mode[-1:])
    atomic_write_text(json.dumps(payload, indent=2), out_dir / "results.json")
    atomic_write_text(md, old)
    return md


def main(argv: list[str] | None = None) -> int:
    """``python -m bort2.report DIR [DIR ...]``: :func:`rewrite_results` for each run folder."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m bort2.report",
        description="Rewrite results.md (and results.json's paired statistics) of finished "
        "BORT² runs from their results.json, without training.",
    )
    ap.add_argument("dirs", nargs="+", type=Path, help="output_dir of a run (holds results.json)")
    ap.add_argument("--domains", nargs="*", default=None, help="column order (default: the runs')")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if not (d / "results.json").is_file():
            ap.error(f"{d} has no results.json")
        rewrite_results(d, args.domains)
        print(f"rewrote {d / 'results.md'}")
    return 0


def _series(history: dict[str, list[list[float]]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = np.array(history.get(key, []), dtype=float).reshape(-1, 2)
    return pts[:, 0], pts[:, 1]


def _tail_mean(history: dict, key: str, frac: float = 0.25) -> float:
    """Mean of the last ``frac`` of a logged series (nan when it was not logged)."""
    _, y = _series(history, key)
    if not len(y):
        return float("nan")
    return float(y[-max(1, int(round(frac * len(y)))) :].mean())


def mechanism_summary(out_dir: Path, units: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Per (target, seed) and stochastic variant: what the paper's mechanism predicts.

    σ of M_ψ for correctly vs wrongly pseudo-labelled target examples (mean over the last quarter
    of step 2; the paper expects wrong > correct), the masked pseudo-label accuracy, and for
    BORT² the median hypergradient norm, the hyper steps that diverged, and F_θ's target accuracy
    before (step 1) and after step 2.
    """
    rows = []
    for target, seed in units:
        run_dir = out_dir / target / f"seed{seed}"
        for spec in (s for s in SPECS.values() if s.stochastic):
            variant, d = spec.method, run_dir / spec.dir_name
            h, m = _read_stage_json(d / "history.json"), _read_stage_json(d / "metrics.json")
            if not isinstance(h, dict) or "history" not in h or not isinstance(m, dict):
                continue
            h = h["history"]
            _, hg_norm = _series(h, "hypergrad_norm")
            sc, sw = _tail_mean(h, "sigma_correct"), _tail_mean(h, "sigma_wrong")
            rows.append(
                {
                    "target": target,
                    "seed": seed,
                    "variant": variant,
                    "sigma_correct": sc,
                    "sigma_wrong": sw,
                    "sigma_ratio": sw / sc if sc > 0 else float("nan"),
                    "pseudo_acc_masked": _tail_mean(h, "pseudo_acc_masked"),
                    "mask_rate": _tail_mean(h, "mask_rate"),
                    "hypergrad_norm_median": float(np.median(hg_norm)) if len(hg_norm) else None,
                    "hyper_steps": m.get("hyper_steps", 0),
                    "hyper_diverged": m.get("hyper_diverged_steps", 0),
                    "hyper_zero_outer": m.get("hyper_zero_outer_steps", 0),
                    "mean_log_sigma_median": m.get("mean_log_sigma_median"),
                    "labeler_acc_after": m.get("labeler_acc"),
                    "labeler_init": m.get("labeler_init", "step1"),
                }
            )
    return rows


def write_mechanism(out_dir: Path, units: list[tuple[str, int]], labeler_stage: str) -> str:
    """Write mechanism.md / mechanism.json (see :func:`mechanism_summary`); return the table."""
    rows = mechanism_summary(out_dir, units)
    before = {}
    for target, seed in units:
        run_dir = out_dir / target / f"seed{seed}"
        for init, start in BORT2_INITS.items():  # the stage F_theta starts from, by bort2_init
            stage = stage_dir_name(start or labeler_stage)
            m = _read_stage_json(run_dir / stage / "metrics.json")
            if isinstance(m, dict) and "acc" in m:
                before[(target, seed, init)] = m["acc"]
    lines = [
        "σ of M_ψ over the last quarter of the stage for target examples whose pseudo-label is "
        "correct vs wrong (ground truth used for analysis only; the paper expects wrong > "
        "correct). F_θ = the labeler: its target accuracy at the start of the stage (robust: the "
        "step-1 model; bort2: Stage B's target model, or the step-1 model with "
        "`step2.bort2_init=step1`) and at the end (robust: the EMA labeler).",
        "",
        "| target | seed | variant | σ correct | σ wrong | wrong/correct | masked label acc "
        "| mask rate | hypergrad norm (median) | hyper steps (diverged, zero outer) "
        "| F_θ acc before → after |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        hn = r["hypergrad_norm_median"]
        init = r["labeler_init"]  # "step1" for a stage that has no labeler_init (Stage B)
        b = before.get((r["target"], r["seed"], init))
        acc = (
            f"{100 * b:.1f} → {100 * r['labeler_acc_after']:.1f}"
            if b is not None and r["labeler_acc_after"] is not None
            else "–"
        )
        lines.append(
            f"| {r['target']} | {r['seed']} | {r['variant']} | {r['sigma_correct']:.4f} "
            f"| {r['sigma_wrong']:.4f} | {r['sigma_ratio']:.3f} "
            f"| {100 * r['pseudo_acc_masked']:.1f} "
            f"| {r['mask_rate']:.2f} | {'–' if hn is None else f'{hn:.2e}'} "
            f"| {r['hyper_steps']} ({r['hyper_diverged']}, {r['hyper_zero_outer']}) | {acc} |"
        )
    logsig = [r["mean_log_sigma_median"] for r in rows if r["mean_log_sigma_median"] is not None]
    if logsig:
        zero = sum(r["hyper_zero_outer"] for r in rows)
        steps = sum(r["hyper_steps"] for r in rows)  # stages without hyper steps count 0
        lines += [
            "",
            f"Outer loss before its ReLU (mean log σ on the hyper-step batch), median per run: "
            f"{', '.join(f'{v:.3f}' for v in logsig)}; exactly zero (so a zero hypergradient) "
            f"in {zero} of {steps} hyper steps.",
        ]
    ratios = [r["sigma_ratio"] for r in rows if math.isfinite(r["sigma_ratio"])]
    if ratios:
        larger = sum(x > 1 for x in ratios)
        lines += [
            "",
            f"σ wrong/correct: mean {np.mean(ratios):.3f} over {len(ratios)} runs; "
            f"wrong > correct in {larger} of {len(ratios)}.",
        ]
    table = "\n".join(lines)
    atomic_write_text(json.dumps(rows, indent=2), out_dir / "mechanism.json")
    atomic_write_text("# BORT² mechanism\n\n" + table + "\n", out_dir / "mechanism.md")
    return table


def save_figure(fig, out_path: Path, dpi: int = 110) -> None:
    """``fig`` to ``out_path`` (its format from the suffix) atomically, recorded in the run
    folder's manifest like every file the pipeline writes."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=out_path.suffix.lstrip(".") or "png", dpi=dpi)
    atomic_write_bytes(buf.getvalue(), out_path)


def plot_mechanism(stage_dirs: dict[str, Path], out_path: Path, title: str) -> Path | None:
    """Pseudo-label accuracy, mask rate, tau, sigma (correct vs wrong), hypergradient norms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = {}
    for name, d in stage_dirs.items():
        h = _read_stage_json(d / "history.json")
        if isinstance(h, dict) and "history" in h:
            hist[name] = h["history"]
    if not hist:
        return None
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    panels = [
        ("pseudo_acc", "pseudo-label accuracy of F_θ (all)"),
        ("mask_rate", "mask rate"),
        ("tau", "threshold τ"),
        ("sigma", "mean σ: correct (solid) vs wrong (dashed) labels"),
        ("hyper", "BORT² hyper steps: ‖hypergradient‖ (solid), mean log σ before ReLU (dashed)"),
        ("target_acc", "target test accuracy of M_ψ"),
    ]
    for ax, (key, label) in zip(axes.flat, panels):
        for name, h in hist.items():
            if key in ("sigma", "hyper"):
                subs = (
                    (("sigma_correct", "-", "correct"), ("sigma_wrong", "--", "wrong"))
                    if key == "sigma"
                    else (
                        ("hypergrad_norm", "-", "norm"),
                        ("hyper_mean_log_sigma", "--", "mean log σ"),
                    )
                )
                for sub, ls, tag in subs:
                    x, y = _series(h, sub)
                    if len(x):
                        ax.plot(x, y, ls, label=f"{name} {tag}")
            else:
                x, y = _series(h, key)
                if len(x):
                    ax.plot(x, y, "o-" if len(x) < 30 else "-", ms=3, label=name)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step-2 iteration")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, out_path)
    plt.close(fig)
    return out_path


def plot_tsne(
    features: dict[str, tuple[np.ndarray, np.ndarray]], out_path: Path, seed: int = 0
) -> Path:
    """t-SNE of target features, one panel per model, coloured by the true class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.manifold import TSNE

    fig, axes = plt.subplots(1, len(features), figsize=(6 * len(features), 5.5), squeeze=False)
    for ax, (name, (feats, labels)) in zip(axes[0], features.items()):
        emb = TSNE(n_components=2, init="pca", random_state=seed, perplexity=30).fit_transform(
            feats.astype(np.float32)
        )
        sc = ax.scatter(emb[:, 0], emb[:, 1], c=labels, cmap="tab10", s=5)
        ax.set_title(f"{name}: target test features")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(sc, ax=axes[0].tolist(), label="class")
    save_figure(fig, out_path)
    plt.close(fig)
    return out_path


if __name__ == "__main__":
    raise SystemExit(main())
