"""The gate (issue 24, item 2): does a live bilevel step point the right way?

No training of F_theta: on Stage-B checkpoints, the hyper step's hypergradient g = dL_out/dtheta
is computed (``BilevelLabelUpdater`` / ``hg.HyperStep.compute``) and not applied, for several
estimators x outer objectives, and compared with d* = grad_theta CE(F_theta(x_weak), y_true) on
the same inner batch (ground truth for analysis only). Alignment A = cos(g, d*) = cos(-g, -d*):
A > 0 means the hyper step lowers the labeler's true-label CE on that batch to first order. The
null is the oracle objective with the held-out labels permuted within the outer batch. The
pre-registered design and decision rule are in docs/bort2.md ("The gate").

Usage::

    python examples/bort2/scripts/gate.py --make          # the Stage-B checkpoints (pipeline)
    python examples/bort2/scripts/gate.py --jobs 2        # measure: results/gate.{json,md,png}
    python examples/bort2/scripts/gate.py --grid first    # the first gate's reduced unit counts
    python examples/bort2/scripts/gate.py --report        # the table/plot from the JSON
    python examples/bort2/scripts/gate.py --quick         # a tiny grid into results/quick/

Checkpoints come from ``run.py target=T seeds=2 jobs=2 step1.methods=fixmatch_cm
step2.methods=robust step2.outer=val`` (``--make`` runs exactly this, into ``--runs``;
``--make-jobs 1`` runs the two seeds one after the other, with the same numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _bench
import torch
import torch.nn.functional as F
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[1]
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from bort2.checkpoint import load_checkpoint  # noqa: E402
from bort2.config import KEYS, Config, HyperConfig, Step2Config, load_config  # noqa: E402
from bort2.inputs import Views, prepare  # noqa: E402
from bort2.stages_index import SPECS, STAGE_B, stage_dir_name  # noqa: E402
from bort2.step2.hyper import (  # noqa: E402
    AuthorsNeumann,
    BilevelLabelUpdater,
    current_mask,
    replay,
)
from bort2.step2.losses import build_student, build_threshold  # noqa: E402
from bort2.step2.stages import load_labeler, split_val  # noqa: E402

import hypergrad as hg  # noqa: E402
from hypergrad.modules import frozen_buffers  # noqa: E402

NAME = "gate"
OBJECTIVES = ("paper", "teacher", "consistency", "oracle", "null")
LABELS = {
    "paper": "(a) mean log σ, no ReLU",
    "teacher": "(b) held-out CE, step-1 teacher",
    "consistency": "(c) held-out consistency",
    "oracle": "(d) held-out CE, ground truth",
    "null": "null: (d), permuted labels",
}
TEACHER_CONF = 0.95
TARGETS, SEEDS = ("uci_m", "syn_m"), (0, 1)


@dataclass
class Estimator:
    """One estimator of the grid: labels, solver, inner batch and how many units."""

    name: str
    soft: bool  # softmax(F/T) labels instead of straight-through Gumbel
    solver: str  # "n3": the authors' 3-term series; "minres": hg.MINRES(maxiter=20, tol=1e-3)
    batch: int
    batches: int
    draws: int
    first_draw: int = 0  # draws first_draw..draws-1 only (to add draws to an earlier run)


#: ``--grid``: the unit counts of docs/bort2.md's pre-registration (E1 10 x 5, E2 10 x 5,
#: E3 10 x 1 with MINRES-20 as the first gate ran it, E4 5 x 2), and the reduced counts the first
#: gate ran (results/gate.*: E1 run as 10 x 2, then draws 2-4 added)
GRIDS = {
    "preregistered": (
        Estimator("hard-N3-64", False, "n3", 64, 10, 5),
        Estimator("soft-N3-64", True, "n3", 64, 10, 5),
        Estimator("soft-MINRES-64", True, "minres", 64, 10, 1),
        Estimator("soft-N3-256", True, "n3", 256, 5, 2),
    ),
    "first": (
        Estimator("hard-N3-64", False, "n3", 64, 10, 5),
        Estimator("soft-N3-64", True, "n3", 64, 10, 2),
        Estimator("soft-MINRES-64", True, "minres", 64, 6, 1),
        Estimator("soft-N3-256", True, "n3", 256, 4, 1),
    ),
}
GRID = GRIDS["preregistered"]
AVERAGED = {"hard-N3-64": "hard-N3-64-avg", "soft-N3-64": "soft-N3-64-avg"}
OUTER_BATCH = 128


# ---------------------------------------------------------------- small pieces (tested)
def cosine(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """Cosine between two parameter tuples, flattened and concatenated (float64)."""
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(float(x.double().pow(2).sum()) for x in a))
    nb = math.sqrt(sum(float(y.double().pow(2).sum()) for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else float("nan")


def shuffled(y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The null's labels: ``y`` permuted (the same multiset of labels, no label information)."""
    return y[torch.randperm(len(y), generator=generator)]


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (nan s.e. for fewer than 2 values)."""
    v = [x for x in values if math.isfinite(x)]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in v) / (len(v) - 1)
    return m, math.sqrt(var / len(v))


# ---------------------------------------------------------------- the hyper step, per objective
class GateUpdater(BilevelLabelUpdater):
    """The pipeline's updater with soft labels, a chosen solver and the gate's outer losses."""

    def __init__(self, student, labeler, threshold, soft: bool, solver: hg.Solver):
        # library convention: the inner CE is -sum y log p (the authors' form for hard labels)
        hyper = HyperConfig(convention="library", outer_relu=False, apply=False)
        super().__init__(student, labeler, threshold, Step2Config(hyper=hyper))
        self.soft, self.objective = soft, "paper"
        self.step = hg.HyperStep(
            inner=student,
            hyper=labeler,
            inner_loss=self._inner,
            outer_loss=self._outer,
            solver=solver,
            buffers="freeze",
            on_diverged="write",
        )
        self.step.measure_stationarity = False

    def _labels(self, batch):
        if not self.soft:
            return super()._labels(batch)
        with replay(batch["seed_f"], batch["x_weak"].device):
            logits = self.labeler(batch["x_weak"])
        conf, pred = logits.detach().softmax(1).max(1)
        mask = current_mask(self.threshold, conf, pred)
        return (logits / self.s2.temperature).softmax(1), mask

    def _outer(self, model, batch):
        o = self.objective
        if o == "paper":  # the inner batch (outer=train), no ReLU
            return super()._outer(model, batch)
        logits, _ = self._student(model, batch["x"], batch["seed_m"])
        if o == "teacher":
            m = batch["teacher_mask"].to(logits.dtype)
            ce = F.cross_entropy(logits, batch["y_teacher"], reduction="none")
            return (ce * m).sum() / m.sum().clamp_min(1.0)
        if o == "consistency":
            weak, _ = self._student(model, batch["x_weak"], batch["seed_w"])
            p = weak.detach().softmax(1)
            return (p * (p.clamp_min(1e-12).log() - logits.log_softmax(1))).sum(1).mean()
        if o == "oracle":
            return F.cross_entropy(logits, batch["y"])
        if o == "null":
            return F.cross_entropy(logits, batch["y_null"])
        raise ValueError(f"unknown objective {o!r}")

    def hypergradient(self, batch, outer_batch, objective: str):
        self.objective = objective
        self.labeler.train()
        self.student.train()
        hyper, info = self.step.compute(batch, None if objective == "paper" else outer_batch)
        return hyper, info


def true_direction(labeler: nn.Module, batch: dict[str, Any], y: torch.Tensor):
    """d* = grad_theta CE(F_theta(x_weak), y) with the unit's replayed F_theta draw (train mode,
    buffers untouched)."""
    params = [p for p in labeler.parameters() if p.requires_grad]
    labeler.train()
    with frozen_buffers([labeler]), replay(batch["seed_f"], batch["x_weak"].device):
        ce = F.cross_entropy(labeler(batch["x_weak"]), y)
    return tuple(g.detach() for g in torch.autograd.grad(ce, params))


# ---------------------------------------------------------------- one checkpoint
@dataclass
class Unit:
    """Everything a checkpoint's measurement needs (models in memory, uint8 images)."""

    cfg: Config
    labeler: nn.Module
    student: nn.Module
    teacher: nn.Module
    tau: float
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    name: str = "checkpoint"


