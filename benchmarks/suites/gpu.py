"""GPU, prepared: one command for a lent GPU session (docs/performance.md, "GPU (prepared script)").

    python -m benchmarks gpu                                # on a CUDA machine, under 8 minutes
    python -m benchmarks gpu --quick --set device=cpu       # every part's plumbing on the CPU

Four parts, each a step with its own time budget whose failure is recorded without stopping the
others (a GPU session is short: one error must not lose the other parts' results):

1. ``tests``: the test suite's CUDA-marked tests (``pytest -m cuda``) in a subprocess.
2. ``bort2``: the BORT² smoke preset on the device (``examples/bort2/run.py preset=smoke``) in a
   subprocess: its table of target accuracies and its wall time.
3. ``resnet``: one ``HyperStep`` on torchvision's ResNet-50 (random init, no download; 224 px,
   batch 32, 10 classes, BatchNorm in train mode): θ is a labeler (pooled pixels -> soft targets
   mixed into the labels, as in BORT²), the inner loss the soft-target cross-entropy plus weight
   decay, the outer loss the cross-entropy on another batch. Median time per hyper step and peak
   memory with ``CG(maxiter=5)``, ``CG`` with ``engine="recompute"``, ``MINRES(maxiter=5)``,
   ``Neumann(maxiter=3)`` (α from the power iteration of a first call) and, for reference, one
   plain backward of the inner loss. The Hessian of a network at its random initialisation is
   indefinite: CG may stop at the first negative curvature and Neumann when its terms grow (the
   ``HVPs`` column says how many products each spent); MINRES always spends its 5, and CG and
   Neumann run again damped (``+damped``: 1.1 |λ| of the dominant eigenvalue from a power
   iteration, so H + damping I is positive definite). ``grad+graph`` (the inner gradient with its
   graph) and ``hvp`` (one Hessian-vector product on it) split a step's cost. The backward, CG and
   the damped solvers again under bf16 autocast.
4. ``peers``: the peer suite's MLP and CNN problems (``benchmarks/problems.py`` sizes and models)
   on the device, hypergrad against torchopt at equal K with the peer adapters. The inner solution
   (L-BFGS), the proximal δ and the float64 CG reference are rebuilt on the device in seconds
   (Fashion-MNIST when ``$FASHION_MNIST_DIR`` or the default folder holds it, else random data of
   the same shapes): the peer suite's cached CPU references take minutes to build.

Results: ``<out>/gpu/<machine>.json`` and ``.md``, rewritten after every part, the machine named
(GPU, driver, torch, CUDA). ``device=auto`` (the default) skips the suite where there is no CUDA
device, so ``python -m benchmarks`` on a CPU machine writes nothing for it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import kit

PARTS_ORDER = ["tests", "bort2", "resnet", "peers"]
OPTIONS: dict[str, Any] = dict(
    device="auto",  # auto: CUDA if present, else skip the suite; cpu: the plumbing on the CPU
    parts=list(PARTS_ORDER),
    budget_s=450,  # the whole run; a part that would start later is skipped
    machine="",  # the result file's name (default: the GPU's name, lower case)
    commit="",  # recorded instead of git's answer (a device machine's .git may be stale)
    tests_paths=["tests"],
    tests_s=150,
    bort2_s=180,
    bort2_args=[],  # extra key=value overrides of the smoke run
    resnet_s=150,
    arch="resnet50",  # any torchvision.models builder taking weights= and num_classes=
    image=224,
    batch=32,
    classes=10,
    reps=5,
    cg_iters=5,
    neumann_iters=3,
    neumann_alpha=0.0,  # 0: power iteration in a first call (1e-3 if that fails)
    damping="auto",  # of the "+damped" solvers; auto: 1.1 |λ| of the dominant eigenvalue
    power_iters=10,  # Hessian-vector products of that estimate
    amp=True,
    peers_s=150,
    peer_problems=["mlp_fashion", "cnn_digit5"],
    ks=[5, 20],
    peer_reps=5,
    lbfgs_iters=200,
    ref_iters=3000,
)
QUICK: dict[str, Any] = dict(
    tests_paths=["tests/benchmarks/test_gpu_suite.py"],
    bort2_args="step1.iters=4 step2.iters=4 step2.hyper.every=2 step2.warmup=2 eval_every=100 "
    "data.max_test=32 threads=1".split(),
    arch="resnet18",
    image=32,
    batch=2,
    reps=1,
    neumann_alpha=1e-3,
    ks=[5],
    peer_reps=1,
    lbfgs_iters=20,
    ref_iters=200,
)
SOLVE_KEYS = ("iterations", "matvecs", "residual", "converged", "diverged", "failure", "alpha")


# ------------------------------------------------------------------------------------ machine
def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def gpu_facts(device: str) -> dict[str, Any]:
    """The GPU, its driver and the CUDA / cuDNN versions torch was built with."""
    out: dict[str, Any] = dict(device=device, torch=torch.__version__, cuda=torch.version.cuda)
    for dist in ("torchvision", "torchopt", "hypergrad"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    head = ["git", "-C", str(kit.ROOT), "rev-parse", "--short", "HEAD"]
    git = subprocess.run(head, capture_output=True, text=True)
    out["git"] = git.stdout.strip() or None
    if device != "cuda":
        return {**out, "name": "cpu", "driver": None}
    p = torch.cuda.get_device_properties(0)
    out.update(name=torch.cuda.get_device_name(0), memory_gib=round(p.total_memory / 2**30, 1))
    out.update(sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    out["cudnn"] = torch.backends.cudnn.version()
    out["tf32"] = dict(  # torch's defaults: float32 matmuls exact, cuDNN convolutions TF32
        matmul=torch.backends.cuda.matmul.allow_tf32, cudnn=torch.backends.cudnn.allow_tf32
    )
    try:
        q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["driver"] = None
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_start(device: str) -> float:
    if device != "cuda":
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return float(torch.cuda.memory_allocated())


def peak_mib(device: str, base: float) -> float | None:
    """CUDA's peak allocation above ``base`` since :func:`peak_start` (None on the CPU: see the
    memory suite for the CPU's numbers)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _all_cpus() -> None:  # subprocesses: undo kit.set_threads(1)'s pinning to one CPU
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):
        pass


