"""Amortized cost of BORT2's bilevel updates relative to the robust (no-bilevel) variant.

Measures, side by side on the same batches and the same machine, the time of one robust inner
iteration (teacher labels, threshold, student forward/backward/step) and the time of one hyper
step (``BilevelLabelUpdater`` with the authors' defaults: F_theta in train mode, their Neumann
series, clipping, SGD on F_theta; the outer loss is kept without its ReLU so that the full
hypergradient is computed even where the authors' loss would be zero). The amortized
ratio with one hyper step every ``hyper_every`` iterations is

    (hyper_every * t_inner + t_hyper) / (hyper_every * t_inner).

Run: ``python benchmarks/bort2_bilevel_cost.py [--width 0.125] [--batch 128] [--reps 15]``.
Writes ``benchmarks/results/bort2_bilevel_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from bort2.data.transforms import strong_view, weak_view
from bort2.models import DigitCNN
from bort2.step2 import (
    BilevelLabelUpdater,
    HyperSettings,
    build_student,
    build_threshold,
    robust_loss,
    teacher_labels,
)

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=float, default=0.125)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--hyper-every", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    labeler = DigitCNN(10, args.width, {"p": 0.5, "alpha": 0.1}).eval()
    labeler.mixstyle = torch.nn.Identity()
    student = build_student(labeler, "bort2", 10).train()
    threshold = build_threshold("adaptive", 0.95, 0.999, 10)
    opt = torch.optim.SGD(student.parameters(), lr=0.005, momentum=0.9)
    updater = BilevelLabelUpdater(student, labeler, threshold, HyperSettings(outer_relu=False))
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 3, 32, 32)

    def inner_iter():
        x_weak, x_s = weak_view(images, gen), strong_view(images, gen)
        with torch.no_grad():
            labels, conf, pred = teacher_labels(labeler, x_weak, "argmax", 1.0, gen)
            mask = threshold(conf, pred)
        loss, _ = robust_loss(student, x_s, labels, mask.float(), eps=1e-7)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return x_s, x_weak, mask

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    for _ in range(3):  # warm-up (oneDNN primitive creation etc.)
        _, (xs, xw, m) = timed(inner_iter)
        updater(xs, xw, gen)
    t_inner, t_hyper = [], []
    for _ in range(args.reps):  # interleaved: the same load conditions for both
        dt, (xs, xw, m) = timed(inner_iter)
        t_inner.append(dt)
        dt, _ = timed(lambda xs=xs, xw=xw: updater(xs, xw, gen))
        t_hyper.append(dt)
    mi, mh = statistics.median(t_inner), statistics.median(t_hyper)
    k = args.hyper_every
    result = {
        "width": args.width,
        "batch": args.batch,
        "reps": args.reps,
        "hyper_every": k,
        "median_inner_iter_s": mi,
        "median_hyper_step_s": mh,
        "hyper_over_inner": mh / mi,
        "amortized_ratio": (k * mi + mh) / (k * mi),
        "machine": {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bort2_bilevel_cost.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
