"""Amortized cost of BORT2's bilevel label update against the robust (no-bilevel) step 2, side by
side on the same synthetic batches: one robust inner iteration (teacher labels, threshold,
student forward/backward/step) and one hyper step (``BilevelLabelUpdater`` with the authors'
defaults; the outer loss without its ReLU so the full hypergradient is computed). With one hyper
step every ``hyper_every`` iterations the ratio is ``(k t_inner + t_hyper) / (k t_inner)``.
"""

from __future__ import annotations

import torch

from benchmarks import kit

OPTIONS = dict(width=0.125, batch=128, reps=15, hyper_every=30)
QUICK = dict(reps=3)


def measure(o: dict, out, name: str) -> None:
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

    torch.manual_seed(0)
    labeler = DigitCNN(10, o["width"], {"p": 0.5, "alpha": 0.1}).eval()
    labeler.mixstyle = torch.nn.Identity()
    student = build_student(labeler, "bort2", 10).train()
    threshold = build_threshold("adaptive", 0.95, 0.999, 10)
    opt = torch.optim.SGD(student.parameters(), lr=0.005, momentum=0.9)
    updater = BilevelLabelUpdater(student, labeler, threshold, HyperSettings(outer_relu=False))
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
    t = kit.timeit({"inner": inner_iter, "hyper": lambda: updater(*views, gen)}, o["reps"], 3)
    mi, mh, k = (
        kit.median(t["inner"]["times_s"]),
        kit.median(t["hyper"]["times_s"]),
        o["hyper_every"],
    )
    kit.save(
        out / f"{name}.json",
        {
            **o,
            "median_inner_iter_s": mi,
            "median_hyper_step_s": mh,
            "hyper_over_inner": mh / mi,
            "amortized_ratio": (k * mi + mh) / (k * mi),
        },
    )
