"""Cost of one HyperStep meta step per method, in units of one forward+backward pass of the
inner loss (time and peak memory; docs/performance.md, "Meta-step cost per method").

The problem is Meta-Weight-Net-style reweighting: θ is one weight logit per training sample,
the inner loss ``mean(σ(θ_i) CE_i) + decay`` of a network in train mode (BatchNorm batch
statistics, dropout), the outer loss the cross-entropy of a second batch. Models: the Digit-Five
CNN of M3SDA at full width (31.8M parameters, 32 px; MiniDigits' architecture) and torchvision's
ResNet-18 on 32-px images. Times are medians of ``reps`` alternating calls in one process; peak
memory is each call's growth of the resident set in a fresh process (``kit.probe``), the
baseline being the model, its data and one warm-up call of the same kind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hypergrad as hg
from benchmarks import kit
from benchmarks.problems import DigitFiveCNN

OPTIONS = dict(models=["cnn", "resnet18"], batch=32, reps=5, memory=True, cg_iters=5)
QUICK = dict(models=["cnn_small"], batch=8, reps=2, memory=False)
METHODS = ("backward", "implicit_cg", "implicit_neumann", "unrolled", "first_order",
           "first_order_terms2", "single_loop")  # fmt: skip


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "cnn":
        return DigitFiveCNN(1.0)
    if kind == "cnn_small":
        return DigitFiveCNN(0.125)
    if kind == "resnet18":
        import torchvision

        net = torchvision.models.resnet18(num_classes=10)
        net.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)  # the 32-px stem
        net.maxpool = nn.Identity()
        return net
    raise ValueError(f"unknown model {kind!r}")


def _method(name: str, model: nn.Module, cg_iters: int):
    if name == "implicit_cg":
        return hg.Implicit(solver=hg.CG(maxiter=cg_iters, tol=0.0, damping=1.0))
    if name == "implicit_neumann":
        return hg.Implicit(solver=hg.Neumann(maxiter=cg_iters, alpha=1e-3))
    if name == "unrolled":
        return hg.Unrolled(hg.optim.sgd(lr=0.01), steps=1)
    if name == "first_order":
        return hg.FirstOrder(alpha=0.01)
    if name == "first_order_terms2":
        return hg.FirstOrder(alpha=0.01, terms=2)
    if name == "single_loop":
        return hg.SingleLoop(step=0.01)
    raise ValueError(f"unknown method {name!r}")


def build(model: str, method: str, batch: int, cg_iters: int):
    """The measured call (one meta step, or the reference forward+backward)."""
    net = _model(model).train()
    g = torch.Generator().manual_seed(1)
    x, xv = (torch.randn(batch, 3, 32, 32, generator=g) for _ in range(2))
    y, yv = (torch.randint(0, 10, (batch,), generator=g) for _ in range(2))
    logits = torch.zeros(batch, requires_grad=True)

    def inner(m, _):
        ce = F.cross_entropy(m(x), y, reduction="none")
        decay = sum((p**2).sum() for p in m.parameters())
        return (torch.sigmoid(logits) * ce).mean() + 1e-4 * decay

    def outer(m, _):
        return F.cross_entropy(m(xv), yv)

    if method == "backward":
        params = [p for p in net.parameters() if p.requires_grad]
        return lambda: torch.autograd.grad(inner(net, None), params)
    step = hg.HyperStep(net, [logits], inner, outer, method=_method(method, net, cg_iters))
    step.measure_stationarity = False  # not part of any method's cost
    return lambda: step(None)


def measure(o: dict, out, name: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    records = []
    for model in o["models"]:
        fns = {m: build(model, m, o["batch"], o["cg_iters"]) for m in METHODS}
        times = kit.timeit(fns, o["reps"], warmup=1)
        for m in METHODS:
            if times[m]["errors"]:
                raise RuntimeError(f"{model} {m}: {times[m]['errors'][0]}")
        base_t = kit.median(times["backward"]["times_s"])
        peaks = {}
        if o["memory"]:
            configs = [dict(model=model, method=m, batch=o["batch"], cg_iters=o["cg_iters"])
                       for m in METHODS]  # fmt: skip
            for m, r in zip(METHODS, kit.probe("benchmarks.suites.meta_cost:build", configs)):
                peaks[m] = r["peak_mib"]
        for m in METHODS:
            t = kit.median(times[m]["times_s"])
            rec = dict(model=model, method=m, time_s=t, times_s=times[m]["times_s"],
                       time_units=t / base_t, peak_mib=peaks.get(m))  # fmt: skip
            if peaks.get(m) and peaks.get("backward"):
                rec["peak_units"] = peaks[m] / peaks["backward"]
            records.append(rec)
            peak = f", peak {rec['peak_units']:.2f}x" if "peak_units" in rec else ""
            kit.log(f"{model} {m}: {t * 1e3:.0f} ms = {rec['time_units']:.2f} backward{peak}")
    kit.save(out / f"{name}.json", {"quick": o["quick"], **{k: o[k] for k in OPTIONS},
                                    "records": records, "machine": kit.machine()})  # fmt: skip
