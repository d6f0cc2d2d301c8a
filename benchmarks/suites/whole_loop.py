"""The whole outer loop: time to the same validation loss, hypergrad's inner solvers against
jaxopt (jitted) and against the torch loop a user writes today (docs/benchmarks.md, "The whole
outer loop"; issue 25, item 1).

Three problems (float64, one thread; ``benchmarks/peers/whole_loop.py``):

* ``logreg_groups``: breast_cancer, standardised, a bias column (unpenalised), split in halves
  (seed 0); 10 groups of 3 features (feature j in group j % 10: the mean, the standard error and
  the worst value of one measurement); inner ``mean(softplus(z) − y z) + ½ Σ_j exp(θ_g(j)) w_j²``,
  ``z = X w``; outer: the validation logistic loss.
* ``ridge_features``: the same breast_cancer split, target standardised, no bias; inner
  ``½‖Xw − y‖²/n + ½ Σ_j exp(θ_j) w_j²`` (30 decays); outer: the validation MSE.
* ``lasso_penalties``: diabetes, standardised, split in halves (seed 0); inner ``½‖Xw − y‖²/n +
  Σ_j exp(θ_j)|w_j|`` (10 penalties); outer: the validation MSE.

Every implementation does the same ``steps`` outer steps: inner solve warm-started from the
previous solution, hypergradient by implicit differentiation, hand-written Adam (lr 0.1) from
θ0 (−2; −3 for the lasso). Each runs in a fresh process (``fresh_process``), ``rounds`` times
in alternating order: one untimed-for-the-loop first call (a whole step from θ0: compilation for
jax, first-use costs for torch), then the loop again from θ0, every step timed (wall and CPU).
Per step the median over rounds is kept; the trajectory is the first round's (the rounds'
trajectories are compared). The target is the worst final validation loss over the
implementations that solve to the common tolerance, times ``1 + rel_target``; the time to it is
the sum of the step times up to the first step at or below it, with the first call (its time in
place of step 0's) and without it.

Run: ``python -m benchmarks whole_loop`` (``--quick``: 8 steps, one round, into results/quick/).
One problem again without losing the others' rows: ``python -m benchmarks whole_loop --set
problems=lasso_penalties --tag _lasso``, then ``python -m benchmarks.suites.whole_loop merge
whole_loop_lasso.json`` (its problems replace those of ``results/whole_loop.json``, each with
its own run's date, machine, load and settings under ``"run"``, shown by the report) and
``python -m benchmarks report whole_loop``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

from benchmarks import kit
from benchmarks.peers import whole_loop as W

ALL_IMPLS = list(dict.fromkeys(i for p in W.PROBLEMS for i in W.IMPLS[p]))
OPTIONS = dict(problems=list(W.PROBLEMS), impls=ALL_IMPLS, steps=100, rounds=3, lr=0.1)
OPTIONS.update(tol=1e-8, adjoint_tol=1e-10, maxiter=2000, maxiter_newton=50, maxiter_fista=20000)
OPTIONS.update(adjoint_maxiter=1000, rel_target=1e-6, fresh_process=True)
QUICK = dict(steps=8, rounds=1)
LOOSE = ("torch_user_defaults",)  # not solved to the common tolerance: not in the target
SPEC_KEYS = ("steps", "lr", "tol", "adjoint_tol", "maxiter", "maxiter_newton", "maxiter_fista")
SPEC_KEYS += ("adjoint_maxiter",)


def library_state() -> str:
    """hypergrad's commit, with a digest of uncommitted changes under ``hypergrad/`` (the library
    a fresh process imports; it may change between processes while others commit)."""
    import hashlib

    git = ["git", "-C", str(kit.ROOT)]
    run = lambda *a: subprocess.run(git + list(a), capture_output=True, text=True).stdout
    head, diff = run("rev-parse", "--short", "HEAD").strip(), run("diff", "HEAD", "--", "hypergrad")
    return head + (f"+{hashlib.sha1(diff.encode()).hexdigest()[:8]}" if diff else "")


def run_impl(key: str, impl: str, o: dict) -> dict:
    """One implementation on one problem in this process: the first call, then the timed loop."""
    P = W.problem(key)
    t0 = time.perf_counter()
    loop = W.RUNNERS[impl](P, o)
    out: dict = {"build_s": time.perf_counter() - t0, "library": library_state()}
    state = loop.init()
    # CPU of the process and of its finished children: inductor compiles C++ in subprocesses
    cpu = lambda: time.process_time() + sum(os.times()[2:4])  # noqa: E731
    c0, t0 = cpu(), time.perf_counter()
    state, loss0, _ = loop.step(state)
    out.update(first_wall_s=time.perf_counter() - t0, first_cpu_s=cpu() - c0)
    out.update(first_loss=loss0, compiles_after_first=loop.compiles())
    rec: dict[str, list] = {k: [] for k in ("loss", "wall_s", "cpu_s", "iters", "residual")}
    state = loop.init()
    for _ in range(o["steps"]):
        theta = W.theta_of(state)
        c0, t0 = time.process_time(), time.perf_counter()
        state, loss, iters = loop.step(state)
        rec["wall_s"].append(time.perf_counter() - t0)
        rec["cpu_s"].append(time.process_time() - c0)
        rec["loss"].append(loss)
        rec["iters"].append(iters)
        rec["residual"].append(W.residual(P, W.w_of(state), theta))  # untimed, the same for all
    out.update(rec, compiles=loop.compiles(), theta_final=W.theta_of(state).tolist())
    return out


def child(spec: dict) -> dict:
    try:
        return {"status": "ok", **run_impl(spec["problem"], spec["impl"], spec["o"])}
    except Exception as e:  # noqa: BLE001 - a failing implementation is a result
        tail = traceback.format_exc().strip().splitlines()[-6:]
        return {"status": "error", "error": kit.err_text(e), "traceback_tail": tail}


def run_fresh(spec: dict, threads: int) -> dict:
    """``child(spec)`` in a fresh Python process (one thread, pinned as the parent)."""
    env = dict(os.environ, BENCH_THREADS=str(threads))
    cmd = [sys.executable, "-m", "benchmarks.suites.whole_loop", json.dumps(spec)]
    p = subprocess.run(cmd, cwd=kit.ROOT, env=env, capture_output=True, text=True, timeout=7200)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        why = ((p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"])[0][:300]
        return {"status": "error", "error": f"child process failed: {why}"}


def summarise(key: str, runs: dict[str, list[dict]], o: dict) -> dict:
    """Per implementation: medians over rounds, the target, steps and time to it, agreement."""
    recs = {}
    for impl, rs in runs.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        if not ok:
            recs[impl] = {k: rs[0][k] for k in ("status", "error") if k in rs[0]}
            continue
        first = ok[0]
        r = {"status": "ok", "label": W.label(impl, key), "rounds": len(ok)}
        for k in ("wall_s", "cpu_s"):
            r[k] = np.median([x[k] for x in ok], axis=0).tolist()
            r[f"first_{k[:-2]}_s"] = float(np.median([x[f"first_{k}"] for x in ok]))
            r[f"first_{k[:-2]}_s_rounds"] = [x[f"first_{k}"] for x in ok]
            r[f"median_step_{k}"] = float(np.median(r[k]))
        r.update({k: first[k] for k in ("loss", "iters", "residual", "theta_final", "build_s")})
        r.update(compiles=first["compiles"], compiles_after_first=first["compiles_after_first"])
        r["library"] = sorted({x.get("library", "?") for x in ok})
        loss = np.array(first["loss"])
        r["rounds_max_dev"] = max(float(np.max(np.abs(np.array(x["loss"]) - loss))) for x in ok)
        r["final_loss"], r["max_residual"] = float(loss[-1]), float(max(first["residual"]))
        r["median_iters"] = float(np.median(first["iters"]))
        if len(ok) < len(rs):
            r["failed_rounds"] = [x.get("error") for x in rs if x.get("status") != "ok"]
        recs[impl] = r
    good = [i for i, r in recs.items() if r["status"] == "ok" and i not in LOOSE]
    target = max(recs[i]["final_loss"] for i in good) * (1 + o["rel_target"]) if good else None
    ref = next((i for i in ("jaxopt", "torch_user") if i in good), good[0] if good else None)
    for impl, r in recs.items():
        if r["status"] != "ok":
            continue
        loss = np.array(r["loss"])
        r["accurate"] = impl not in LOOSE
        if ref is not None:
            rl = np.array(recs[ref]["loss"])
            r["max_rel_dev"] = float(np.max(np.abs(loss - rl) / np.abs(rl)))
        hit = np.nonzero(loss <= target)[0] if target is not None else []
        r["steps_to_target"] = int(hit[0]) + 1 if len(hit) else None
        for k in ("wall", "cpu"):
            t = np.array(r[f"{k}_s"])
            if r["steps_to_target"] is None:
                r[f"to_target_{k}_s"] = r[f"to_target_first_{k}_s"] = None
                continue
            n = r["steps_to_target"]
            r[f"to_target_{k}_s"] = float(t[:n].sum())
            r[f"to_target_first_{k}_s"] = float(r[f"first_{k}_s"] + t[1:n].sum())
    devs = [recs[i]["max_rel_dev"] for i in good if "max_rel_dev" in recs[i]]
    libs = sorted({x for r in recs.values() for x in r.get("library", [])})
    P = W.problem(key)
    return dict(problem=key, facts=P.facts, records=recs, target=target, reference=ref,
                accurate=good, max_rel_dev=max(devs) if devs else None, library=libs)  # fmt: skip


def measure(o: dict, out, name: str) -> None:
    from benchmarks.peers import versions

    spec_o = {k: o[k] for k in SPEC_KEYS}
    meta = {"versions": versions(), **o, "loose": list(LOOSE)}
    meta["missing"] = {i: W.missing(i) for i in o["impls"] if W.missing(i)}
    res = []
    for key in o["problems"]:
        impls = [i for i in W.IMPLS[key] if i in o["impls"]]
        runs: dict[str, list[dict]] = {i: [] for i in impls}
        t_start = time.perf_counter()
        for rnd in range(o["rounds"]):
            for impl in impls if rnd % 2 == 0 else impls[::-1]:
                why = W.missing(impl)
                if why:
                    runs[impl].append({"status": "unsupported", "error": why})
                    continue
                spec = {"problem": key, "impl": impl, "o": spec_o}
                r = run_fresh(spec, o["threads"]) if o["fresh_process"] else child(spec)
                runs[impl].append(r)
                msg = f"{key} {impl} round {rnd}: {r['status']} {r.get('error') or ''}"
                if r["status"] == "ok":
                    msg += f"first {r['first_cpu_s']:.2f} s CPU, loop {sum(r['cpu_s']):.2f} s CPU, "
                    msg += f"final {r['loss'][-1]:.10g}"
                kit.log(msg)
        s = summarise(key, runs, o)
        s["wall_s"] = time.perf_counter() - t_start
        res.append(s)
        kit.save(Path(out) / f"{name}.json", {"meta": meta, "problems": res})


def merge(part: Path, into: Path | None = None, note: str = "") -> None:
    """Replace the problems of ``into`` (``results/whole_loop.json``) by those of ``part`` (a
    run with ``--set problems=... --tag ...``), keeping the others: each merged problem carries
    its run's ``created``, ``machine``, library and settings as ``"run"``; ``meta["impls"]``
    becomes the union; ``note`` (e.g. the commit of a ``git archive`` snapshot the run used,
    which records no git state of its own) is shown with the run."""
    into = into or kit.RESULTS / "whole_loop.json"
    base, new = json.loads(into.read_text()), json.loads(part.read_text())
    keep = ("rounds", "steps", "tol", "adjoint_tol", "impls", "threads", "quick", "versions")
    run = {"source": part.name, "created": new["created"], "machine": new["machine"], "note": note}
    run.update({k: new["meta"][k] for k in keep if k in new["meta"]})
    by_key = {p["problem"]: p for p in base["problems"]}
    for p in new["problems"]:
        by_key[p["problem"]] = {**p, "run": run}
    order = [k for k in W.PROBLEMS if k in by_key] + [k for k in by_key if k not in W.PROBLEMS]
    base["problems"] = [by_key[k] for k in order]
    base["meta"]["impls"] = list(dict.fromkeys(base["meta"]["impls"] + new["meta"]["impls"]))
    into.write_text(json.dumps(base, indent=1))


def _run_note(p: dict) -> str:
    """The run of a merged problem, when it is not the file's own (see :func:`merge`)."""
    r = p.get("run")
    if not r:
        return ""
    m, v = r["machine"], r.get("versions", {})
    libs = ", ".join(p.get("library", [])) or "?"
    return (
        f" **This problem was run separately** ({r['source']}, merged): {r['created']}, "
        f"{r['rounds']} round(s) of fresh processes, {m['cpu']}, load average at the end "
        f"{tuple(round(x, 1) for x in m['loadavg'])}; hypergrad {v.get('hypergrad', '?')} "
        f"(library state {libs})" + (f"; {r['note']}." if r.get("note") else ".")
    )


