"""Amortized cost of BORT2's bilevel label update against the robust (no-bilevel) step 2, side by
side on the same synthetic batches: one robust inner iteration (teacher labels, threshold,
student forward/backward/step) and one hyper step (``BilevelLabelUpdater`` with the authors'
defaults; the outer loss without its ReLU so the full hypergradient is computed). With one hyper
step every ``hyper_every`` iterations the ratio is ``(k t_inner + t_hyper) / (k t_inner)``.

Usage::

    python examples/bort2/scripts/bilevel_cost.py            # results/bilevel_cost.{json,md}
    python examples/bort2/scripts/bilevel_cost.py --quick    # 3 repetitions, into results/quick/
    python examples/bort2/scripts/bilevel_cost.py --report   # the table from the JSON only
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _bench
import torch

NAME = "bilevel_cost"


def measure(o: dict, out: Path) -> None:
    from bort2.config import HyperConfig, Step2Config
    from bort2.data.transforms import strong_view, weak_view
    from bort2.models import DigitCNN
    from bort2.stages_index import SPECS, STAGE_C
    from bort2.step2 import (
        BilevelLabelUpdater,
        build_student,
        build_threshold,
        robust_loss,
        teacher_labels,
    )

    torch.manual_seed(0)
    labeler = DigitCNN(10, o["width"], {"p": 0.5, "alpha": 0.1}).eval()
    labeler.mixstyle = torch.nn.Identity()
    student = build_student(labeler, SPECS[STAGE_C].plain_student, 10).train()
    threshold = build_threshold("adaptive", 0.95, 0.999, 10)
    opt = torch.optim.SGD(student.parameters(), lr=0.005, momentum=0.9)
    updater = BilevelLabelUpdater(
        student, labeler, threshold, Step2Config(hyper=HyperConfig(outer_relu=False))
    )
    gen, images, views = torch.Generator().manual_seed(0), torch.rand(o["batch"], 3, 32, 32), []

    def inner_iter():
        x_weak, x_strong = weak_view(images, gen), strong_view(images, gen)
        with torch.no_grad():
            labels, conf, pred = teacher_labels(labeler, x_weak, "argmax", 1.0, gen)
            mask = threshold(conf, pred)
        loss, _ = robust_loss(student, x_strong, labels, mask.float(), eps=1e-7)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        views[:] = [x_strong, x_weak]

    inner_iter()  # the hyper step uses the last inner iteration's views (timing alternates order)
    t = _bench.timeit({"inner": inner_iter, "hyper": lambda: updater(*views, gen)}, o["reps"], 3)
    mi, mh, k = t["inner"], t["hyper"], o["hyper_every"]
    res = dict(median_inner_iter_s=mi, median_hyper_step_s=mh, hyper_over_inner=mh / mi)
    _bench.save(out, NAME, {**o, **res, "amortized_ratio": (k * mi + mh) / (k * mi)})


def to_md(d: dict) -> str:
    head = ["inner iteration", "hyper step", "hyper / inner", f"amortized over {d['hyper_every']}"]
    t = [f"{d['median_inner_iter_s']:.3f} s", f"{d['median_hyper_step_s']:.3f} s"]
    row = [*t, f"{d['hyper_over_inner']:.1f}×", f"**{d['amortized_ratio']:.2f}×**"]
    return _bench.table(head, [row], "rrrr")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=float, default=0.125, help="DigitCNN width")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--reps", type=int, help="timed repetitions after 3 warm-ups (15; quick: 3)")
    p.add_argument("--hyper-every", type=int, default=30, help="inner iterations per hyper step")
    _bench.add_run_options(p)
    a = p.parse_args(argv)
    out = _bench.out_dir(a)
    if not a.report:
        _bench.set_threads(a.threads)
        o = dict(width=a.width, batch=a.batch, reps=a.reps or (3 if a.quick else 15))
        o.update(hyper_every=a.hyper_every, quick=a.quick, threads=a.threads)
        measure(o, out)
    print(_bench.render(out, NAME, "bilevel_cost.py", to_md))
    return 0


if __name__ == "__main__":  # bort2 is installed: pip install -e examples/bort2
    raise SystemExit(main())
