"""The whole outer loop with ``hg.compile_outer_step``: one compiled graph per outer step.

Runners with the ``runner(P, o) -> Loop`` protocol of :mod:`benchmarks.peers.whole_loop` (its
problems, losses, Adam constants and state layout), for the smooth problems (``logreg_groups``,
``ridge_features``):

* ``hypergrad_compiled_step``: the step (Newton on the dense Hessian, the hypergradient by a
  Cholesky solve) is one compiled graph; Adam is the benchmark's own eager ``adam_torch``.
* ``hypergrad_compiled_step_adam``: Adam (``hg.compiled_step.adam``, the same arithmetic) is in
  the graph too.
* ``hypergrad_outer_step_eager``: the same functional code without ``torch.compile``.

Run ``python -m benchmarks.peers.whole_loop_compiled [problem ...]`` (pinned to one core: prefix
``taskset -c 1``) to print, per problem and runner, the first call (in a fresh process: a cold
inductor cache in a new temporary ``TORCHINDUCTOR_CACHE_DIR``, then a warm one reusing it), the
median step and the validation loss after 100 steps against ``hypergrad_newton_reuse``'s; the
process CPU time is measured (``time.process_time``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.peers import whole_loop as W


def compiled_step_loop(P: W.Problem, o: dict, adam_in_graph: bool = False,
                       compile: bool = True) -> W.Loop:  # fmt: skip
    import hypergrad as hg

    if P.kind != "smooth":
        raise ValueError("compile_outer_step is for smooth inner problems")
    inner, outer, _ = W.torch_losses(P)
    opt = hg.compiled_step.adam(lr=o["lr"], betas=(W.ADAM["b1"], W.ADAM["b2"]), eps=W.ADAM["eps"])
    step_fn = hg.compile_outer_step(
        inner, lambda w, theta: outer(w), maxiter=o["maxiter_newton"], tol=o["tol"],
        update=opt if adam_in_graph else None, compile=compile,
    )  # fmt: skip

    def init():
        s = W._torch_state(P)
        if adam_in_graph:
            s["opt"] = opt.init(s["theta"])
        return s

    def step(state):
        if adam_in_graph:
            r = step_fn(state["w"], state["theta"], state["opt"])
            state["theta"], state["opt"] = r.theta, r.opt_state
            state["t"] += 1
            state["m"], state["v"] = r.opt_state["m"], r.opt_state["v"]
        else:
            r = step_fn(state["w"], state["theta"])
            W._adam_update(state, r.hypergrad, o["lr"])
        state["w"] = r.w
        return state, r.outer_loss, r.iterations

    return W.Loop(init, step, facts={"compile": compile, "adam_in_graph": adam_in_graph})


RUNNERS = {
    "hypergrad_compiled_step": compiled_step_loop,
    "hypergrad_compiled_step_adam": functools.partial(compiled_step_loop, adam_in_graph=True),
    "hypergrad_outer_step_eager": functools.partial(compiled_step_loop, compile=False),
}
LABELS = {
    "hypergrad_compiled_step": "hypergrad compile_outer_step (one graph) + eager Adam",
    "hypergrad_compiled_step_adam": "hypergrad compile_outer_step with Adam in the graph",
    "hypergrad_outer_step_eager": "hypergrad compile_outer_step(compile=False)",
}
OPTIONS = dict(steps=100, lr=0.1, tol=1e-8, adjoint_tol=1e-10, maxiter=2000, maxiter_newton=50,
               maxiter_fista=20000, adjoint_maxiter=1000)  # fmt: skip


def _cpu() -> float:
    """CPU seconds of this process and its finished children (inductor's compiler runs)."""
    import resource

    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _measure(key: str, impl: str, steps: int) -> dict:
    """One runner in this process: the first call (CPU with children, and wall), then ``steps``
    timed steps from the start again (process CPU time per step)."""
    torch.set_num_threads(1)
    P = W.problem(key)
    runners = {**W.RUNNERS, **RUNNERS}
    loop = runners[impl](P, OPTIONS)
    state = loop.init()
    c0, t0 = _cpu(), time.perf_counter()
    state, _, _ = loop.step(state)
    first = dict(first_cpu_s=_cpu() - c0, first_wall_s=time.perf_counter() - t0)
    state = loop.init()
    cpu, wall, losses, iters = [], [], [], []
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        state, loss, it = loop.step(state)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
        losses.append(loss)
        iters.append(it)
    return dict(first, step_cpu_ms=1e3 * float(np.median(cpu)), step_wall_ms=1e3 * float(
        np.median(wall)), total_cpu_s=float(sum(cpu)), final_loss=losses[-1],
        iters=int(sum(iters)), theta=W.theta_of(state).tolist())  # fmt: skip


def interleaved(key: str, impls: list[str], steps: int, rounds: int) -> dict:
    """The runners ``impls`` in this one process, side by side: each one's first call, then
    ``rounds`` rounds in which every runner does ``steps`` outer steps from the start in turn
    (so that a change in the machine's load falls on all of them); per runner the median step
    CPU time over all rounds and its ratio to the first runner's."""
    torch.set_num_threads(1)
    P = W.problem(key)
    runners = {**W.RUNNERS, **RUNNERS}
    loops = {i: runners[i](P, OPTIONS) for i in impls}
    out: dict = {i: {"cpu": [], "first_cpu_s": None} for i in impls}
    for i, loop in loops.items():
        c0 = _cpu()
        loop.step(loop.init())
        out[i]["first_cpu_s"] = _cpu() - c0
    for _ in range(rounds):
        for i, loop in loops.items():
            state = loop.init()
            for _ in range(steps):
                c0 = time.process_time()
                state, loss, _ = loop.step(state)
                out[i]["cpu"].append(time.process_time() - c0)
            out[i]["final_loss"] = loss
    base = float(np.median(out[impls[0]]["cpu"]))
    for i in impls:
        med = float(np.median(out[i].pop("cpu")))
        out[i].update(step_cpu_ms=1e3 * med, ratio_to_first=med / base)
    return out


def _child(key: str, impl: str, steps: int, cache: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    cmd = [sys.executable, "-m", "benchmarks.peers.whole_loop_compiled", "--child",
           json.dumps([key, impl, steps])]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (p.stderr or p.stdout).strip()[-2000:]}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--interleaved"]:
        impls = ["jaxopt", "hypergrad_newton_reuse", *RUNNERS]
        impls.remove("hypergrad_outer_step_eager")
        res = {k: interleaved(k, impls, OPTIONS["steps"], 5) for k in argv[1:] or
               ["logreg_groups", "ridge_features"]}  # fmt: skip
        print(json.dumps(res))
        return
    if argv[:1] == ["--child"]:
        key, impl, steps = json.loads(argv[1])
        print(json.dumps(_measure(key, impl, steps)))
        return
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    problems = argv or ["logreg_groups", "ridge_features"]
    steps = OPTIONS["steps"]
    records = []
    for key in problems:
        refs = {}
        for impl in ("hypergrad_newton_reuse", "jaxopt"):
            missing = W.missing(impl)
            refs[impl] = {"error": missing} if missing else _child(key, impl, steps, None)
            records.append(dict(problem=key, impl=impl, cache=None, **refs[impl]))
            print(key, impl, json.dumps(refs[impl]), flush=True)
        ref = refs["hypergrad_newton_reuse"]["final_loss"]
        for impl in RUNNERS:
            with tempfile.TemporaryDirectory() as cache:
                for which in ("cold", "warm"):
                    r = _child(key, impl, steps, cache)
                    r["rel_loss_diff"] = abs(r.get("final_loss", np.nan) - ref) / abs(ref)
                    records.append(dict(problem=key, impl=impl, cache=which, **r))
                    print(key, impl, which, json.dumps(r), flush=True)
    if out is not None:
        meta = dict(python=sys.executable, torch=torch.__version__, options=OPTIONS,
                    created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
        with open(out, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