def measure_checkpoint(
    u: Unit,
    grid: tuple[Estimator, ...] = GRID,
    outer_batch: int = OUTER_BATCH,
    seed: int = 0,
    on_estimator=None,
    minres_steps: int = 20,
) -> dict[str, Any]:
    """Alignments of every estimator x objective on one checkpoint.

    Returns ``{"cells": {est: {obj: [[b, j, A], ...]}}, "solve": {...}, "lambda_max": ...}``;
    ``on_estimator(partial)`` is called after each estimator (partial results).
    """
    dev = torch.device("cpu")
    labeler, student, teacher = u.labeler.to(dev), u.student.to(dev), u.teacher.to(dev).eval()
    for p in labeler.parameters():
        p.requires_grad_(True)
    threshold = build_threshold("fixed", float(u.tau), 0.999, int(u.train_y.max()) + 1)
    gen = torch.Generator().manual_seed(1000 + seed)
    views = Views(u.cfg.data.views, u.cfg.data.benchmark, gen)
    with torch.no_grad():  # the teacher's confident labels on the whole held-out split
        vx = prepare(u.val_x, dev)
        tprob = teacher(views.weak(vx)).softmax(1)
    t_conf, t_pred = tprob.max(1)
    out: dict[str, Any] = {
        "name": u.name,
        "tau": float(u.tau),
        "teacher_coverage": float((t_conf >= TEACHER_CONF).float().mean()),
        "teacher_acc_confident": float((t_pred == u.val_y)[t_conf >= TEACHER_CONF].float().mean()),
        "cells": {},
        "solve": {},
        "time_s": {},
    }
    n_train, n_val = len(u.train_x), len(u.val_x)
    for est in grid:
        t0 = time.process_time()
        perm = torch.randperm(
            n_train, generator=torch.Generator().manual_seed(seed * 7 + est.batch)
        )
        cells: dict[str, list] = {o: [] for o in OBJECTIVES}
        diverged, iters = 0, []
        updater = None
        for b in range(est.batches):
            idx = perm[(b * est.batch) % n_train :][: est.batch]
            x0 = prepare(u.train_x[idx], dev)
            y = u.train_y[idx]
            bgen = torch.Generator().manual_seed(seed * 100003 + b)
            bviews = Views(u.cfg.data.views, u.cfg.data.benchmark, bgen)
            x_weak, x_strong = bviews.weak(x0), bviews.strong(x0)
            for j in range(est.first_draw, est.draws):
                ugen = torch.Generator().manual_seed(seed * 1000003 + b * 101 + j)
                oidx = torch.randperm(n_val, generator=ugen)[: min(outer_batch, n_val)]
                ox0 = prepare(u.val_x[oidx], dev)
                oy = u.val_y[oidx]
                outer = {
                    "x": bviews.strong(ox0),
                    "x_weak": bviews.weak(ox0),
                    "y": oy,
                    "y_null": shuffled(oy, ugen),
                    "y_teacher": t_pred[oidx],
                    "teacher_mask": t_conf[oidx] >= TEACHER_CONF,
                }
                dgen = torch.Generator().manual_seed(seed * 7919 + b * 31 + j)
                if updater is None:
                    if est.solver == "n3":
                        solver = AuthorsNeumann(steps=3, alpha=5e-5)
                    else:  # a real implicit solve; safe on an indefinite Hessian
                        solver = hg.MINRES(maxiter=minres_steps, tol=1e-3)
                    updater = GateUpdater(student, labeler, threshold, est.soft, solver)
                batch, _ = updater.batches(x_strong, x_weak, dgen)
                seeds = torch.randint(0, 2**62, (2,), generator=ugen).tolist()
                outer.update(seed_m=seeds[0], seed_w=seeds[1])
                d_star = true_direction(labeler, batch, y)
                for o in OBJECTIVES:
                    g, info = updater.hypergradient(batch, outer, o)
                    cells[o].append([b, j, cosine(tuple(g), d_star)])
                    diverged += int(info.solve.diverged)
                    iters.append(info.solve.iterations)
                    if est.name in AVERAGED:
                        cells.setdefault(f"_g_{o}", []).append([b, j, [t.clone() for t in g]])
                if est.name in AVERAGED:
                    cells.setdefault("_dstar", []).append([b, j, list(d_star)])
        out["cells"][est.name] = cells
        # the batch-averaged variant: per draw, g and d* averaged over the batches
        if est.name in AVERAGED:
            avg: dict[str, list] = {o: [] for o in OBJECTIVES}
            ds = cells.pop("_dstar")
            for o in OBJECTIVES:
                gs = cells.pop(f"_g_{o}")
                for j in range(est.first_draw, est.draws):
                    g_j = [torch.stack(t).mean(0) for t in zip(*[g for _, jj, g in gs if jj == j])]
                    d_j = [torch.stack(t).mean(0) for t in zip(*[d for _, jj, d in ds if jj == j])]
                    avg[o].append([-1, j, cosine(tuple(g_j), tuple(d_j))])
            out["cells"][AVERAGED[est.name]] = avg
        out["solve"][est.name] = {
            "diverged": diverged,
            "solves": len(iters),
            "mean_iterations": sum(iters) / max(1, len(iters)),
        }
        out["time_s"][est.name] = time.process_time() - t0
        if on_estimator is not None:
            on_estimator(out)
    return out


