"""Calibrate MiniDigits: source-only vs target-oracle accuracy of a small CNN, per target domain.

For every target domain, a ~0.6M-parameter CNN (conv 32-64-128 + FC) is trained

- *source-only*: on the train splits of the other three domains, and
- *oracle*: on the target's own train split,

with the same number of SGD steps, and evaluated on the target's test split. The gap between
the two is the domain shift a multi-source DA method can close. CPU only.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/minidigits_calibration.py [--steps 400] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

from bort2.data.minidigits import DOMAINS, load_minidigits  # noqa: E402


class SmallCNN(nn.Module):
    """conv3x3 32-64-128 (BN, ReLU, max-pool) + FC 256 + FC 10; about 0.62M parameters."""

    def __init__(self, num_classes: int = 10):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(3, 32), block(32, 64), block(64, 128))
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
    """uint8 (N, 3, 32, 32) -> float, per-image standardised (removes global colour/brightness)."""
    x = x.float()
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    std = x.std(dim=(1, 2, 3), keepdim=True).clamp_min(8.0)
    return (x - mean) / std


def train_eval(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    steps: int,
    batch: int,
    seed: int,
) -> float:
    """Train a fresh :class:`SmallCNN` for ``steps`` SGD steps; return test accuracy (%)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SmallCNN()
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps, pct_start=0.15)
    n = len(train_x)
    model.train()
    perm = torch.randperm(n, generator=g)
    pos = 0
    for _ in range(steps):
        if pos + batch > n:
            perm, pos = torch.randperm(n, generator=g), 0
        idx = perm[pos : pos + batch]
        pos += batch
        xb = _prep(train_x[idx])
        # light augmentation: random shifts of up to 2 px
        dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
        xb = torch.roll(xb, shifts=(dy, dx), dims=(2, 3))
        loss = nn.functional.cross_entropy(model(xb), train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test_x), 500):
            pred = model(_prep(test_x[i : i + 500])).argmax(1)
            correct += int((pred == test_y[i : i + 500]).sum())
    return 100.0 * correct / len(test_x)


def save_grid(bench, path: str | Path, seed: int = 0) -> None:
    """Save a sample grid with matplotlib: rows = domains, columns = digits 0..9 (test split)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(seed)
    fig, axes = plt.subplots(len(DOMAINS), 10, figsize=(10, 0.4 + len(DOMAINS)), squeeze=False)
    for r, domain in enumerate(DOMAINS):
        ds = bench.split(domain, "test")
        for c in range(10):
            idx = np.flatnonzero(ds.labels.numpy() == c)
            ax = axes[r, c]
            ax.imshow(ds.images[int(rng.choice(idx))].permute(1, 2, 0).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(str(c))
            if c == 0:
                ax.set_ylabel(domain, rotation=0, ha="right", va="center")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="SGD steps per run (batch 64)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="MiniDigits generation seed")
    p.add_argument("--root", default=None, help="MiniDigits cache folder")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--grid", default=None, help="save a sample grid PNG here and exit")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    bench = load_minidigits(args.root, seed=args.seed, progress=True)
    t_load = time.perf_counter() - t0
    if args.grid:
        save_grid(bench, args.grid, seed=args.seed)
        print(f"saved {args.grid}")
        return

    def data(domain: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        ds = bench.split(domain, split)
        return ds.images, ds.labels

    rows = []
    for target in DOMAINS:
        sources = [d for d in DOMAINS if d != target]
        sx = torch.cat([data(d, "train")[0] for d in sources])
        sy = torch.cat([data(d, "train")[1] for d in sources])
        tx, ty = data(target, "train")
        ex, ey = data(target, "test")
        t1 = time.perf_counter()
        src = train_eval(sx, sy, ex, ey, args.steps, args.batch, seed=1)
        t2 = time.perf_counter()
        orc = train_eval(tx, ty, ex, ey, args.steps, args.batch, seed=1)
        t3 = time.perf_counter()
        rows.append(
            {
                "target": target,
                "source_only": src,
                "oracle": orc,
                "n_test": len(ey),
                "seconds": [t2 - t1, t3 - t2],
            }
        )
        print(
            f"{target:6s} source-only {src:5.1f}%  oracle {orc:5.1f}%  "
            f"({t2 - t1:.0f}s + {t3 - t2:.0f}s)",
            flush=True,
        )

    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, {args.threads} threads"
    )
    print(
        f"\nMiniDigits calibration (seed {args.seed}, {args.steps} steps x batch {args.batch}, "
        f"SmallCNN {sum(p.numel() for p in SmallCNN().parameters()) / 1e6:.2f}M params)"
    )
    print(f"machine: {machine}; dataset load/build {t_load:.1f}s\n")
    print("| target | source-only (3 other domains) | oracle (target labels) | test images |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['source_only']:.1f} | {r['oracle']:.1f} | {r['n_test']} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