def run_command(cmd: list[str], timeout: float, cwd: Path = kit.ROOT) -> dict[str, Any]:
    """A subprocess with a timeout: return code, wall time and the output's last lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(kit.ROOT), str(kit.ROOT / "examples" / "bort2"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    t0 = time.perf_counter()
    rec: dict[str, Any] = dict(command=" ".join(cmd), timeout_s=round(timeout))
    try:
        p = subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1),
            preexec_fn=_all_cpus if os.name == "posix" else None,
        )
        out, rec["rc"] = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        raw = (e.stdout or b"") + (e.stderr or b"")
        out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        rec["rc"], rec["timed_out"] = None, True
    rec["wall_s"] = time.perf_counter() - t0
    rec["output_tail"] = out.strip().splitlines()[-25:]
    return rec


# ---------------------------------------------------------------------------------- the parts
def part_tests(o: dict, device: str, limit: float) -> dict[str, Any]:
    """``pytest -m cuda`` (the CUDA-marked tests; without CUDA they skip) in a subprocess."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    cmd += ["--continue-on-collection-errors", *o["tests_paths"]]
    rec = run_command(cmd, limit)
    lines = [ln for ln in rec["output_tail"] if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    rec["summary"] = lines[-1].strip("= ") if lines else None
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1]) if lines else []
    rec["counts"] = {k: int(n) for n, k in found}
    if rec["rc"] == 5:  # pytest: no test was selected
        rec.update(status="ok", summary="no CUDA-marked test selected")
    elif rec.get("timed_out"):
        rec["status"] = "timed out"
    elif rec["rc"] == 1 and lines and not rec["counts"].get("failed"):
        # only collection errors (a module whose imports are missing there): the CUDA-marked
        # tests of the other modules ran and passed; the summary counts the errors
        rec["status"] = "ok"
    elif rec["rc"] != 0:
        rec["status"] = "failed"
    return rec