# ---------------------------------------------------------------- checkpoints on disk
#: the step-1 teacher: the default labeler (``step1.labeler``)
TEACHER = f"step1/{KEYS['step1.labeler'].default}"


def pipeline_command(runs: Path, target: str, seeds: int, jobs: int = 2) -> list[str]:
    return [
        sys.executable, str(EXAMPLE / "run.py"), f"target={target}", f"seeds={seeds}",
        f"jobs={jobs}", "threads=1", f"step1.methods={SPECS[TEACHER].method}",
        f"step2.methods={SPECS[STAGE_B].method}",
        "step2.outer=val", f"output_dir={runs / target}", "tensorboard=false", "tsne=false",
        "progress=false",
    ]  # fmt: skip


def unit_paths(runs: Path, target: str, seed: int, layout: str) -> tuple[Path, Path]:
    """Stage B's folder and the step-1 teacher's file of one (target, seed).

    ``layout="pipeline"``: ``--make``'s runs (``runs/T/T/seedS/step2_robust``, the teacher
    ``step1_fixmatch_cm/final.pt``). ``layout="snapshot"``: the reduced checkpoints of the
    committed result (``runs/b_T_sS/T/seedS/step2_robust``, Stage B started with
    ``step1.checkpoint=runs/snap/T_seedS.pt``, which is also the teacher).
    """
    if layout == "pipeline":
        seed_dir = runs / target / target / f"seed{seed}"
        return seed_dir / stage_dir_name(STAGE_B), seed_dir / stage_dir_name(TEACHER) / "final.pt"
    seed_dir = runs / f"b_{target}_s{seed}" / target / f"seed{seed}"
    return seed_dir / stage_dir_name(STAGE_B), runs / "snap" / f"{target}_seed{seed}.pt"