# -- report ----------------------------------------------------------------------------------

TITLES = {
    "logreg_groups": "Logistic regression, 10 group decays, breast_cancer",
    "ridge_features": "Ridge, 30 per-feature decays, breast_cancer",
    "lasso_penalties": "Lasso, 10 per-feature penalties, diabetes",
}
HEAD = ["implementation", "first call (s)", "median step (ms)", "steps to target",
        "to target, with first call (s)", "without (s)", "÷ jaxopt's (with / without)",
        "÷ user loop's (with / without)", "final val. loss", "max dev.", "max inner res.",
        "inner its (median)"]  # fmt: skip


def _ratio(a, b) -> str:
    return "–" if a is None or b is None or not b else f"{a / b:.3g}"


def sec(x) -> str:
    """Seconds (or milliseconds) to 3 significant digits."""
    return "–" if x is None else f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def rows(p: dict, clock: str) -> list[list]:
    recs, out = p["records"], []
    base = {i: recs.get(i, {}) for i in ("jaxopt", "torch_user")}
    for impl, r in recs.items():
        if r["status"] != "ok":
            out.append([f"{W.label(impl, p['problem'])}", f"{r['status']}: {r.get('error')}"]
                       + ["–"] * (len(HEAD) - 2))  # fmt: skip
            continue
        name = f"**{r['label']}**" if impl.startswith("hypergrad") else r["label"]
        name += "" if r["accurate"] else " ¹"
        w, wo = r[f"to_target_first_{clock}_s"], r[f"to_target_{clock}_s"]
        ratios = []
        for b in base.values():
            bw, bwo = b.get(f"to_target_first_{clock}_s"), b.get(f"to_target_{clock}_s")
            ratios.append(f"{_ratio(w, bw)} / {_ratio(wo, bwo)}")
        out.append([name, sec(r[f"first_{clock}_s"]), sec(r[f"median_step_{clock}_s"] * 1e3),
                    r["steps_to_target"] or "not reached", sec(w), sec(wo),
                    *ratios, f"{r['final_loss']:.10f}", f"{r.get('max_rel_dev', 0):.1e}",
                    f"{r['max_residual']:.1e}", f"{r['median_iters']:g}"])  # fmt: skip
    return out