def part_bort2(o: dict, device: str, limit: float) -> dict[str, Any]:
    """The BORT² smoke preset on ``device``: its results table and wall time."""
    with tempfile.TemporaryDirectory(prefix="gpu_bort2_") as tmp:
        run = kit.ROOT / "examples" / "bort2" / "run.py"
        args = ["preset=smoke", f"device={device}", f"output_dir={tmp}/run", "progress=false"]
        rec = run_command([sys.executable, str(run), *args, *o["bort2_args"]], limit)
        res = Path(tmp) / "run" / "results.json"
        if res.exists():
            keep = ("stage", "target", "seed", "iters", "time_s", "acc", "best_acc", "hyper_steps")
            rows = json.loads(res.read_text())["results"]
            rec["results"] = [{k: r.get(k) for k in keep if k in r} for r in rows]
        md = Path(tmp) / "run" / "results.md"
        rec["table"] = md.read_text() if md.exists() else None
    if rec["rc"] != 0 or not rec.get("results"):
        rec["status"] = "timed out" if rec.get("timed_out") else "failed"
    return rec


def resnet_problem(o: dict, device: str):
    """(model, labeler, inner batch, outer batch, inner loss, outer loss) of the ResNet part."""
    import torchvision

    torch.manual_seed(0)
    n, c, px = o["batch"], o["classes"], o["image"]
    model = getattr(torchvision.models, o["arch"])(weights=None, num_classes=c).to(device)
    labeler = nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(3 * 64, c))
    labeler = labeler.to(device)
    batches = [(torch.randn(n, 3, px, px, device=device), torch.randint(c, (n,), device=device))]
    batches.append(
        (torch.randn(n, 3, px, px, device=device), torch.randint(c, (n,), device=device))
    )
    mix, decay = 0.3, 5e-4

    def inner_loss(m, batch):
        x, y = batch
        soft = (1 - mix) * F.one_hot(y, c) + mix * labeler(x).float().softmax(1)
        ce = -(soft * m(x).float().log_softmax(1)).sum(1).mean()
        return ce + 0.5 * decay * sum((p.float() ** 2).sum() for p in m.parameters())

    def outer_loss(m, batch):
        x, y = batch
        return F.cross_entropy(m(x).float(), y)

    return model, labeler, batches[0], batches[1], inner_loss, outer_loss