def load_unit(runs: Path, target: str, seed: int, layout: str = "pipeline") -> Unit:
    """Stage B's M_psi and F_theta, the step-1 teacher, tau and the data of one run."""
    from bort2.data.registry import load_benchmark

    stage, teacher_path = unit_paths(runs, target, seed, layout)
    cfg = load_config(None, [f"target={target}", "step2.outer=val"])
    bench = load_benchmark(cfg.data.benchmark)
    nc = bench.num_classes
    path = stage / "final.pt"
    labeler = load_labeler(cfg, path, nc, key="labeler", expect=None)
    student = build_student(
        labeler, SPECS[STAGE_B].plain_student, nc, cfg.step2.sigma_init, cfg.model.sigma_head
    )
    student.load_state_dict(load_checkpoint(path, None)["model"])
    teacher = load_labeler(cfg, teacher_path, nc, expect=None)
    hist = json.loads((stage / "history.json").read_text())["history"]
    tau = hist["tau"][-1][1]
    ds = bench.split(target, "train")
    tr, va = split_val(len(ds), cfg.step2.val_fraction, seed)
    return Unit(
        cfg, labeler, student, teacher, tau,
        ds.images[tr], ds.labels[tr], ds.images[va], ds.labels[va], f"{target}/seed{seed}",
    )  # fmt: skip


