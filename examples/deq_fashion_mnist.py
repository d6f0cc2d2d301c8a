"""A deep-equilibrium (DEQ) classifier on Fashion-MNIST: Anderson forward, implicit backward,
against torchdeq and against backpropagation through the unrolled iterations.

Run: ``python examples/deq_fashion_mnist.py`` (``--quick`` for a small smoke run). Needs the Debian
package ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``); without it the
script exits with code 2 and says so. The torchdeq variant needs ``pip install torchdeq`` (in the
``bench`` extra); without it that variant is skipped with a note.

Model (all variants share it, the initial parameters and the batch order):

* injection ``u = U x + b`` (``x``: the 784 pixels in [0, 1] minus the training mean pixel,
  ``U``: width x 784);
* equilibrium ``z* = tanh(W z* + u)``, width 64 by default (``--width``);
* readout ``logits = R z* + c``; loss: mean cross-entropy.
* contraction: ``W = V · min(1, κ / ||V||₂)`` with ``κ = 0.9`` (``--kappa``) and ``||V||₂`` the
  exact spectral norm (``torch.linalg.matrix_norm(V, 2)``, differentiated through). Since
  ``|tanh'| ≤ 1``, the map ``z ↦ tanh(W z + u)`` is then a κ-contraction in the Euclidean norm
  for every input, so the fixed point exists, is unique, and Picard iteration, the adjoint
  fixed-point iteration (Neumann with α = 1) and GMRES all converge.

Variants (``--variants``):

* ``hypergrad``: Anderson acceleration (``hg.inner.FixedPoint``, memory 5, relative residual
  ``||T(z) − z|| / max(||z||, ||T(0)||) ≤ 1e-4`` over the whole batch, at most 50 iterations)
  and the implicit backward ``(I − ∂T/∂z)ᵀ w = ∂L/∂z`` by ``hg.GMRES(tol=1e-5)``
  (``hg.custom_fixed_point``);
* ``hypergrad-neumann``: the same forward, the backward by ``hg.Neumann(alpha=1.0, tol=1e-5)``
  (the classic adjoint fixed-point iteration ``w ← v + (∂T/∂z)ᵀ w``, at most 50 products);
* ``unrolled``: K = 20 Picard iterations ``z ← T(z)`` from ``z = 0`` (``--unroll``) with
  ordinary autograd through all of them (the same K at test time: a 20-layer weight-tied net);
* ``torchdeq``: ``torchdeq.get_deq(core="indexing", ift=True, f_solver="anderson",
  b_solver="fixed_point_iter")`` with the same iteration caps and tolerances (stop mode
  ``"rel"``, which torchdeq measures per example, ``||f(z) − z|| / ||f(z)||``, and stops when
  the largest over the batch is below the tolerance).

Measured per variant: test accuracy after every epoch (the full 10,000-image test set by default),
wall-clock and CPU (``time.process_time``) time of each training epoch (training steps only;
the medians are reported), forward and backward iteration counts, and **peak tensor memory of
one training step** (forward + backward on one batch): a ``TorchDispatchMode`` sees every ATen
operator call, registers each new tensor storage its outputs hold (not in-place results or views
of its inputs), and after each allocating call sums the storages still alive (weak references);
the peak of that sum is the figure. It counts what the step allocates (activations
kept for backward, solver histories, gradients) and not what existed before (parameters, data).
``resource.getrusage``/RSS is process-wide, monotone and dominated by the torch library; tracemalloc
does not see torch's allocator.

Gradient agreement (at the trained ``hypergrad`` parameters, on one training batch): the gradient
of the loss w.r.t. all parameters from each variant (float32 as trained, and float64 with the same
settings) against a float64 reference: the fixed point solved to 1e-14 and the adjoint from a
**dense per-example solve** ``(I − diag(1 − z_i²) W)ᵀ w_i = v_i`` (``torch.linalg.solve``, one
width x width system per example, independent of the library's Krylov solvers). Reported: cosine
and relative error ``||g − g_ref|| / ||g_ref||`` over all parameters. Unrolled backprop is also
checked at several K (``--grad-unroll``).

Outputs under ``--out`` (default ``runs/deq_fashion_mnist``): ``results.json`` and
``deq_fashion_mnist.png`` (test accuracy against epoch and against training CPU time).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import _fashion_mnist as fm
import numpy as np
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hypergrad as hg

try:
    import torchdeq
except ImportError:  # optional comparison
    torchdeq = None

VARIANTS = ("hypergrad", "hypergrad-neumann", "unrolled", "torchdeq")
PARAM_NAMES = ("V", "U", "b", "R", "c")
Params = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def load_data(data_dir: str, seed: int, n_train: int, n_test: int) -> dict[str, torch.Tensor]:
    """``n_train`` training images drawn (seeded) from the 60,000; the first ``n_test`` official
    test images (all 10,000 by default). Pixels / 255, centred by the training mean pixel."""
    raw = fm.load(data_dir)
    rng = np.random.default_rng(seed)
    tr = rng.permutation(len(raw["train_labels"]))[:n_train]
    xtr = torch.tensor(raw["train_images"][tr], dtype=torch.float32) / 255.0
    xte = torch.tensor(raw["test_images"][:n_test], dtype=torch.float32) / 255.0
    mu = xtr.mean(0)
    return {
        "xtr": xtr - mu,
        "ytr": torch.tensor(raw["train_labels"][tr].astype(np.int64)),
        "xte": xte - mu,
        "yte": torch.tensor(raw["test_labels"][:n_test].astype(np.int64)),
    }


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def init_params(
    width: int, d_in: int = 784, classes: int = 10, seed: int = 0, dtype=torch.float32
) -> Params:
    """``V`` (width²) with spectral norm about 1 (so ``W`` starts at the cap κ), ``U`` with
    variance 1/784 per entry, ``R`` with variance 1/width; zero biases."""
    g = torch.Generator().manual_seed(seed)
    p = {
        "V": torch.randn(width, width, generator=g, dtype=torch.float64) / (2 * math.sqrt(width)),
        "U": torch.randn(width, d_in, generator=g, dtype=torch.float64) / math.sqrt(d_in),
        "b": torch.zeros(width, dtype=torch.float64),
        "R": torch.randn(classes, width, generator=g, dtype=torch.float64) / math.sqrt(width),
        "c": torch.zeros(classes, dtype=torch.float64),
    }
    return {k: v.to(dtype).requires_grad_(True) for k, v in p.items()}


def cast(p: Params, dtype: torch.dtype) -> Params:
    """A detached copy of ``p`` in ``dtype`` that requires grad (fresh leaves)."""
    return {k: v.detach().to(dtype).clone().requires_grad_(True) for k, v in p.items()}


def weight(V: torch.Tensor, kappa: float) -> torch.Tensor:
    """``W = V · min(1, κ / ||V||₂)``: spectral norm at most κ (differentiable in ``V``)."""
    s = torch.linalg.matrix_norm(V, ord=2)
    return V * torch.clamp(kappa / s, max=1.0)


def T(z: torch.Tensor, h: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The equilibrium map ``z ↦ tanh(z Wᵀ + u)`` on a batch ``z`` (B x width); ``h = (W, u)``."""
    W, u = h
    return torch.tanh(z @ W.T + u)