COLORS = dict(jaxopt="C0", torch_user="C1", torch_user_defaults="C1", hypergrad_newton="C3",
              hypergrad_newton_reuse="C4", hypergrad_lbfgs="C5", hypergrad_fista="C3",
              hypergrad_fista_exact="C4", hypergrad_fista_grad="C2",
              hypergrad_fista_grad_exact="C6", hypergrad_compiled_step_adam="C2")  # fmt: skip


def plot(ax, p: dict, first: bool) -> None:
    """Validation loss against cumulative CPU time (log-x), with or without the first call."""
    for impl, r in p["records"].items():
        if r["status"] != "ok":
            continue
        t = np.cumsum([r["first_cpu_s"]] + r["cpu_s"][1:] if first else r["cpu_s"])
        ax.plot(t, r["loss"], label=r["label"], lw=2 if impl.startswith("hypergrad") else 1.2,
                ls="-" if r["accurate"] else ":", color=COLORS.get(impl))  # fmt: skip
    if p["target"] is not None:
        ax.axhline(p["target"], color="k", ls="--", lw=0.8)
    how = "first call (compilation) included" if first else "without the first call"
    ax.set(xscale="log", xlabel=f"cumulative CPU time, {how} (s)", ylabel="validation loss")
    ax.set_title(TITLES.get(p["problem"], p["problem"]), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, loc="upper right")


