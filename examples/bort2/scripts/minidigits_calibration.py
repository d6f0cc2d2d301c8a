"""MiniDigits calibration: per target domain, a 0.62M-parameter CNN trained *source-only* (the
other three domains' train splits) and *oracle* (the target's train split), the same number of
SGD steps, evaluated on the target's test split; also a sample grid (domains x digits).

Usage::

    python examples/bort2/scripts/minidigits_calibration.py   # 400 steps: results/minidigits_*
    python examples/bort2/scripts/minidigits_calibration.py --quick   # 20 steps, results/quick/
    python examples/bort2/scripts/minidigits_calibration.py --grid-only \\
        --grid docs/img/minidigits_grid.png                    # the sample grid only
    python examples/bort2/scripts/minidigits_calibration.py --report  # the table from the JSON
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _bench
import numpy as np
import torch
from torch import nn

NAME = "minidigits_calibration"


class SmallCNN(nn.Module):
    """conv3x3 32-64-128 (BN, ReLU, max-pool) + FC 256 + FC 10; about 0.62M parameters."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        blocks = []
        for cin, cout in ((3, 32), (32, 64), (64, 128)):
            blocks += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)]
            blocks += [nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(128 * 4 * 4, 256),
            nn.ReLU(inplace=True),
            nn.Dropout(0.3),
            nn.Linear(256, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _prep(x: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float, per-image standardised (removes global colour/brightness)."""
    x = x.float()
    std = x.std(dim=(1, 2, 3), keepdim=True).clamp_min(8.0)
    return (x - x.mean(dim=(1, 2, 3), keepdim=True)) / std


def train_eval(train_x, train_y, test_x, test_y, steps: int, batch: int, seed: int = 1) -> float:
    """Test accuracy (%) of a fresh SmallCNN after ``steps`` SGD steps (Nesterov, one-cycle LR
    0.05, weight decay 5e-4, random shifts of up to 2 px)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SmallCNN()
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps, pct_start=0.15)
    perm, pos = torch.randperm(len(train_x), generator=g), 0
    model.train()
    for _ in range(steps):
        if pos + batch > len(train_x):
            perm, pos = torch.randperm(len(train_x), generator=g), 0
        idx, pos = perm[pos : pos + batch], pos + batch
        dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
        xb = torch.roll(_prep(train_x[idx]), shifts=(dy, dx), dims=(2, 3))
        loss = nn.functional.cross_entropy(model(xb), train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        pred = torch.cat(
            [model(_prep(test_x[i : i + 500])).argmax(1) for i in range(0, len(test_x), 500)]
        )
    return 100.0 * float((pred == test_y).float().mean())


def save_grid(bench, domains, path: Path, seed: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(seed)
    fig, axes = plt.subplots(len(domains), 10, figsize=(10, 0.4 + len(domains)), squeeze=False)
    for r, domain in enumerate(domains):
        ds = bench.split(domain, "test")
        for c, ax in enumerate(axes[r]):
            idx = np.flatnonzero(ds.labels.numpy() == c)
            ax.imshow(ds.images[int(rng.choice(idx))].permute(1, 2, 0).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(str(c) if r == 0 else "")
        axes[r, 0].set_ylabel(domain, rotation=0, ha="right", va="center")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def measure(o: dict, out: Path) -> None:
    from bort2.data.minidigits import DOMAINS, load_minidigits

    bench = load_minidigits(None, seed=o["seed"], progress=False)
    save_grid(bench, DOMAINS, Path(o["grid"] or out / "minidigits_grid.png"), seed=o["seed"])
    if o["grid_only"]:
        return
    split = lambda d, s: (bench.split(d, s).images, bench.split(d, s).labels)  # noqa: E731
    rows = []
    for target in DOMAINS:
        sx, sy = (torch.cat(t) for t in zip(*[split(d, "train") for d in DOMAINS if d != target]))
        ex, ey = split(target, "test")
        src = train_eval(sx, sy, ex, ey, o["steps"], o["batch"])
        orc = train_eval(*split(target, "train"), ex, ey, o["steps"], o["batch"])
        rows.append({"target": target, "source_only": src, "oracle": orc, "n_test": len(ey)})
        _bench.log(f"{target}: source-only {src:.1f}%, oracle {orc:.1f}%")
    params = sum(p.numel() for p in SmallCNN().parameters())
    _bench.save(out, NAME, {"options": o, "params": params, "rows": rows})


def to_md(d: dict) -> str:
    rows = [
        [r["target"], f"{r['source_only']:.1f}", f"{r['oracle']:.1f}", r["n_test"]]
        for r in d["rows"]
    ]
    head = "target|source-only (other 3 domains)|oracle (target labels)|test images"
    return _bench.table(head.split("|"), rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, help="SGD steps per run (400; quick: 20)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="MiniDigits build and sample grid")
    p.add_argument(
        "--grid", default="", help="sample grid path (default: <out>/minidigits_grid.png)"
    )
    p.add_argument("--grid-only", action="store_true", help="only draw the sample grid")
    _bench.add_run_options(p)
    a = p.parse_args(argv)
    out = _bench.out_dir(a)
    if not a.report:
        _bench.set_threads(a.threads)
        o = dict(steps=a.steps or (20 if a.quick else 400), batch=a.batch, seed=a.seed, grid=a.grid)
        o.update(grid_only=a.grid_only, quick=a.quick, threads=a.threads)
        measure(o, out)
        if a.grid_only:
            return 0
    print(_bench.render(out, NAME, "minidigits_calibration.py", to_md))
    return 0


if __name__ == "__main__":  # bort2 is installed: pip install -e examples/bort2
    raise SystemExit(main())
