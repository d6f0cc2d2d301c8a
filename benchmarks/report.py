"""Reporting: the suites' JSON files -> markdown tables (``<name>.md``) and PNG plots.

It reads only JSON, so ``python -m benchmarks report [suite ...]`` re-renders without measuring;
``update_docs`` replaces the generated block of ``docs/benchmarks.md`` with the peer tables.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.kit import ROOT

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"
LIBS = ["hypergrad", "torchopt", "jaxopt", "betty", "higher", "optimistix", "hypertorch"]
COLORS = dict(zip(LIBS, ["C3", "C0", "C1", "C2", "C4", "C5", "C6"]))
MARKERS = dict(cg="o", neumann="s", normal_cg="^", minres="v", unrolled="D")
MARKERS.update(exact="*", cholesky="*")  # the dense solvers
ORDER = "ridge_breast_cancer ridge_diabetes logreg_breast_cancer mlp_fashion cnn_digit5".split()
ORDER.append("unrolled_mlp")


def ms(s) -> str:
    return "–" if s is None else (f"{s * 1e3:.3g}" if s < 1 else f"{s * 1e3:,.0f}")


def err(e) -> str:
    return "–" if e is None else ("**NaN/Inf**" if not math.isfinite(e) else f"{e:.2e}")


def num(x, f: str = ".3f", unit: str = "") -> str:
    return "–" if x is None or x != x else format(x, f) + unit


def table(head: list[str], rows: list[list], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, ``r`` for right-aligned."""
    line = lambda r: "| " + " | ".join(map(str, r)) + " |"
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in (align or "l" * len(head))) + "|"
    return "\n".join([line(head), sep, *map(line, rows)])