def hparams_of(p: Params, x: torch.Tensor, kappa: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, u)``: what the fixed point depends on, built from the parameters with autograd."""
    return weight(p["V"], kappa), x @ p["U"].T + p["b"]


def readout(p: Params, z: torch.Tensor) -> torch.Tensor:
    return z @ p["R"].T + p["c"]


class Method:
    """One way to compute the equilibrium: ``solve(params, x)`` returns ``z`` (differentiable
    as the variant prescribes) and records forward/backward iteration counts in ``stats``."""

    name = ""

    def __init__(self, cfg: argparse.Namespace):
        self.cfg = cfg
        self.stats: dict[str, list[float]] = {"forward_iterations": [], "forward_residual": []}

    def solve(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def predict(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        """Logits without autograd (evaluation)."""
        with torch.no_grad():
            h = hparams_of(p, x, self.cfg.kappa)
            z, _ = hg.inner.FixedPoint(
                T,
                method="anderson",
                maxiter=self.cfg.f_maxiter,
                tol=self.cfg.f_tol,
                memory=self.cfg.memory,
            ).solve(torch.zeros_like(h[1]), h)
            return readout(p, z)

    def after_backward(self) -> None:
        pass

    def summary(self) -> dict[str, float]:
        return {k: statistics.fmean(v) for k, v in self.stats.items() if v}


class HypergradMethod(Method):
    """Anderson forward (``hg.inner.FixedPoint``), implicit backward by ``solver``."""

    def __init__(self, cfg: argparse.Namespace, solver: Any, name: str):
        super().__init__(cfg)
        self.name = name
        self.layer = hg.inner.FixedPoint(
            T, method="anderson", maxiter=cfg.f_maxiter, tol=cfg.f_tol, memory=cfg.memory,
            solver=solver,
        )  # fmt: skip
        self.stats.update(backward_iterations=[], backward_residual=[])

    def solve(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        h = hparams_of(p, x, self.cfg.kappa)
        z = self.layer.run(torch.zeros_like(h[1]), h)
        info = self.layer.last_info
        self.stats["forward_iterations"].append(info.iterations)
        self.stats["forward_residual"].append(info.residual)
        return z

    def after_backward(self) -> None:
        info = self.layer.last_implicit_info
        if info is not None:
            self.stats["backward_iterations"].append(info.solve.iterations)
            self.stats["backward_residual"].append(info.solve.residual)


class UnrolledMethod(Method):
    """``K`` Picard iterations from 0 with autograd through all of them (train and test)."""

    def __init__(self, cfg: argparse.Namespace, steps: int | None = None):
        super().__init__(cfg)
        self.steps = cfg.unroll if steps is None else steps
        self.name = "unrolled"

    def _iterate(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        h = hparams_of(p, x, self.cfg.kappa)
        z = torch.zeros_like(h[1])
        for _ in range(self.steps):
            z = T(z, h)
        with torch.no_grad():
            res = float((T(z, h) - z).norm() / z.norm().clamp_min(1e-30))
        self.stats["forward_iterations"].append(self.steps)
        self.stats["forward_residual"].append(res)
        return z

    def solve(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        return self._iterate(p, x)

    def predict(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return readout(p, self._iterate(p, x))


class TorchDEQMethod(Method):
    """torchdeq's DEQ layer: Anderson forward, IFT backward by its fixed-point iteration."""

    name = "torchdeq"

    def __init__(self, cfg: argparse.Namespace):
        super().__init__(cfg)
        assert torchdeq is not None
        self.deq = torchdeq.get_deq(
            core="indexing", ift=True, f_solver="anderson", b_solver=cfg.torchdeq_b_solver,
            f_max_iter=cfg.f_maxiter, b_max_iter=cfg.b_maxiter, f_tol=cfg.f_tol,
            b_tol=cfg.b_tol, f_stop_mode="rel", b_stop_mode="rel",
        )  # fmt: skip
        self.stats.update(backward_iterations=[], backward_residual=[])
        self._writer = self._record_backward

    def _record_backward(self, info: dict) -> None:
        self.stats["backward_iterations"].append(float(info["nstep"].float().mean()))
        self.stats["backward_residual"].append(float(info["rel_lowest"].max()))

    def solve(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        h = hparams_of(p, x, self.cfg.kappa)
        self.deq.train()
        zs, info = self.deq(lambda z: T(z, h), torch.zeros_like(h[1]), backward_writer=self._writer)
        self.stats["forward_iterations"].append(float(info["nstep"].float().mean()))
        self.stats["forward_residual"].append(float(info["rel_lowest"].max()))
        return zs[-1]

    def predict(self, p: Params, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = hparams_of(p, x, self.cfg.kappa)
            self.deq.eval()
            zs, _ = self.deq(lambda z: T(z, h), torch.zeros_like(h[1]))
            return readout(p, zs[-1])


def make_method(name: str, cfg: argparse.Namespace) -> Method:
    if name == "hypergrad":
        return HypergradMethod(cfg, hg.GMRES(tol=cfg.b_tol, maxiter=cfg.b_maxiter), name)
    if name == "hypergrad-neumann":
        return HypergradMethod(
            cfg, hg.Neumann(alpha=1.0, maxiter=cfg.b_maxiter, tol=cfg.b_tol), name
        )
    if name == "unrolled":
        return UnrolledMethod(cfg)
    if name == "torchdeq":
        return TorchDEQMethod(cfg)
    raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")


def loss_fn(method: Method, p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(readout(p, method.solve(p, x)), y)


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------
class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storage allocated inside the block and alive at once.

    Every ATen call's outputs are inspected; a storage that is not one of the call's inputs'
    (in-place results and views are not new) and not seen before (or whose earlier owner at that
    address is gone) is registered with a weak reference and its size. After each call
    the sizes of the registered storages still alive are summed; ``peak`` is the largest sum.
    Storages that existed before the block (parameters, data) are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = False
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in inputs:  # in place, or a view of an input: nothing new
                    continue
                old = self.live.get(key)
                if old is None or old[0].expired():
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
                    new = True
        if new:  # the live total only rises when something is allocated
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def flat_grad(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g[k].reshape(-1).to(torch.float64) for k in PARAM_NAMES])


def reference_grad(p: Params, x: torch.Tensor, y: torch.Tensor, kappa: float) -> dict:
    """float64 gradient of the loss: fixed point to 1e-14 (Anderson), and
    the adjoint from one dense solve per example, ``(I − diag(s_i) W)ᵀ w_i = v_i``,
    ``s_i = 1 − z_i²``; ``∂L/∂W = Σ_i (s_i ⊙ w_i) z_iᵀ``, ``∂L/∂u_i = s_i ⊙ w_i``, then
    autograd from ``(W, u)`` to ``(V, U, b)``."""
    q = cast(p, torch.float64)
    x = x.to(torch.float64)
    W, u = hparams_of(q, x, kappa)
    with torch.no_grad():
        z, info = hg.inner.FixedPoint(T, method="anderson", maxiter=500, tol=1e-14, memory=5).solve(
            torch.zeros_like(u), (W, u)
        )
    zl = z.detach().requires_grad_(True)
    loss = F.cross_entropy(readout(q, zl), y)
    v, gR, gc = torch.autograd.grad(loss, [zl, q["R"], q["c"]])
    with torch.no_grad():
        s = 1 - z**2
        eye = torch.eye(W.shape[0], dtype=torch.float64)
        A_t = (eye - s[:, :, None] * W.detach()[None]).transpose(1, 2)  # (I − diag(s) W)ᵀ
        w = torch.linalg.solve(A_t, v.unsqueeze(-1)).squeeze(-1)
        gu = s * w
        gW = gu.T @ z
    gV, gU, gb = torch.autograd.grad([W, u], [q["V"], q["U"], q["b"]], [gW, gu])
    return {
        "grad": {"V": gV, "U": gU, "b": gb, "R": gR, "c": gc},
        "fixed_point_residual": info.residual,
        "loss": float(loss.detach()),
    }


def method_grad(
    method: Method, p: Params, x: torch.Tensor, y: torch.Tensor, dtype
) -> tuple[dict[str, torch.Tensor], int]:
    """The parameter gradient from ``method`` in ``dtype``, and the step's peak tensor bytes."""
    q = cast(p, dtype)
    x = x.to(dtype)
    with PeakTensorMemory() as mem:
        loss_fn(method, q, x, y).backward()
    method.after_backward()
    return {k: q[k].grad for k in PARAM_NAMES}, mem.peak


def compare(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    a, b = flat_grad(g), flat_grad(ref)
    out = {
        "cosine": float(a @ b / (a.norm() * b.norm())),
        "rel_error": float((a - b).norm() / b.norm()),
    }
    for k in PARAM_NAMES:
        out[f"rel_error_{k}"] = float(
            (g[k].to(torch.float64) - ref[k]).norm() / ref[k].norm().clamp_min(1e-300)
        )
    return out


def gradient_agreement(
    cfg: argparse.Namespace, names: list[str], p: Params, x: torch.Tensor, y: torch.Tensor
) -> dict:
    ref = reference_grad(p, x, y, cfg.kappa)
    rows = []
    for dtype in (torch.float32, torch.float64):
        methods = [(name, make_method(name, cfg)) for name in names]
        methods += [(f"unrolled K={k}", UnrolledMethod(cfg, steps=k)) for k in cfg.grad_unroll]
        for label, m in methods:
            g, peak = method_grad(m, p, x, y, dtype)
            row = {"variant": label, "dtype": str(dtype).replace("torch.", "")}
            row.update(compare(g, ref["grad"]))
            row.update({k: v[-1] for k, v in m.stats.items() if v})
            row["peak_step_memory_bytes"] = peak
            rows.append(row)
    return {
        "reference": "float64, fixed point to 1e-14 relative residual, dense per-example adjoint",
        "reference_fixed_point_residual": ref["fixed_point_residual"],
        "batch_size": len(y),
        "rows": rows,
    }


def accuracy(method: Method, p: Params, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    correct = 0
    for i in range(0, len(y), batch):
        correct += int((method.predict(p, x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
    return correct / len(y)


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def train_variant(name: str, cfg: argparse.Namespace, data: dict, progress: bool) -> dict:
    method = make_method(name, cfg)
    p = init_params(cfg.width, seed=cfg.seed)
    opt = torch.optim.Adam(p.values(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # same batch order for every variant
    n = len(data["ytr"])
    acc, epoch_times, epoch_cpu, eval_times, train_loss = [], [], [], [], []
    for epoch in range(cfg.epochs):
        perm = torch.randperm(n, generator=gen)
        t0, c0, total = time.perf_counter(), time.process_time(), 0.0
        for i in range(0, n, cfg.batch):
            idx = perm[i : i + cfg.batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(method, p, data["xtr"][idx], data["ytr"][idx])
            loss.backward()
            method.after_backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        epoch_times.append(time.perf_counter() - t0)
        epoch_cpu.append(time.process_time() - c0)
        train_loss.append(total / n)
        t0 = time.perf_counter()
        acc.append(accuracy(method, p, data["xte"], data["yte"], cfg.eval_batch))
        eval_times.append(time.perf_counter() - t0)
        if progress:
            print(
                f"  {name:18s} epoch {epoch + 1}/{cfg.epochs}: train loss {train_loss[-1]:.4f}, "
                f"test acc {acc[-1]:.4f}, {epoch_times[-1]:.1f} s",
                flush=True,
            )
    idx = torch.arange(min(cfg.batch, n))
    _, peak = method_grad(method, p, data["xtr"][idx], data["ytr"][idx], torch.float32)
    with torch.no_grad():
        w_norm = float(torch.linalg.matrix_norm(weight(p["V"], cfg.kappa), ord=2))
    return {
        "variant": name,
        "test_accuracy": acc[-1],
        "test_accuracy_per_epoch": acc,
        "train_loss_per_epoch": train_loss,
        "epoch_time_s": epoch_times,
        "median_epoch_time_s": statistics.median(epoch_times),
        "epoch_cpu_s": epoch_cpu,
        "median_epoch_cpu_s": statistics.median(epoch_cpu),
        "eval_time_s": eval_times,
        "peak_step_memory_bytes": peak,
        "spectral_norm_W": w_norm,
        **{f"mean_{k}": v for k, v in method.summary().items()},
        "_params": {k: v.detach().clone() for k, v in p.items()},
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    data = load_data(args.data_dir, args.seed, args.n_train, args.n_test)
    names = list(args.variants)
    notes = []
    if "torchdeq" in names and torchdeq is None:
        names.remove("torchdeq")
        notes.append("torchdeq is not installed (pip install torchdeq): variant skipped")
    results = []
    for name in names:
        results.append(train_variant(name, args, data, not args.no_progress))
    params = {r["variant"]: r.pop("_params") for r in results}
    p_ref = params.get("hypergrad", next(iter(params.values())))
    gen = torch.Generator().manual_seed(args.seed + 2)
    idx = torch.randperm(len(data["ytr"]), generator=gen)[: args.grad_batch]
    grads = gradient_agreement(args, names, p_ref, data["xtr"][idx], data["ytr"][idx])
    return {
        "config": {
            k: v for k, v in vars(args).items() if k not in ("out", "data_dir", "no_progress")
        },
        "torch": torch.__version__,
        "torchdeq": _version("torchdeq") if torchdeq is not None else None,
        "threads": torch.get_num_threads(),
        "variants": results,
        "gradient_agreement": grads,
        "notes": notes,
        "wall_time_s": time.perf_counter() - t_start,
    }


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def report(res: dict) -> None:
    print()
    print(
        "| variant | test acc | median epoch wall (s) | median epoch CPU (s) "
        "| peak step memory (MiB) | fwd iters | bwd iters |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in res["variants"]:
        bwd = r.get("mean_backward_iterations")
        print(
            f"| {r['variant']} | {r['test_accuracy']:.4f} | {r['median_epoch_time_s']:.2f} | "
            f"{r['median_epoch_cpu_s']:.2f} | "
            f"{r['peak_step_memory_bytes'] / 2**20:.2f} | {r['mean_forward_iterations']:.1f} | "
            f"{'—' if bwd is None else f'{bwd:.1f}'} |"
        )
    g = res["gradient_agreement"]
    print(f"\ngradient agreement ({g['reference']}; batch {g['batch_size']}):")
    print("| variant | dtype | cosine | relative error | fwd residual | peak step memory (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in g["rows"]:
        print(
            f"| {r['variant']} | {r['dtype']} | {r['cosine']:.8f} | {r['rel_error']:.2e} | "
            f"{r['forward_residual']:.1e} | {r['peak_step_memory_bytes'] / 2**20:.2f} |"
        )
    for note in res["notes"]:
        print("note:", note)
    print(f"\nwall time {res['wall_time_s']:.1f} s")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in res["variants"]:
        ep = np.arange(1, len(r["test_accuracy_per_epoch"]) + 1)
        axes[0].plot(ep, r["test_accuracy_per_epoch"], marker="o", label=r["variant"])
        axes[1].plot(
            np.cumsum(r["epoch_cpu_s"]), r["test_accuracy_per_epoch"], marker="o",
            label=r["variant"],
        )  # fmt: skip
    axes[0].set_xlabel("epoch")
    axes[1].set_xlabel("training CPU time (s)")
    for ax in axes:
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("DEQ on Fashion-MNIST")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(s: str) -> list[int]:
    return [int(t) for t in s.split(",") if t]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,000 train / 1,000 test, 1 epoch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=fm.DEFAULT_DIR)
    ap.add_argument("--out", default="runs/deq_fashion_mnist")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    ap.add_argument("--n-train", type=int, default=None, help="default 10000 (quick 1000)")
    ap.add_argument("--n-test", type=int, default=None, help="default 10000 (quick 1000)")
    ap.add_argument("--epochs", type=int, default=None, help="default 5 (quick 1)")
    ap.add_argument("--width", type=int, default=None, help="hidden width (default 64; quick 32)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--eval-batch", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    ap.add_argument("--kappa", type=float, default=0.9, help="spectral norm cap of W")
    ap.add_argument("--f-tol", type=float, default=1e-4, help="forward relative residual")
    ap.add_argument("--f-maxiter", type=int, default=50)
    ap.add_argument("--memory", type=int, default=5, help="Anderson history")
    ap.add_argument("--b-tol", type=float, default=1e-5, help="backward relative residual")
    ap.add_argument("--b-maxiter", type=int, default=50)
    ap.add_argument("--unroll", type=int, default=20, help="Picard steps of the unrolled variant")
    ap.add_argument(
        "--torchdeq-b-solver", default="fixed_point_iter",
        choices=["fixed_point_iter", "anderson", "broyden"],
    )  # fmt: skip
    ap.add_argument("--grad-batch", type=int, default=128)
    ap.add_argument(
        "--grad-unroll", type=_ints, default=[10, 50, 200],
        help="extra unrolled K for the gradient check (comma-separated)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    quick = {"n_train": 1000, "n_test": 1000, "epochs": 1, "width": 32}
    full = {"n_train": 10000, "n_test": 10000, "epochs": 5, "width": 64}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> dict:
    if not fm.available(args.data_dir):
        print(
            fm.INSTALL_HINT.format(
                dir=args.data_dir, files=", ".join(fm.missing_files(args.data_dir))
            ),
            file=sys.stderr,
        )
        raise SystemExit(2)
    res = run(args)
    report(res)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(args.out, "deq_fashion_mnist.png"))
    print("saved", os.path.join(args.out, "results.json"), "and deq_fashion_mnist.png")
    return res


if __name__ == "__main__":
    main()