def _worker(args: tuple[str, str, int, str, int, str, str]) -> dict[str, Any]:
    runs, target, seed, part, threads, layout, grid = args
    torch.set_num_threads(threads)
    u = load_unit(Path(runs), target, seed, layout)

    def keep(partial):
        Path(part).write_text(json.dumps(partial))
        _bench.log(f"{u.name}: {list(partial['cells'])} done ({partial['time_s']})")

    return measure_checkpoint(u, GRIDS[grid], seed=seed, on_estimator=keep)


def merge_extra(ck: dict[str, Any], extra: dict[str, Any]) -> None:
    """Append an extra run's units (further draws of the same estimators) to ``ck``."""
    for est, cells in extra["cells"].items():
        for o, rows in cells.items():
            ck["cells"].setdefault(est, {}).setdefault(o, []).extend(rows)
    for est, v in extra["solve"].items():
        w = ck["solve"].setdefault(est, {"diverged": 0, "solves": 0, "mean_iterations": 0.0})
        n = w["solves"] + v["solves"]
        w["mean_iterations"] = (
            w["mean_iterations"] * w["solves"] + v["mean_iterations"] * v["solves"]
        ) / max(1, n)
        w["diverged"] += v["diverged"]
        w["solves"] = n
    for est, t in extra["time_s"].items():
        ck["time_s"][est] = ck["time_s"].get(est, 0.0) + t
    ck.setdefault("extra", []).append(list(extra["cells"]))


# ---------------------------------------------------------------- summary, table, plot
def summarize(checkpoints: list[dict[str, Any]]) -> dict[str, Any]:
    """Per checkpoint x estimator x objective: mean A, Delta vs the null (paired), beats-null."""
    out: dict[str, Any] = {}
    for ck in checkpoints:
        for est, cells in ck["cells"].items():
            null = {(b, j): a for b, j, a in cells["null"]}
            for o in OBJECTIVES:
                by_b: dict[int, list] = {}
                dif_b: dict[int, list] = {}
                unit_key = (lambda b, j: j) if est.endswith("-avg") else (lambda b, j: b)
                for b, j, a in cells[o]:
                    by_b.setdefault(unit_key(b, j), []).append(a)
                    dif_b.setdefault(unit_key(b, j), []).append(a - null[(b, j)])
                m, se = mean_se([sum(v) / len(v) for v in by_b.values()])
                dm, dse = mean_se([sum(v) / len(v) for v in dif_b.values()])
                pos = sum(1 for _, _, a in cells[o] if a > 0)
                out.setdefault(est, {}).setdefault(o, {})[ck["name"]] = {
                    "mean": m, "se": se, "delta": dm, "delta_se": dse, "n": len(by_b),
                    "positive": f"{pos}/{len(cells[o])}",
                    "beats_null": bool(o != "null" and math.isfinite(dse) and dm > 2 * dse),
                }  # fmt: skip
    return out


def decide(summary: dict[str, Any], n_checkpoints: int) -> dict[str, Any]:
    """The pre-registered rule: some estimator with the oracle beating the null on >= 3 of 4
    checkpoints and, under it, (b) or (c) doing the same."""
    need = 3 if n_checkpoints == 4 else max(1, math.ceil(0.75 * n_checkpoints))
    per: dict[str, Any] = {}
    for est, objs in summary.items():
        wins = {o: sum(v["beats_null"] for v in objs[o].values()) for o in objs if o != "null"}
        ok = wins["oracle"] >= need and (wins["teacher"] >= need or wins["consistency"] >= need)
        per[est] = {"wins": wins, "passes": ok}
    return {"need": need, "per_estimator": per, "pass": any(v["passes"] for v in per.values())}