def figure(n: int = 1, w: float = 6.4, h: float = 4.4, cols: int = 0, **kw):
    """A figure and its ``n`` panels of ``w`` x ``h`` inches, ``cols`` (default all) per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = cols or n
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False, **kw)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lines(ax, groups: dict, xlabel: str, ylabel: str, title: str = "", log: bool = True) -> None:
    """One line per (library, solver) in ``groups``: ``{(lib, solver): [(x, y), ...]}``."""
    for i, ((lib, solver), pts) in enumerate(sorted(groups.items())):
        ours = lib == "hypergrad" or lib not in COLORS
        kw = dict(marker=MARKERS.get(solver.split("+")[0], "o"), ms=4, lw=2 if ours else 1)
        kw.update(ls="-" if ours or solver == "unrolled" else "--", color=COLORS.get(lib, f"C{i}"))
        ax.plot(*zip(*pts), label=f"{lib} {solver}".strip(), **kw)
    scale = "log" if log else "linear"
    ax.set(xlabel=xlabel, ylabel=ylabel, xscale=scale, yscale=scale)
    ax.set_title(title[:90], fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)


def bars_frame(ax, target: float, label: str, ticks: list[str], title: str) -> None:
    """The reference line at 1, the target (dashed red), tick labels, legend and title."""
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(target, color="red", ls="--", lw=1, label=label)
    ax.set_xticks(range(len(ticks)), ticks, fontsize=7)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)


def render(suite: str, out: Path, name: str) -> str:
    """Write ``<name>.md`` (and plots) from ``<name>.json`` in ``out``; return the markdown.

    The renderer is ``RENDER[suite]`` (a result named ``*_units`` is rendered by :func:`units`);
    ``peers`` renders its folder of results, and the suites in ``OWN_REPORT`` write their own.

    Raises:
        KeyError: a suite with results but no row in ``RENDER``.
    """
    if suite == "peers":
        return peers(out)
    path = out / f"{name}.json"
    if suite in OWN_REPORT or not path.exists():
        return ""
    if suite not in RENDER:
        raise KeyError(f"no renderer for suite {suite!r}: add a row to RENDER in {__file__}")
    to_md = units if name.endswith("_units") else RENDER[suite]
    md = to_md(json.loads(path.read_text()), out / f"{name}.png")
    head = f"<!-- generated from {name}.json by benchmarks/report.py -->"
    (out / f"{name}.md").write_text(f"{head}\n\n{md}\n")
    return md


def verdicts(res: dict) -> list[dict]:
    """Per (hypergrad solver, K): time and memory ratios to the fastest / leanest peer whose error
    is equal or better (within 10%, or both below 1e-8 in float64 / 1e-5 in float32)."""
    recs = [r for r in res["records"] if r["status"] == "ok" and r["median_s"] is not None]
    floor, out = 1e-8 if res["info"].get("dtype") == "float64" else 1e-5, []
    for h in [r for r in recs if r["library"] == "hypergrad" and r["rel_error"] is not None]:
        bar, size = max(1.1 * h["rel_error"], floor), h.get("T") or h["K"]
        same = [r for r in recs if r["library"] != "hypergrad" and (r.get("T") or r["K"]) == size]
        peers = [r for r in same if (r["rel_error"] or math.inf) <= bar]
        peers = [r for r in peers if "T" not in h or r["solver"] == h["solver"]]
        v = dict(solver=h["solver"], K=size, hypergrad_s=h["median_s"], peers=len(peers))
        v.update(hypergrad_err=h["rel_error"], hypergrad_mib=h["peak_mib"])
        torch_peers = [r for r in peers if r["library"] not in ("jaxopt", "optimistix")]
        pools = {"": (peers, "median_s"), "_cpu": (peers, "median_cpu_s")}
        pools.update(_torch=(torch_peers, "median_cpu_s"), _mem=(peers, "peak_mib"))
        for tag, (pool, key) in pools.items():
            pool = [r for r in pool if r.get(key) is not None and h.get(key) is not None]
            if pool:
                best, off = min(pool, key=lambda r: r[key]), float(tag == "_mem")  # memory: MiB + 1
                v[f"best{tag}"] = f"{best['library']} {best['solver']}"
                v[f"ratio{tag}"] = (h[key] + off) / (best[key] + off) if best[key] + off else None
        out.append(v)
    return out


def peers_table(res: dict) -> str:
    unrolled, rows = "T" in res["records"][0], []
    mem = lambda m: "–" if m is None else f"{m:.1f}"

    def order(r):  # by K (T), unrolled first, hypergrad first on the implicit problems
        first = r["library"] == "hypergrad" and not unrolled
        return r.get("T") or r["K"], r["solver"] != "unrolled", not first, r["library"], r["solver"]

    for r in sorted(res["records"], key=order):
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        status += f" (memory run: {r['memory_error']})" if r.get("memory_error") else ""
        t, status = [ms(r["median_s"]), ms(r.get("median_cpu_s"))], status.replace("|", "\\|")
        tail = [mem(r["peak_mib"]), err(r["rel_error"]), status]
        if unrolled and r["solver"] != "unrolled":
            tail[1] = f"({err(r.get('rel_diff_to_unrolled'))} from unrolled)"
            method = f"implicit CG, K={r['K']} (after T plain steps)"
            rows.append([r["T"], r["library"], method, *t, *tail])
        elif unrolled:
            rows.append([r["T"], r["library"], "unrolled", *t, *tail])
        else:
            lib = f"**{r['library']}**" if r["library"] == "hypergrad" else r["library"]
            rows.append([r["K"], lib, r["solver"], r["products"], *t, r.get("reps", "–"), *tail])
    t, m = "median wall (ms)|median CPU (ms)", "peak memory (MiB)|rel. error|status"
    if unrolled:
        return table(f"T|library|method|{t}|{m}".split("|"), rows, "rllrrrrl")
    return table(f"K|library|solver|products|{t}|reps|{m}".split("|"), rows, "rllrrrrrrl")


VERDICT_HEAD = (
    "hypergrad solver|{K}|rel. error|wall (ms)|fastest peer at ≤ error (wall)|wall ratio|fastest "
    "peer (CPU)|CPU ratio|fastest PyTorch peer (CPU)|CPU ratio|leanest peer at ≤ error|memory ratio"
)


def verdict_table(res: dict) -> str:
    x = lambda v: "–" if v is None else f"{v:.2f}x"
    rows = []
    for v in verdicts(res):
        row = [v["solver"], v["K"], err(v["hypergrad_err"]), ms(v["hypergrad_s"])]
        for tag in ("", "_cpu", "_torch", "_mem"):
            none = "none reaches this error" if not tag else "–"
            row += [v.get(f"best{tag}", none), x(v.get(f"ratio{tag}"))]
        rows.append(row)
    head = VERDICT_HEAD.format(K="T" if "T" in res["records"][0] else "K").split("|")
    return table(head, rows, "lrrrlrlrlrlr") if rows else ""


def peers_plot(res: dict, path: Path) -> None:
    recs = [r for r in res["records"] if r["status"] == "ok" and r["median_s"]]
    key = "median_cpu_s" if all(r.get("median_cpu_s") for r in recs) else "median_s"
    tlabel = f"median {'CPU' if key == 'median_cpu_s' else 'wall'} time per hypergradient (ms)"
    if "T" in res["records"][0]:  # errors are float32 round-off, alike: time and memory vs T
        fig, axes = figure(2, 5.25)
        mem = "peak memory above baseline (MiB)"
        for ax, f, ylabel in zip(axes, (key, "peak_mib"), (tlabel, mem)):
            groups: dict = {}
            for r in [r for r in res["records"] if r.get(f) is not None]:
                y = r[f] * (1e3 if f == key else 1)
                groups.setdefault((r["library"], r["solver"]), []).append((r["T"], y))
            lines(ax, groups, "inner steps T", ylabel, f"{ylabel} vs T", log=False)
        return save(fig, path)
    fig, (ax,) = figure()
    groups, pts = {}, []
    for r in recs:
        e = r["rel_error"] if math.isfinite(r["rel_error"] or math.inf) else 10.0
        pts.append((r[key] * 1e3, min(max(e, 1e-16), 10.0)))
        groups.setdefault((r["library"], r["solver"]), []).append(pts[-1])
        kw = dict(fontsize=6, alpha=0.7, xytext=(2, 2), textcoords="offset points")
        ax.annotate(str(r["K"]), pts[-1], **kw)
    front = [p for i, p in enumerate(sorted(pts)) if all(p[1] < q[1] for q in sorted(pts)[:i])]
    if front:
        ax.step(*zip(*front), where="post", color="0.3", lw=6, alpha=0.3, label="Pareto front")
    title = res["info"].get("title") or res["problem"]
    lines(ax, groups, tlabel, "relative hypergradient error", title)
    save(fig, path)


HEADER = [
    "<!-- generated by benchmarks/report.py from benchmarks/results/peers; do not edit by hand -->",
    "Machine: {cpu}, {cores} cores (shared with other jobs; load average at start {load}), "
    "{mem_gib} GiB RAM, {gpu}; Python {python}; {threads} thread(s) for torch and XLA{pinned}.",
    "Versions: {versions}.",
    "Settings: K ∈ {ks}, T ∈ {ts}; after one warm-up call, at least {reps} timed repetitions "
    "(interleaved across configurations; cheap configurations get more, up to {max_reps}, so each "
    "is timed for ≥ {min_time} s), median wall and CPU (process) time reported; memory {memory}",
]
DESC = {  # facts of a problem, where present
    "numel": "{numel:,} inner parameters, {theta_numel} hyperparameters, run in {dtype}",
    "reference_note": "reference: {reference_note}",
    "condition_number": "Hessian condition number {condition_number:.3g}",
    "reference_cg_iters": "reference CG iterations {reference_cg_iters} (residual "
    "{reference_residual:.1e})",
    "oracle_agreement": "torchopt-CG oracle agrees to {oracle_agreement:.1e}",
    "alpha": "Neumann alpha = 1/lambda_max = {alpha:.4g}",
}
RUN = (
    " Run {created} (hypergrad {hypergrad}): K/T ∈ {grid}, ≥ {reps} timed repetitions, load "
    "average at start {load}."
)
VERDICT = (
    "Targets (hypergrad vs the fastest / leanest peer with equal or better error at the same K; "
    "ratios < 1 mean hypergrad is better; memory ratio is (MiB + 1)/(MiB + 1)):"
)


def peers(out: Path) -> str:
    """The plots, ``peers.md`` and ``peers.json`` (verdicts) from ``out/peers/<problem>.json``."""
    rank = {k: i for i, k in enumerate(ORDER)}
    files = sorted((out / "peers").glob("*.json"), key=lambda p: (rank.get(p.stem, 99), p.stem))
    results = [json.loads(p.read_text()) for p in files if p.stem != "peers"]
    if not results:
        return ""
    meta = max((r["meta"] for r in results), key=lambda m: m.get("created", ""))
    m, cpus = meta["machine"], meta["machine"].get("cpus_allowed")
    load = lambda m: tuple(round(x, 1) for x in m["loadavg"])
    fields = {**meta, **m, "load": load(m), "gpu": m.get("gpu") or "no GPU"}
    fields["versions"] = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    fields["pinned"] = f", the process pinned to {cpus} CPU(s)" if cpus else ""
    measured = meta.get("memory", not meta.get("no_memory"))
    fields["memory"] = "= peak RSS growth of one call in a fresh process (see method). "
    fields["memory"] = fields["memory"] if measured else "not measured."
    parts = [line.format(**fields) for line in HEADER]
    parts[-1] += "**Quick run (reduced grid).**" if meta["quick"] else ""
    parts = [x for line in parts for x in (line, "")]
    for res in results:
        name, info, rm = res["problem"], res["info"], res.get("meta") or {}
        facts = {**info, **(info.get("extras") or {})}
        if name == "unrolled_mlp":
            facts.pop("alpha", None)
        desc = [f"problem `{name}`"] + [t.format(**facts) for k, t in DESC.items() if facts.get(k)]
        run = ""
        if rm:
            grid = rm.get("ts") if name == "unrolled_mlp" else rm.get("ks")
            kw = dict(created=rm.get("created") or res.get("created"), grid=grid)
            kw["load"] = load(res.get("machine") or rm["machine"])
            run = RUN.format(hypergrad=rm["versions"].get("hypergrad"), reps=rm.get("reps"), **kw)
        peers_plot(res, out / "peers" / f"{name}.png")
        wall = f". Wall time of this problem's run: {res['wall_s']:.0f} s."
        parts += [f"### {info.get('title', name)}", "", "; ".join(desc) + wall + run, ""]
        parts += [f"![{name}](../benchmarks/results/peers/{name}.png)", "", peers_table(res), ""]
        parts += [VERDICT, "", verdict_table(res), ""] if verdict_table(res) else []
    md = "\n".join(parts)
    (out / "peers" / "peers.md").write_text(md.replace("](../benchmarks/results/peers/", "]("))
    summary = {"meta": meta, "verdicts": {r["problem"]: verdicts(r) for r in results}}
    (out / "peers" / "peers.json").write_text(json.dumps(summary, indent=1, default=str))
    return md


def update_docs(md: str, doc: Path = DOC) -> None:
    """Replace the block between the peers markers of docs/benchmarks.md."""
    head, rest = doc.read_text().split(BEGIN, 1)
    doc.write_text(head + BEGIN + "\n" + md + "\n" + END + rest.split(END, 1)[1])


def roots(d: dict, path: Path) -> str:
    """The roots suite's tables and plot (its renderer lives with the suite)."""
    from benchmarks.suites.roots import report as render_roots

    return render_roots(d, path)