def part_resnet(o: dict, device: str, limit: float) -> dict[str, Any]:
    """HyperStep on a torchvision ResNet: time per hyper step, peak memory, CG and Neumann."""
    import hypergrad as hg

    t_end = time.perf_counter() + limit
    model, labeler, batch, outer_batch, inner_loss, outer_loss = resnet_problem(o, device)
    params = [p for p in model.parameters() if p.requires_grad]
    info: dict[str, Any] = dict(arch=o["arch"], image=o["image"], batch=o["batch"])
    info.update(classes=o["classes"], params=sum(p.numel() for p in params))
    info["hyper_params"] = sum(p.numel() for p in labeler.parameters())

    def step_of(solver, engine="reuse"):
        how = hg.Implicit(solver=solver, engine=engine)
        step = hg.HyperStep(model, labeler, inner_loss, outer_loss, on_diverged="write", method=how)
        return lambda: step(batch, outer_batch)

    def backward():
        torch.autograd.grad(inner_loss(model, batch), params)

    def hvp_parts():
        """The pieces of a hyper step: the inner gradient with its graph, and one
        Hessian-vector product on that graph (timed without rebuilding it)."""
        g = torch.autograd.grad(inner_loss(model, batch), params, create_graph=True)
        v = [torch.randn_like(p) for p in params]

        def grad_graph():
            torch.autograd.grad(inner_loss(model, batch), params, create_graph=True)

        def hvp():
            torch.autograd.grad(g, params, v, retain_graph=True)

        return grad_graph, hvp, g

    def dominant(g, iters: int) -> float:
        """The largest-magnitude eigenvalue of the inner Hessian (power iteration, ``iters``
        products): a random init's Hessian is indefinite, and 1.1 |λ| of damping makes
        H + damping I positive definite with condition number at most 21."""
        gen = torch.Generator().manual_seed(0)
        v = [torch.randn(p.shape, generator=gen).to(p) for p in params]
        lam = 0.0
        for _ in range(iters):
            norm = torch.sqrt(sum((a.double() ** 2).sum() for a in v))
            v = [a / norm for a in v]
            hv = torch.autograd.grad(g, params, v, retain_graph=True)
            lam = float(sum((a.double() * b.double()).sum() for a, b in zip(v, hv)))
            v = list(hv)
        return lam

    grad_graph, hvp, g = hvp_parts()
    if o["damping"] == "auto":
        t0 = time.perf_counter()
        lam = dominant(g, o["power_iters"])
        info.update(dominant_eigenvalue=lam, damping=1.1 * abs(lam) or 1.0)
        info["damping_from"] = (
            f"1.1 |λ|, λ = {lam:.3g} from {o['power_iters']} products "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    else:
        info.update(damping=float(o["damping"]), damping_from="the option damping")
    del g

    def alpha(damping: float) -> tuple[float, str]:
        """Neumann's step: the option, else a first call's power iteration (on H + damping I)."""
        if o["neumann_alpha"]:
            return o["neumann_alpha"], "the option neumann_alpha"
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                first = step_of(hg.Neumann(maxiter=o["neumann_iters"], damping=damping))()
            return first.solve.alpha, f"power iteration ({time.perf_counter() - t0:.1f} s)"
        except Exception as e:  # noqa: BLE001 - e.g. an indefinite Hessian at the random init
            return 1e-3, f"1e-3: the power iteration failed ({kit.err_text(e)})"

    cg, nm, d = f"cg{o['cg_iters']}", f"neumann{o['neumann_iters']}", info["damping"]
    info.update(zip(("alpha", "alpha_from"), alpha(0.0)))
    info.update(zip(("alpha_damped", "alpha_damped_from"), alpha(d)))
    configs = {
        "backward": backward,
        "grad+graph": grad_graph,
        "hvp": hvp,
        cg: step_of(hg.CG(maxiter=o["cg_iters"])),
        f"{cg}+recompute": step_of(hg.CG(maxiter=o["cg_iters"]), "recompute"),
        f"{cg}+damped": step_of(hg.CG(maxiter=o["cg_iters"], damping=d)),
        f"minres{o['cg_iters']}": step_of(hg.MINRES(maxiter=o["cg_iters"])),
        nm: step_of(hg.Neumann(maxiter=o["neumann_iters"], alpha=info["alpha"])),
        f"{nm}+damped": step_of(
            hg.Neumann(maxiter=o["neumann_iters"], alpha=info["alpha_damped"], damping=d)
        ),
    }
    if o["amp"]:
        for name in ("backward", cg, f"{cg}+damped", f"{nm}+damped"):
            configs[f"{name}+bf16"] = autocast(configs[name], device)
    records = []
    for name, fn in configs.items():
        rec: dict[str, Any] = dict(config=name, status="ok", error=None, median_ms=None)
        records.append(rec)
        if time.perf_counter() > t_end:
            rec["status"] = "skipped: the part's time budget is spent"
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn()  # warm-up (kernels, cuDNN autotuning, allocator)
                if device == "cuda":
                    base = peak_start(device)
                    out = fn()
                    rec["peak_mib"] = peak_mib(device, base)
                times = kit.timeit({name: fn}, o["reps"], warmup=0)[name]
            if times["errors"]:
                raise RuntimeError(times["errors"][0])
            rec.update(times_s=times["times_s"], median_ms=1e3 * kit.median(times["times_s"]))
            if out is not None:  # a HypergradInfo
                rec["solve"] = {k: getattr(out.solve, k, None) for k in SOLVE_KEYS}
                rec["hypergrad_norm"] = float(out.hypergrad_norm)
        except Exception as e:  # noqa: BLE001 - one configuration failing is a result
            rec.update(status="error", error=kit.err_text(e))
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
        kit.log(
            f"resnet {name}: {rec['status']} {fmt_ms(rec['median_ms'])} ms {rec['error'] or ''}"
        )
    ref = next((r["median_ms"] for r in records if r["config"] == "backward"), None)
    for r in records:
        if ref and r["median_ms"]:
            r["x_backward"] = r["median_ms"] / ref
    failed = [r for r in records if r["status"] == "error"]
    return dict(info=info, records=records, status="failed" if failed else "ok")


def autocast(fn, device: str):
    def run():
        with torch.autocast(device, dtype=torch.bfloat16):
            return fn()

    return run


# -------------------------------------------------------------------------------- peer problems
def peer_problem(key: str, o: dict, device: str, deadline: float = math.inf):
    """The peer suite's network problem ``key`` (its model and sizes; quick: its quick sizes) on
    ``device``, with an inner solution, proximal δ, Neumann step and float64 CG reference
    computed there. Returns the float32 problem the libraries run on."""
    from benchmarks import problems
    from examples._fashion_mnist import available

    quick = o["quick"]
    torch.manual_seed(0)
    if key == "mlp_fashion":
        sizes, n = ((784, 32, 10), 64) if quick else ((784, 1024, 256, 10), 256)
        model, shape = problems.make_mlp(sizes), (784,)
        title = f"MLP {'-'.join(map(str, sizes))} ({n} inner / {n} outer images)"
    elif key == "cnn_digit5":
        width, n = (1 / 32, 16) if quick else (0.125, 32)
        model, shape = problems.DigitFiveCNN(width, fixed_dropout=True), (3, 32, 32)
        title = f"Digit-Five CNN (width x{width:g}), BatchNorm in train mode, batch {n}"
    else:
        raise ValueError(f"no GPU twin of the peer problem {key!r} (mlp_fashion, cnn_digit5)")
    fashion = available(problems.FASHION)
    if fashion:
        xtr, ytr, xva, yva = problems.fashion_mnist(n, n, seed=0 if key[0] == "m" else 1)
        if key == "mlp_fashion":
            mu, sd = xtr.mean(), xtr.std()
            xtr, xva = (xtr - mu) / sd, (xva - mu) / sd
        else:

            def img(a):  # problems.cnn's 28x28 -> 32x32x3, standardised
                a = np.pad((a.reshape(-1, 28, 28) - 0.2860) / 0.3530, ((0, 0), (2, 2), (2, 2)))
                return np.repeat(a[:, None], 3, axis=1)

            xtr, xva = img(xtr), img(xva)
    else:
        rng = np.random.default_rng(0)
        xtr, xva = (rng.standard_normal((n, *shape)).astype(np.float32) for _ in range(2))
        ytr, yva = (rng.integers(0, 10, n) for _ in range(2))
    P = problems._net(key, title, model, (xtr, ytr, xva, yva), ref=False)
    P.extras.update(data="Fashion-MNIST" if fashion else "random (Fashion-MNIST not found)")
    P = on_device(P, device)
    t0 = time.perf_counter()
    q = P.to(torch.float32)
    q.params = problems._lbfgs(q, o["lbfgs_iters"], 1e-7)["params"]
    P.params = {k: p.double() for k, p in q.params.items()}
    lam_max, lam_min = problems.spectrum(P, 30 if quick else 100)
    P.prox_center = {k: p.clone() for k, p in P.params.items()}
    ladder = [0.0] + [m * 10.0**e for e in range(-3, 2) for m in (1, 2, 5)]
    need = 2 * max(-lam_min, 0.0)
    for delta in [d for d in ladder if d >= need] or [need]:  # as problems._solve_net
        P.prox = delta
        ref = reference(P, o["ref_iters"])
        if ref["converged"] or time.perf_counter() > deadline:
            break
    P.alpha = 1.0 / (lam_max + P.prox)
    P.reference = ref.pop("g")
    P.reference_note = "hypergrad CG in float64 on the device, tol 1e-11"
    P.extras.update(lambda_max=lam_max, lambda_min_H_estimate=lam_min, prox_delta=P.prox)
    P.extras.update(reference=ref, build_s=time.perf_counter() - t0)
    return P.to(torch.float32)


def reference(P, maxiter: int) -> dict[str, Any]:
    import hypergrad as hg
    from benchmarks.peers import flat
    from benchmarks.peers.hypergrad import make_solver

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = make_solver("cg", maxiter, tol=1e-11)
        g, info = hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=s)
    s = info.solve
    return dict(g=flat(g), iters=s.iterations, residual=s.residual, converged=s.converged)