def to_md(d: dict[str, Any]) -> str:
    s, dec = d["summary"], d["decision"]
    names = [ck["name"] for ck in d["checkpoints"]]
    lines = []
    if d.get("partial"):
        lines.append(f"**PARTIAL RESULTS**: {d['partial']}\n")
    lines.append(
        f"Alignment A = cos(g, d*) per cell: mean ± s.e. over batches (over draws for `-avg`); "
        f"Δ = A − A_null, paired; ✓ = Δ > 2 s.e. Checkpoints: {', '.join(names)}.\n"
    )
    for est, objs in s.items():
        lines.append(f"### {est}\n")
        rows = []
        for o in OBJECTIVES:
            row = [LABELS[o]]
            for n in names:
                c = objs[o].get(n)
                if c is None:
                    row.append("—")
                    continue
                cell = f"{c['mean']:+.3f} ± {c['se']:.3f}"
                if o != "null":
                    mark = " ✓" if c["beats_null"] else ""
                    cell += f" (Δ {c['delta']:+.3f} ± {c['delta_se']:.3f}{mark})"
                row.append(cell)
            rows.append(row)
        lines.append(_bench.table(["objective", *names], rows))
        w = dec["per_estimator"][est]
        lines.append(
            f"\nCheckpoints beating the null: oracle {w['wins']['oracle']}, teacher "
            f"{w['wins']['teacher']}, consistency {w['wins']['consistency']}, paper "
            f"{w['wins']['paper']} (need {dec['need']}); estimator passes: {w['passes']}\n"
        )
    solve = [
        [ck["name"], est, v["solves"], v["diverged"], f"{v['mean_iterations']:.1f}",
         f"{ck['time_s'].get(est, float('nan')):.0f}"]
        for ck in d["checkpoints"] for est, v in ck["solve"].items()
    ]  # fmt: skip
    lines.append("### Solves and cost\n")
    lines.append(
        _bench.table(
            ["checkpoint", "estimator", "solves", "diverged", "iterations", "CPU s"], solve
        )
    )
    extra = [
        [ck["name"], f"{ck['tau']:.3f}", f"{ck['teacher_coverage']:.2f}",
         f"{ck['teacher_acc_confident']:.3f}"]
        for ck in d["checkpoints"]
    ]  # fmt: skip
    lines.append("")
    lines.append(
        _bench.table(["checkpoint", "τ", "teacher coverage", "teacher acc (confident)"], extra)
    )
    lines.append(f"\n**Decision (pre-registered rule): {'PASS' if dec['pass'] else 'FAIL'}**")
    return "\n".join(lines)