def whole_loop(d: dict, path: Path) -> str:
    """The whole-loop suite's tables and plot (its renderer lives with the suite)."""
    from benchmarks.suites.whole_loop import report as render_whole_loop

    return render_whole_loop(d, path)


def first_call(d: dict, path: Path) -> str:
    """The first-call suite's table (its renderer lives with the suite)."""
    from benchmarks.suites.first_call import report as render_first_call

    return render_first_call(d, path)


def time_to_accuracy(d: dict, path: Path) -> str:
    fig, axes = figure(len(d["problems"]), 4.6, 4.0, cols=min(len(d["problems"]), 3))
    parts = [
        "Each library's fastest configuration that reaches the target relative hypergradient "
        "error (median of the interleaved timed calls; ratio = time / the fastest peer's)."
    ]
    for ax, p in zip(axes, d["problems"]):
        best = sorted(p["best"].items(), key=lambda kv: kv[1]["median_s"])
        peer = next((b["median_s"] for lib, b in best if lib != "hypergrad"), None)
        rows = []
        for lib, b in best:  # K "–" for the dense solvers (K = 0, or 1 before 2026-11-26)
            k = "–" if b["solver"].split("+")[0] in ("exact", "cholesky") or not b["K"] else b["K"]
            ratio = num(b["median_s"] / peer, ".2f") if peer else "–"
            name = f"**{lib}**" if lib == "hypergrad" else lib
            rows.append([name, b["solver"], k, err(b["rel_error"]), ms(b["median_s"]), ratio])
            pt = (b["median_s"] * 1e3, max(b["rel_error"], 1e-17))
            ax.plot(*pt, "*", ms=14, color=COLORS.get(lib, "k"), mec="k")
        head = "library|solver|K|rel. error|time (ms)|ratio".split("|")
        parts.append(f"\n### {p['info']['title']}\n")
        parts.append(f"Problem `{p['problem']}`, target {p['target']:g}.\n")
        parts.append(table(head, rows, "llrrrr"))
        why = {r["library"]: r["error"] or "not reached" for r in p["walk"]}
        why = {lib: e for lib, e in why.items() if lib not in p["best"]}
        if why:
            parts.append(
                "\nNot reaching it: " + "; ".join(f"{k} ({v})" for k, v in why.items()) + "."
            )
        groups: dict = {}
        for r in [r for r in p["walk"] if r.get("time_1_s") and r.get("rel_error") is not None]:
            pt = (r["time_1_s"] * 1e3, max(r["rel_error"], 1e-17))
            groups.setdefault((r["library"], r["solver"]), []).append(pt)
        ax.axhline(p["target"], color="k", ls=":", lw=1)
        xlabel = "time per hypergradient (ms; stars: timed best)"
        lines(ax, groups, xlabel, "relative error", p["info"]["title"])
    save(fig, path)
    return "\n".join(parts)