def on_device(P, device: str):
    """A copy of the problem ``P`` with its model and tensors on ``device``."""
    q = copy.copy(P)
    move = lambda d: None if d is None else {k: t.to(device) for k, t in d.items()}  # noqa: E731
    q.model = copy.deepcopy(P.model).to(device)
    q.params, q.prox_center = move(P.params), move(P.prox_center)
    q.theta = P.theta.to(device)
    q.x_tr, q.y_tr, q.x_va, q.y_va = (t.to(device) for t in (P.x_tr, P.y_tr, P.x_va, P.y_va))
    return q


def part_peers(o: dict, device: str, limit: float) -> dict[str, Any]:
    """hypergrad against torchopt on the peer suite's MLP and CNN, on ``device``, at equal K."""
    from benchmarks.peers import Unsupported, build, solvers

    t_end, problems_out = time.perf_counter() + limit, []
    for key in o["peer_problems"]:
        res: dict[str, Any] = dict(problem=key, records=[], status="ok")
        problems_out.append(res)
        if time.perf_counter() > t_end:
            res["status"] = "skipped: the part's time budget is spent"
            continue
        try:
            P = peer_problem(key, o, device, t_end)
        except Exception as e:  # noqa: BLE001
            res.update(status="error", error=kit.err_text(e))
            res["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
            kit.log(f"peers {key}: {res['error']}")
            continue
        res["info"] = dict(title=P.title, numel=P.numel, theta_numel=P.theta.numel())
        res["info"].update(alpha=P.alpha, dtype="float32", extras=P.extras)
        kit.log(f"peers {key}: built in {P.extras['build_s']:.1f} s ({P.extras['data']})")
        fns = {}
        for lib in ("hypergrad", "torchopt"):
            names = [s for s in solvers(lib, P) if "+compile" not in s]
            for solver in names:
                for K in o["ks"]:
                    rec = dict(library=lib, solver=solver, K=K, status="ok", error=None)
                    rec.update(median_ms=None, peak_mib=None, rel_error=None)
                    res["records"].append(rec)
                    if time.perf_counter() > t_end:
                        rec["status"] = "skipped: the part's time budget is spent"
                        continue
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            fn = build(lib, "implicit", P, solver, K)
                            rec["rel_error"] = P.rel_error(fn())  # also the warm-up
                            if device == "cuda":
                                base = peak_start(device)
                                fn()
                                rec["peak_mib"] = peak_mib(device, base)
                        fns[(lib, solver, K)] = fn
                    except Unsupported as e:
                        rec.update(status="unsupported", error=str(e))
                    except Exception as e:  # noqa: BLE001 - a library failing is a result
                        rec.update(status="error", error=kit.err_text(e))
        by_key = {(r["library"], r["solver"], r["K"]): r for r in res["records"]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            most = max(o["peer_reps"], 10) if device == "cuda" else o["peer_reps"]
            times = kit.timeit(fns, o["peer_reps"], 0, 0.2 if device == "cuda" else 0.0, most)
        for k, t in times.items():
            r = by_key[k]
            r["times_s"] = t["times_s"]
            if t["times_s"]:
                r["median_ms"] = 1e3 * kit.median(t["times_s"])
            if t["errors"]:
                r.update(status="error", error=t["errors"][0])
        for r in res["records"]:
            kit.log(
                f"peers {key} {r['library']} {r['solver']} K={r['K']}: {r['status']} "
                f"{fmt_ms(r['median_ms'])} ms err={r['rel_error']}"[:200]
            )
        # a peer's error is a result (torchopt refuses BatchNorm unpatched); hypergrad's is not
        if any(r["status"] == "error" and r["library"] == "hypergrad" for r in res["records"]):
            res["status"] = "failed"
        fns.clear()
    bad = [p for p in problems_out if p["status"] in ("error", "failed")]
    return dict(problems=problems_out, status="failed" if bad else "ok")


PARTS = dict(tests=part_tests, bort2=part_bort2, resnet=part_resnet, peers=part_peers)
LIMITS = dict(tests="tests_s", bort2="bort2_s", resnet="resnet_s", peers="peers_s")


# ------------------------------------------------------------------------------------ the run
def resolve_device(name: str) -> str | None:
    """``auto``: CUDA if there is one, else None (the suite is skipped)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else None
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {name!r}")
    return name


def measure(o: dict, out: Path, name: str) -> Path | None:
    """Run the parts in ``o["parts"]``; write ``out/gpu/<machine>.json`` and ``.md`` after each."""
    device = resolve_device(o["device"])
    if device is None:
        kit.log("gpu: skipped, torch sees no CUDA device (--set device=cpu runs it on the CPU)")
        return None
    t_start = time.perf_counter()
    gpu = gpu_facts(device)
    # the option first: a device machine's copy of .git may be older than the tree sent there
    # (seen on the first H200 run: git said the session's starting commit)
    gpu["git"] = o["commit"] or gpu["git"] or None
    machine = o["machine"] or slug(gpu["name"])
    path = out / "gpu" / f"{machine}.json"
    options = {k: v for k, v in o.items() if k != "threads"}
    payload: dict[str, Any] = dict(suite=name, gpu=gpu, options=options, parts={})
    kit.log(
        f"gpu: {gpu['name']} (driver {gpu['driver']}, torch {gpu['torch']}, CUDA {gpu['cuda']})"
    )
    for part in o["parts"]:
        used = time.perf_counter() - t_start
        left = o["budget_s"] - used
        limit = min(float(o[LIMITS[part]]), left) if part in LIMITS else left
        t0 = time.perf_counter()
        if part not in PARTS:
            rec: dict[str, Any] = dict(status="error", error=f"no part {part!r} ({PARTS_ORDER})")
        elif limit <= 0:
            rec = dict(status=f"skipped: the run's budget ({o['budget_s']} s) is spent")
        else:
            kit.log(f"== gpu part {part} (at most {limit:.0f} s)")
            try:
                rec = {"status": "ok", **PARTS[part](o, device, limit)}
            except Exception as e:  # noqa: BLE001 - the other parts still run
                rec = dict(status="error", error=kit.err_text(e))
                rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-8:]
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
        rec["part_s"] = time.perf_counter() - t0
        payload["parts"][part] = rec
        payload["wall_s"] = time.perf_counter() - t_start
        kit.save(path, payload)
        path.with_suffix(".md").write_text(render(json.loads(path.read_text())))
        kit.log(f"== gpu part {part}: {rec['status']} in {rec['part_s']:.0f} s; wrote {path}")
    return path


# --------------------------------------------------------------------------------- the report
def fmt_ms(x) -> str:
    return "–" if x is None else f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def fmt(x, f: str = ".2e") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, f) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def render(res: dict) -> str:
    """The markdown of one result file: the machine, the parts, then each part's table."""
    from benchmarks.report import table

    g, parts = res["gpu"], res["parts"]
    head = f"# GPU run: {g['name']}\n\n<!-- generated from the JSON by benchmarks/suites/gpu.py -->"
    facts = f"{g['name']}, driver {g.get('driver')}, torch {g['torch']} (CUDA {g.get('cuda')}, "
    facts += f"cuDNN {g.get('cudnn')}), hypergrad git {g.get('git')}, {res.get('created')}, "
    facts += f"{res.get('wall_s', 0):.0f} s in all"
    rows = []
    for name, p in parts.items():
        note = p.get("error") or p.get("summary") or ""
        rows.append([name, p.get("git") or g.get("git"), p["status"], f"{p.get('part_s', 0):.0f}"])
        rows[-1].append(str(note)[:120])
    out = [head, facts, table(["part", "commit", "status", "s", "note"], rows, "lllrl")]
    rn = parts.get("resnet", {})
    if rn.get("records"):
        i = rn["info"]
        out.append(
            f"**HyperStep on {i['arch']}** ({i['params']:,} parameters; labeler "
            f"{i['hyper_params']:,}), {i['image']} px, batch {i['batch']}, {i['classes']} "
            f"classes, BatchNorm in train mode; Neumann α = {fmt(i.get('alpha'))} "
            f"({i.get('alpha_from')}), damped (damping {fmt(i.get('damping'), '.3g')}: "
            f"{i.get('damping_from', 'the option')}) α = "
            f"{fmt(i.get('alpha_damped'))}; median of the timed calls; peak = CUDA's peak "
            "allocation above the baseline during one call; HVPs = products the solve spent "
            "(CG stops at negative curvature, Neumann when its terms grow)."
        )
        rows = []
        for r in rn["records"]:
            s = r.get("solve") or {}
            rows.append(
                [r["config"], r["status"], fmt_ms(r["median_ms"]), fmt(r.get("x_backward"), ".1f"),
                 fmt(r.get("peak_mib"), ",.0f"), fmt(s.get("matvecs"), "d"),
                 fmt(s.get("residual")), s.get("failure") or ""]
            )  # fmt: skip
        head_r = ["config", "status", "ms / step", "× backward", "peak MiB", "HVPs", "residual"]
        out.append(table(head_r + ["failure"], rows, "llrrrrrl"))
    for p in parts.get("peers", {}).get("problems", []):
        i = p.get("info") or {}
        x = i.get("extras", {})
        line = f"**{p['problem']}** — {i.get('title', '')}: {p['status']}"
        if i:
            line += (
                f"; {x.get('data')}; reference: float64 CG on the device, residual "
                f"{fmt(x.get('reference', {}).get('residual'))}; δ = {fmt(x.get('prox_delta'))}"
            )
        out.append(line + (f" ({p['error']})" if p.get("error") else ""))
        rows = [
            [r["library"], r["solver"], r["K"], r["status"], fmt_ms(r["median_ms"]),
             fmt(r.get("peak_mib"), ",.1f"), fmt(r.get("rel_error"))]
            for r in p["records"]
        ]  # fmt: skip
        if rows:
            head_p = ["library", "solver", "K", "status", "ms", "peak MiB", "rel. error"]
            out.append(table(head_p, rows, "lllrrrr"))
    b2 = parts.get("bort2", {})
    if b2.get("results"):
        rows = [[r["stage"], r.get("iters"), fmt(r.get("acc"), ".3f"), fmt(r.get("time_s"), ".1f")]
                for r in b2["results"]]  # fmt: skip
        out.append(f"**BORT² smoke preset** ({b2.get('wall_s', 0):.0f} s for the command)")
        out.append(table(["stage", "iters", "target acc.", "s"], rows, "lrrr"))
    return "\n\n".join(out) + "\n"