def plot(d: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = d["summary"]
    names = [ck["name"] for ck in d["checkpoints"]]
    ests = list(s)
    fig, axes = plt.subplots(1, len(ests), figsize=(3.2 * len(ests), 3.6), sharey=True)
    axes = [axes] if len(ests) == 1 else list(axes)
    colors = dict(zip(OBJECTIVES, ("tab:orange", "tab:green", "tab:purple", "tab:blue", "gray")))
    for ax, est in zip(axes, ests):
        for k, o in enumerate(OBJECTIVES):
            xs, ys, es = [], [], []
            for i, n in enumerate(names):
                c = s[est][o].get(n)
                if c:
                    xs.append(i + (k - 2) * 0.14)
                    ys.append(c["mean"])
                    es.append(2 * c["se"] if math.isfinite(c["se"]) else 0)
            ax.errorbar(xs, ys, yerr=es, fmt="o", ms=4, color=colors[o], label=o)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(range(len(names)), names, rotation=45, fontsize=7)
        ax.set_title(est, fontsize=9)
    axes[0].set_ylabel("cos(g, d*)  (± 2 s.e.)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finalize(
    out: Path,
    name: str,
    checkpoints: list[dict[str, Any]],
    meta: dict[str, Any],
    grid: tuple[Estimator, ...] = GRID,
) -> None:
    summary = summarize(checkpoints)
    payload = {
        **meta,
        "grid": [asdict(e) for e in grid],
        "checkpoints": checkpoints,
        "summary": summary,
        "decision": decide(summary, len(meta["expected"])),
    }
    _bench.save(out, name, payload)
    md = _bench.render(out, name, "gate.py", to_md)
    plot(json.loads((out / f"{name}.json").read_text()), out / f"{name}.png")
    print(md)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    _bench.add_run_options(p)
    p.add_argument("--runs", type=Path, default=Path("runs/gate"), help="the Stage-B run folders")
    p.add_argument("--make", action="store_true", help="run the pipeline for the checkpoints")
    p.add_argument("--jobs", type=int, default=1, help="checkpoints measured in parallel")
    p.add_argument("--layout", choices=("pipeline", "snapshot"), default="pipeline")
    p.add_argument(
        "--grid",
        choices=tuple(GRIDS),
        default="preregistered",
        help="unit counts: the pre-registered ones, or the first gate's reduced ones",
    )
    p.add_argument(
        "--make-jobs",
        type=int,
        default=2,
        help="jobs= of --make's pipeline runs (the same numbers for any value; recorded)",
    )
    p.add_argument("--only", default=None, help="one checkpoint, e.g. uci_m/0 (parts only)")
    p.add_argument(
        "--from-parts", action="store_true", help="finalize from gate_parts/*.json (partial ok)"
    )
    a = p.parse_args(argv)
    out = _bench.out_dir(a)
    pairs = [(t, s) for t in TARGETS for s in SEEDS]
    if a.make:
        for t in TARGETS:
            subprocess.run(pipeline_command(a.runs, t, len(SEEDS), a.make_jobs), check=True)
        return
    if a.report:
        d = json.loads((out / f"{NAME}.json").read_text())
        print(_bench.render(out, NAME, "gate.py", to_md))
        plot(d, out / f"{NAME}.png")
        return
    grid = GRIDS[a.grid]
    if a.quick:
        grid = tuple(Estimator(e.name, e.soft, e.solver, e.batch, 2, 1) for e in grid[:2])
        GRIDS["quick"], a.grid = grid, "quick"
        a.jobs = 1  # spawned workers would not see the "quick" grid
        pairs = pairs[:1]
    parts = out / "gate_parts"
    parts.mkdir(parents=True, exist_ok=True)
    meta = {
        "expected": [f"{t}/seed{s}" for t, s in pairs],
        "outer_batch": OUTER_BATCH,
        "teacher_conf": TEACHER_CONF,
        "runs": str(a.runs),
        "layout": a.layout,
        "pipeline": " ".join(pipeline_command(a.runs, "T", len(SEEDS), a.make_jobs)[1:]),
        "grid_name": a.grid,
    }
    if a.from_parts:  # whatever the per-checkpoint workers finished, labelled partial if short
        results = [json.loads(f.read_text()) for f in sorted(parts.glob("*.json"))]
        for ck in results:  # more draws of an estimator, run later (gate_parts_extra/)
            extra = out / "gate_parts_extra" / f"{ck['name'].replace('/', '_')}.json"
            if extra.is_file():
                merge_extra(ck, json.loads(extra.read_text()))
        done = {ck["name"]: list(ck["cells"]) for ck in results}
        full = [e.name for e in grid] + list(AVERAGED.values())
        short = {n: [e for e in full if e not in c] for n, c in done.items()}
        short = {n: v for n, v in short.items() if v}
        missing = [n for n in meta["expected"] if n not in done]
        if short or missing:
            meta["partial"] = (
                f"checkpoints not measured: {missing or 'none'}; estimators missing: "
                f"{short or 'none'}"
            )
        finalize(out, NAME, results, meta, grid)
        return
    jobs = [
        (str(a.runs), t, s, str(parts / f"{t}_seed{s}.json"), a.threads, a.layout, a.grid)
        for t, s in pairs
        if a.only is None or a.only == f"{t}/{s}"
    ]
    t0 = time.time()
    if a.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(a.jobs) as pool:
            results = pool.map(_worker, jobs, chunksize=1)
    else:
        results = [_worker(j) for j in jobs]
    if a.only is not None:
        return  # one checkpoint's part; --from-parts assembles
    meta["wall_s"] = time.time() - t0
    finalize(out, NAME, results, meta, grid)


if __name__ == "__main__":
    main()