def overhead(d: dict, path: Path) -> str:
    recs, rows = d["records"], []
    for r in recs:
        ew, ratio = r.get("extra_work"), f"**{r['ratio_of_medians']:.3f}**"
        sweeps = f"{ew['extra_param_passes']:.0f} / {ew['hand_param_passes']:.0f}" if ew else "–"
        keys = ("median_library_s", "median_hand_s", "median_paired_ratio", "ratio_of_minima")
        t = [num(r[k]) for k in keys]
        rows.append([r["model"].upper(), r["solver"], r["K"], *t[:2], ratio, *t[2:], sweeps])
    ratios = [np.array(r["times_library_s"]) / np.array(r["times_hand_s"]) for r in recs]
    med, x = np.array([r["ratio_of_medians"] for r in recs]), range(len(recs))
    q1, q3 = (np.array([np.percentile(r, q) for r in ratios]) for q in (25, 75))
    fig, (ax,) = figure(1, max(5, 1.1 * len(recs)), 3.6)
    ax.bar(x, med, color=["C0" if r["model"] == "mlp" else "C1" for r in recs])
    whiskers = [np.maximum(0, med - q1), np.maximum(0, q3 - med)]
    ax.errorbar(x, med, yerr=whiskers, fmt="none", ecolor="k", capsize=3)
    ax.set(ylabel="time(library) / time(hand loop)", ylim=(0.8, max(1.3, q3.max() + 0.05)))
    ticks = [f"{r['model']}\n{r['solver']} K={r['K']}" for r in recs]
    title = "hg.implicit_grad overhead (median; whiskers: IQR of paired ratios)"
    bars_frame(ax, d["target"], f"target {d['target']}", ticks, title)
    save(fig, path)
    head = "model|solver|K|library (s)|hand (s)|**ratio of medians**|paired|minima|extra parameter "
    return table((head + "sweeps / hand's").split("|"), rows, "lllrrrrrr")