def report(d: dict, path: Path) -> str:
    """Markdown (per problem: CPU-time table, wall-time table) and one plot (validation loss
    against cumulative CPU time, log-x; top row with the first call, bottom row without) from the
    suite's JSON."""
    from benchmarks.report import figure, num, save, table

    meta, m = d["meta"], d["machine"]
    v = meta["versions"]
    parts = [
        f"Machine: {m['cpu']}, {m.get('cpus_allowed')} CPU(s) allowed, {meta['threads']} "
        f"thread(s), load average at the end {tuple(round(x, 1) for x in m['loadavg'])}; "
        + ", ".join(f"{k} {v.get(k, '?')}" for k in ("hypergrad", "torch", "jax", "jaxopt"))
        + f". Run {d['created']}{' (**quick**)' if meta['quick'] else ''}: {meta['steps']} outer "
        f"steps, {meta['rounds']} round(s) of fresh processes; inner tolerance {meta['tol']:g} "
        f"(relative), adjoint {meta['adjoint_tol']:g}; target = worst final validation loss of "
        f"the implementations at the common tolerance × (1 + {meta['rel_target']:g})."
    ]
    if meta.get("missing"):
        parts.append("Not run: " + "; ".join(f"{k} ({x})" for k, x in meta["missing"].items()))
    n = len(d["problems"])
    fig, axes = figure(2 * n, 5.2, 3.8, cols=n)
    for i, p in enumerate(d["problems"]):
        plot(axes[i], p, first=True)
        plot(axes[n + i], p, first=False)
    for p in d["problems"]:
        f = p["facts"]
        parts += ["", f"### {TITLES.get(p['problem'], p['problem'])} (`{p['problem']}`)", ""]
        parts += [f"{f['n_train']} training / {f['n_val']} validation rows, {f['unknowns']} "
                  f"unknowns, {f['hparams']} hyperparameters, θ0 = {f['theta0']:g}; target "
                  f"validation loss {num(p['target'], '.10f')}; largest relative deviation of a "
                  f"trajectory from {p['reference']}'s: {num(p['max_rel_dev'], '.1e')}. Wall time "
                  f"of this problem's run: {p['wall_s']:.0f} s.", ""]  # fmt: skip
        parts[-2] += _run_note(p)
        if len(p.get("library", [])) > 1:
            parts[-2] += (
                " **The library changed during this problem's run** (states "
                f"{', '.join(p['library'])})."
            )
        jx = p["records"].get("jaxopt", {})
        if jx.get("status") == "ok":
            parts[-2] += (
                f" jaxopt's step was compiled {jx['compiles_after_first']} time(s) by the "
                f"first call and {jx['compiles']} after the loop (jit cache size)."
            )
        parts += ["CPU time (process time of the one-thread process):", ""]
        parts += [table(HEAD, rows(p, "cpu"), "lrrrrrrrrrrr"), ""]
        parts += ["Wall time:", "", table(HEAD, rows(p, "wall"), "lrrrrrrrrrrr")]
    parts += ["", "¹ torch's default `tolerance_change = 1e-9` stops L-BFGS before the common "
              "tolerance (see max inner res.); not used for the target."]  # fmt: skip
    save(fig, path)
    return "\n".join(parts)


if __name__ == "__main__":
    if sys.argv[1] == "merge":  # python -m benchmarks.suites.whole_loop merge whole_loop_x.json
        merge(kit.RESULTS / sys.argv[2], note=" ".join(sys.argv[3:]))
        sys.exit(0)
    warnings.filterwarnings("ignore")
    kit.set_threads(int(os.environ.get("BENCH_THREADS", "1")))
    print(json.dumps(child(json.loads(sys.argv[1]))))
