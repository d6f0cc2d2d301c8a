"""Shared helpers of the hypergrad benchmarks: machine description, models, timing, output.

Every benchmark script in this folder imports this module. It provides

* :func:`machine_info` -- CPU model, core count, torch version and thread count (recorded in
  every JSON result file);
* the two deep test problems of the overhead / HVP-cost benchmarks: :func:`make_mlp_problem`
  (784-1024-256-10 MLP, ~1.07M parameters, per-layer weight-decay hyperparameters) and
  :func:`make_cnn_problem` (the Digit-Five CNN of M3SDA, :class:`DigitFiveCNN`, ~31.8M
  parameters, per-layer weight-decay hyperparameters);
* interleaved timing (:func:`interleaved_times`) and median/ratio summaries;
* JSON / table output into ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def proc_status_kb(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- machine / output


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Description of the machine and software the numbers were measured on."""
    try:
        import torchopt

        topt = torchopt.__version__
    except Exception:  # pragma: no cover - torchopt is a hard dependency of hypergrad
        topt = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "torch_version": torch.__version__,
        "torchopt_version": topt,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "cuda_used": False,
    }


def machine_line(info: dict[str, Any] | None = None) -> str:
    info = info or machine_info()
    return (
        f"CPU: {info['cpu_model']} ({info['cpu_count']} cores), torch {info['torch_version']}, "
        f"{info['torch_threads']} threads, load avg {info['loadavg_at_start']}"
    )


def save_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus the machine description) to ``benchmarks/results/<name>.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), "created": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    path = RESULTS / f"{name}.json"
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=_jsonable)
    return path


def _jsonable(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, float) and o != o:
        return None
    return str(o)


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text (and Markdown-compatible) table."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c != c:
            return "n/a"
        if c == 0 or 1e-3 <= abs(c) < 1e5:
            return f"{c:.4g}"
        return f"{c:.3e}"
    return str(c)


def setup_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- timing


def interleaved_times(
    fns: dict[str, Callable[[], Any]],
    reps: int,
    warmup: int = 1,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Wall times of every function in ``fns``, interleaved: rep 1 of each, rep 2 of each, ...

    The order inside a repetition alternates (forward on even reps, reversed on odd ones) so
    that neither function systematically runs right after the other. ``torch.manual_seed(seed)``
    is called before every call so random draws (dropout) are identical. Returns wall times under
    each name and process CPU times (all threads, ``time.process_time``) under ``name + "_cpu"``.
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            torch.manual_seed(seed)
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    times.update({f"{n}_cpu": [] for n in names})
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            torch.manual_seed(seed)
            c0 = time.process_time()
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
            times[f"{n}_cpu"].append(time.process_time() - c0)
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of the per-repetition ratios (robust to load drifting between repetitions)."""
    return median([a / b for a, b in zip(num, den)])


# --------------------------------------------------------------------------- models


class DigitFiveCNN(nn.Module):
    """The Digit-Five CNN of M3SDA (Peng et al. 2019), ~31.8M parameters at 32x32x3 input.

    conv5x5 3->64 + BN + ReLU + maxpool(3, 2, 1) -> 64x16x16;
    conv5x5 64->64 + BN + ReLU + maxpool(3, 2, 1) -> 64x8x8;
    conv5x5 64->128 + BN + ReLU -> 128x8x8 = 8192;
    FC 8192->3072 + BN1d + ReLU + dropout(0.5); FC 3072->2048 + BN1d + ReLU; head 2048->10.
    (ReLUs are out of place so double backward never meets an overwritten input.)
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()

        def conv(cin: int, cout: int, pool: bool) -> list[nn.Module]:
            layers: list[nn.Module] = [
                nn.Conv2d(cin, cout, 5, padding=2),
                nn.BatchNorm2d(cout),
                nn.ReLU(),
            ]
            if pool:
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
            return layers

        self.features = nn.Sequential(
            *conv(3, 64, True),
            *conv(64, 64, True),
            *conv(64, 128, False),
            nn.Flatten(),
            nn.Linear(8192, 3072),
            nn.BatchNorm1d(3072),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(3072, 2048),
            nn.BatchNorm1d(2048),
            nn.ReLU(),
        )
        self.head = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_mlp(sizes: Sequence[int] = (784, 1024, 256, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclass
class Problem:
    """A bilevel problem over a module: ``inner(params, theta)`` / ``outer(params, theta)``.

    ``params`` is a dict name -> tensor (detached leaves); ``theta`` a 1-D tensor of per-layer
    log weight decays (one per weight matrix / conv kernel). The inner loss is the training
    cross-entropy plus ``sum_l exp(theta_l)/2 ||W_l||^2``; the outer loss is the cross-entropy on
    a separate validation batch (it does not depend on ``theta`` directly).
    """

    name: str
    model: nn.Module
    params: dict[str, torch.Tensor]
    theta: torch.Tensor
    inner: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
    outer: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
    grad_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())


def _weight_decay_problem(
    name: str,
    model: nn.Module,
    x_tr: torch.Tensor,
    y_tr: torch.Tensor,
    x_va: torch.Tensor,
    y_va: torch.Tensor,
    log_wd: float = -4.0,
) -> Problem:
    model.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    decayed = [n for n, p in params.items() if p.ndim >= 2]
    theta = torch.full((len(decayed),), log_wd)
    ce = nn.functional.cross_entropy

    def inner(ps: dict[str, torch.Tensor], th: torch.Tensor) -> torch.Tensor:
        loss = ce(functional_call(model, ps, (x_tr,)), y_tr)
        coef = torch.exp(th)
        reg = sum(coef[i] * (ps[n] ** 2).sum() for i, n in enumerate(decayed))
        return loss + 0.5 * reg

    def outer(ps: dict[str, torch.Tensor], th: torch.Tensor) -> torch.Tensor:
        return ce(functional_call(model, ps, (x_va,)), y_va)

    def grad_loss(ps: dict[str, torch.Tensor]) -> torch.Tensor:
        return inner(ps, theta)

    return Problem(name, model, params, theta, inner, outer, grad_loss)


def make_mlp_problem(batch: int = 256, seed: int = 0) -> Problem:
    """784-1024-256-10 MLP (1,068,810 parameters) on random Fashion-MNIST-sized data."""
    torch.manual_seed(seed)
    model = make_mlp((784, 1024, 256, 10))
    x_tr, x_va = torch.randn(batch, 784), torch.randn(batch, 784)
    y_tr, y_va = torch.randint(0, 10, (batch,)), torch.randint(0, 10, (batch,))
    return _weight_decay_problem("mlp", model, x_tr, y_tr, x_va, y_va)


def make_cnn_problem(batch: int = 64, seed: int = 0) -> Problem:
    """Digit-Five CNN (31.8M parameters) on a random batch of 32x32x3 images."""
    torch.manual_seed(seed)
    model = DigitFiveCNN()
    x_tr, x_va = torch.randn(batch, 3, 32, 32), torch.randn(batch, 3, 32, 32)
    y_tr, y_va = torch.randint(0, 10, (batch,)), torch.randint(0, 10, (batch,))
    return _weight_decay_problem("digit5_cnn", model, x_tr, y_tr, x_va, y_va)


PROBLEMS = {"mlp": make_mlp_problem, "cnn": make_cnn_problem}


def fresh_leaves(ps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach().requires_grad_(True) for n, p in ps.items()}