def units(d: dict, path: Path) -> str:
    u, models, rows = d["unit_costs_ms"], list(d["unit_costs_ms"]), []
    for op, a, b in (
        ("tree_norm", "norm_s", "linalg_vector_norm_s"),
        ("tree_vdot", "tree_vdot_s", "flat_dot_s"),
        ("tree_all_finite", "finite_check_s", "finite_of_sums_s"),
        ("tree_axpy", "tree_axpy_s", "fused_add_alpha_s"),
    ):
        rows.append([op] + [f"{u[m][k]:.3g} ms" for k in (a, b) for m in models])
    alt = [f"single-pass alternative, {m}" for m in models]
    return table(["operation on all parameters", *models, *alt], rows, "l" + "r" * 2 * len(models))


HVP = dict(reuse_setup="reuse setup (fwd + create_graph bwd)", reuse_hvp="reuse HVP")
HVP.update(raw_hvp="raw torch HVP", recompute_hvp="recompute HVP", fwd_over_rev_hvp="fwd-over-rev")


def hvp_cost(d: dict, path: Path) -> str:
    models, rows = d["models"], []
    fig, (ax,) = figure(1, 7.5, 3.6)
    for i, (m, r) in enumerate(models.items()):
        ratios = [r["ratio_to_gradient"].get(k) for k in HVP]
        offset, width = (i - (len(models) - 1) / 2) * 0.8 / len(models), 0.8 / len(models)
        heights = [float(x) if x != "–" else 0.0 for x in (num(v, ".3f") for v in ratios)]
        ax.bar(np.arange(len(HVP)) + offset, heights, width, label=m)
        rows.append([m.upper(), ms(r["median_s"]["gradient"]) + " ms"])
        rows[-1] += [num(v, ".2f", "×") for v in ratios]
    ticks = [lab.replace(" (", "\n(") for lab in HVP.values()]
    ax.set_ylabel("time / time(one gradient)")
    title = "Cost of one Hessian-vector product relative to one gradient (medians)"
    bars_frame(ax, d["target_reuse"], f"reuse target {d['target_reuse']}", ticks, title)
    save(fig, path)
    return table(["model", "gradient", *HVP.values()], rows, "lrrrrrr")


def memory(d: dict, path: Path) -> str:
    methods, at = ["implicit", "unrolled", "truncated"], {}
    for r in d["records"]:
        at.setdefault(r["method"], {})[r["T"]] = r["peak_mib"]
    head = ["T", f"implicit (CG {d['cg_iters']})", "unrolled (full)"]
    head.append(f"truncated (K = {d['truncate']})")
    cell = lambda m, T: num(at.get(m, {}).get(T), ".1f", " MiB")
    rows = [[T] + [cell(m, T) for m in methods] for T in sorted(at["implicit"])]
    fit = [num(d["fits"].get(m, {}).get("mib_per_step"), ".2f") for m in methods]
    fig, (ax,) = figure(1, 5.2, 3.6)
    groups = {(label, ""): list(at[m].items()) for m, label in zip(methods, head[1:]) if m in at}
    title, ylabel = "Peak RSS of one hypergradient (MLP, CPU)", "peak memory above baseline (MiB)"
    lines(ax, groups, "inner steps T", ylabel, title, log=False)
    save(fig, path)
    ref = d["implicit_alone_vs_hand_mib"]
    alone = f"`hg.implicit_grad` alone: +{ref['implicit_only']:.1f} MiB; the hand-written CG loop: "
    md = table(head, rows + [["linear fit, MiB per step", *fit]], "rrrr")
    return f"{md}\n\n{alone}+{ref['hand_loop']:.1f} MiB."


def solver_accuracy(d: dict, path: Path) -> str:
    per = d["per_kappa"]
    methods = list(next(iter(per.values()))["curves"])
    fig, axes = figure(len(per), 4.2, 3.8, sharey=True)
    for ax, (k, r) in zip(axes, per.items()):
        for m, c in r["curves"].items():
            ls = "-" if m in ("CG", "Neumann (alpha=1/lmax)") else "--"
            ax.loglog(c["iters"], np.maximum(np.array(c["rel_err"], float), 1e-16), ls=ls, label=m)
        ax.axhline(d["target"], color="gray", lw=0.8, ls=":")
        ax.set(title=f"kappa = {k}", xlabel="iterations (HVPs; unrolled: steps T)", ylim=(1e-12, 3))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("relative hypergradient error")
    axes[0].legend(fontsize=7, loc="lower left")
    spectrum = d.get("spectrum", "log")
    fig.suptitle(
        f"Hypergradient error vs iterations, quadratic bilevel problem (n={d['n']}, "
        f"{spectrum}-spaced eigenvalues, float64)"
    )
    save(fig, path)
    rows = [
        [f"{int(float(k)):,}"] + [num(r["curves"][m]["iters_to_target"], ",.0f") for m in methods]
        for k, r in per.items()
    ]
    rows.append(["**log-log slope**"] + [f"**{num(d['slopes'][m], '.2f')}**" for m in methods])
    return table(["κ", *methods], rows, "r" * (len(methods) + 1))


def outer_loop(d: dict, path: Path) -> str:
    """Per example phase: total hypergradient time, CG iterations and test accuracy per adjoint
    option (ratio to cold CG); the plot shows the time per outer step."""
    phases = sorted({(r["example"], p) for r in d["runs"] for p in r["phases"]})
    fig, axes = figure(len(phases), 4.6, 3.6, cols=3)
    rows = []
    for ax, (example, phase) in zip(axes, phases):
        base = None
        for r in d["runs"]:
            s = r["phases"].get(phase) if r["example"] == example else None
            if s is None:
                continue
            total = sum(s["time_s"])
            base = total if base is None else base  # the first config is cold CG
            ax.plot(range(1, len(s["time_s"]) + 1), s["time_s"], lw=1, label=r["config"])
            rows.append([f"`{example}.py` {phase}", r["config"], len(s["time_s"])])
            rows[-1] += [f"{sum(s['cg_iterations']):,}", f"{total:.2f}", f"**{total / base:.2f}×**"]
            rows[-1].append(f"{s['test_acc']:.4f}")
        ax.set(xlabel="outer step", ylabel="hypergradient time (s)", yscale="log")
        ax.set_title(f"{example}: {phase}", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    save(fig, path)
    head = "run|adjoint|hypergradients|solver iterations|time (s)|vs cold CG|test accuracy"
    return table(head.split("|"), rows, "llrrrrr")


#: suite -> the function that turns its ``<name>.json`` into markdown (and writes its plot to the
#: path it is given): the contract between a suite's ``measure`` and this module
META_LABELS = {
    "backward": "forward+backward (the unit)",
    "implicit_cg": "Implicit, CG(5, damping 1)",
    "implicit_neumann": "Implicit, Neumann(5)",
    "unrolled": "Unrolled, 1 SGD step",
    "first_order": "FirstOrder (terms 0)",
    "first_order_terms2": "FirstOrder (terms 2)",
    "single_loop": "SingleLoop",
}


def meta_cost(d: dict, path: Path) -> str:
    models = list(dict.fromkeys(r["model"] for r in d["records"]))
    at = {(r["model"], r["method"]): r for r in d["records"]}
    rows = []
    for m in META_LABELS:
        row = [META_LABELS[m]]
        for model in models:
            r = at.get((model, m), {})
            row.append(num(r.get("time_units"), ".2f", "×"))
            row.append(num(r.get("peak_units"), ".2f", "×"))
        rows.append(row)
    unit = [f"{ms(at[(mo, 'backward')]['time_s'])} ms" for mo in models]
    head = ["method"] + [f"{mo} {k}" for mo in models for k in ("time", "peak memory")]
    note = "\n\nUnit: " + ", ".join(f"{mo} {u}" for mo, u in zip(models, unit)) + " per call."
    return table(head, rows, "l" + "rr" * len(models)) + note


RENDER: dict[str, Callable[[dict, Path], str]] = {
    "meta_cost": meta_cost,
    "roots": roots,
    "time_to_accuracy": time_to_accuracy,
    "overhead": overhead,
    "hvp_cost": hvp_cost,
    "memory": memory,
    "solver_accuracy": solver_accuracy,
    "outer_loop": outer_loop,
    "first_call": first_call,
    "whole_loop": whole_loop,
}
#: suites whose ``measure`` writes its own report (``diagnostics``: profiles under ``peers/``;
#: ``gpu``: ``gpu/<machine>.md``), so :func:`render` has nothing to do for them
OWN_REPORT = ("diagnostics", "gpu")
