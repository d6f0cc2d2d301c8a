"""Meta-Weight-Net on noisy digits: a learned loss -> weight mapping trained by look-ahead
hypergradients (``hg.HyperStep(method=hg.Unrolled(optimizer=..., steps=1))``).

Run: ``python examples/meta_weight_net.py`` (about a minute of CPU time on one thread: 5 seeds x
6 methods; ``--quick`` for a smoke run of a few seconds). Writes ``results.json`` and
``meta_weight_net.png`` under ``--out`` (default ``runs/meta_weight_net``), nothing else.

Method (Shu, Xie, Yi, Zhao, Zhou, Xu & Meng, "Meta-Weight-Net: Learning an Explicit Mapping For
Sample Weighting", NeurIPS 2019). A weighting net ``V(l; Theta)``, an MLP 1-100-1 with a ReLU and
a sigmoid output, maps an example's training loss ``l_i`` to a weight in (0, 1). Each iteration
of the paper's Algorithm 1, on a training batch and a batch of a small clean meta set:

1. look-ahead: ``w_hat(Theta) = w - alpha * grad_w L_train(w; Theta)``, one plain SGD step at the
   classifier's current learning rate ``alpha`` on the weighted training loss;
2. meta step: ``Theta <- Adam(grad_Theta CE_meta(w_hat(Theta)))``; steps 1-2 are one call of
   ``hg.HyperStep(model, wnet, inner_loss, outer_loss,
   method=hg.Unrolled(optimizer=hg.optim.sgd(lr=alpha), steps=1))`` followed by the Adam step;
3. classifier step: SGD with momentum on ``L_train(w; Theta_new)``, the weights computed by the
   updated net and treated as constants.

Two forms of the weighted loss, both in the authors' repository (github.com/xjtushujun/
meta-weight-net): ``mwn`` normalises the weights by their batch sum,
``L_train = sum_i V_i l_i / sum_i V_i`` (``train_WRN-28-10_Meta_PGC.py``: ``v_lambda / norm_c``);
``mwn_mean`` uses the plain mean ``(1/n) sum_i V_i l_i`` (``MW-Net.py``, the paper's equation). In
both the weighting net's input is the *detached* loss value, as in the authors' code
(``vnet(cost_v.data)``). With one look-ahead step that detach changes nothing (the input is the loss
at ``w``, independent of ``Theta``); with more steps it would hide a path
(``tests/hypergrad/test_hyperstep_unrolled.py`` shows the difference). The reference
implementation's optimiser settings are used: SGD (lr 0.1, momentum 0.9, weight decay 5e-4) for the
classifier, Adam (lr 1e-3, weight decay 1e-4) for the weighting net, batches of 100, the look-ahead
without momentum or weight decay; the learning rate drops x0.1 after 2/3 and 5/6 of the iterations.

Data: scikit-learn's UCI digits (``load_digits``, 1797 8x8 images, shipped with the package).
Seeded split: a test set of 500 images (stratified), a clean meta set of ``--meta-per-class``
images per class (10: 100 images), the rest (1197) for training. ``--noise`` (default 0.4) of the
training labels are corrupted: ``uniform`` flips each chosen label to one of the 9 other classes at
random; ``pair`` flips class ``c`` to a fixed other class ``pi(c)`` drawn from the seed (the
"flip" noise of the reference code). Exactly ``round(noise * n)`` examples are corrupted, so the
corrupted set is known. (The reference code's ``unif`` noise may redraw the true class; here
every corrupted label is wrong.)

Classifier (``--model``): ``mlp`` (default; 64-256-BatchNorm-ReLU-10) or ``cnn`` (conv 3x3 32 -
BatchNorm - ReLU - conv 3x3 stride 2 64 - BatchNorm - ReLU - linear; about 10x slower). BatchNorm
runs in train mode inside the look-ahead; ``HyperStep`` keeps the look-ahead from touching the
running statistics (``buffers="freeze"``), as the reference code does by building a copy of the
model.

Baselines on the same splits, with the same classifier, optimiser, schedule and number of
iterations: ``ce_noisy`` (cross-entropy on the noisy training set), ``ce_meta`` (cross-entropy on
the clean meta set only), ``ce_noisy+meta`` (both), and the ``oracle`` (cross-entropy on the
uncorrupted training examples only, which needs to know which they are). Reported, as mean and
95% interval over ``--seeds`` seeds (each seed draws its own split, noise and initialisation):
the test accuracy at the end of training (no early stopping on the test set), the paired
difference to Meta-Weight-Net, and the mean weight ``V`` the final nets give corrupted vs clean
training examples (losses of the final classifier in eval mode) and the mean weight used in the
last 20% of the iterations (raw ``V``, before the normalisation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from _cli import torch_threads
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import hypergrad as hg

CLASSES = 10
TEST_SIZE = 500
METHODS = ("mwn", "mwn_mean", "ce_noisy", "ce_meta", "ce_noisy+meta", "oracle")
MWN_METHODS = ("mwn", "mwn_mean")
LABELS = {
    "mwn": "Meta-Weight-Net",
    "mwn_mean": "Meta-Weight-Net, unnormalised",
    "ce_noisy": "CE, noisy train",
    "ce_meta": "CE, clean meta set only",
    "ce_noisy+meta": "CE, noisy train + meta",
    "oracle": "CE, clean part of train (oracle)",
}


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


def corrupt_labels(
    y: np.ndarray, noise: float, kind: str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupt exactly ``round(noise * len(y))`` labels, chosen at random: ``uniform`` flips each
    to one of the other classes at random, ``pair`` flips class ``c`` to a fixed other class
    ``pi(c)`` drawn once from ``rng``. Returns the noisy labels and the corrupted mask."""
    n = len(y)
    bad = np.zeros(n, dtype=bool)
    bad[rng.choice(n, size=int(round(noise * n)), replace=False)] = True
    noisy = y.copy()
    if kind == "uniform":
        shift = rng.integers(1, CLASSES, size=n)  # 1..9: never the true class
        noisy[bad] = (y[bad] + shift[bad]) % CLASSES
    elif kind == "pair":
        target = np.array([rng.choice([k for k in range(CLASSES) if k != c]) for c in range(10)])
        noisy[bad] = target[y[bad]]
    else:
        raise ValueError(f"noise type must be 'uniform' or 'pair', got {kind!r}")
    return noisy, bad


def make_data(
    seed: int,
    noise: float = 0.4,
    noise_type: str = "uniform",
    meta_per_class: int = 10,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Seeded split of ``load_digits`` into train (noisy labels) / clean meta / test.

    Pixels (0..16) are divided by 16 and centred by the training mean. Returns tensors ``x_*``
    of shape ``(n, 64)`` and ``y_*``; ``y_train_clean`` and ``corrupted`` describe the noise."""
    d = load_digits()
    x, y = d.data.astype(np.float64) / 16.0, d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    idx = np.arange(len(y))
    rest, test = train_test_split(idx, test_size=TEST_SIZE, stratify=y, random_state=seed)
    meta = np.concatenate(
        [rng.choice(rest[y[rest] == c], size=meta_per_class, replace=False) for c in range(10)]
    )
    train = np.setdiff1d(rest, meta)
    train = train[rng.permutation(len(train))]
    noisy, bad = corrupt_labels(y[train], noise, noise_type, rng)
    mean = x[train].mean(0)

    def t(a):
        return torch.tensor(a - mean, dtype=dtype)

    return {
        "x_train": t(x[train]),
        "y_train": torch.tensor(noisy),
        "y_train_clean": torch.tensor(y[train]),
        "corrupted": torch.tensor(bad),
        "x_meta": t(x[meta]),
        "y_meta": torch.tensor(y[meta]),
        "x_test": t(x[test]),
        "y_test": torch.tensor(y[test]),
    }


# ----------------------------------------------------------------------------------------------
# networks
# ----------------------------------------------------------------------------------------------


def make_classifier(kind: str = "cnn", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A small classifier of 64-pixel inputs with BatchNorm (``cnn`` or ``mlp``)."""
    if kind == "cnn":
        net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),  # 8x8 -> 4x4
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * 16, CLASSES),
        )
    elif kind == "mlp":
        net = nn.Sequential(
            nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, CLASSES)
        )
    else:
        raise ValueError(f"model must be 'cnn' or 'mlp', got {kind!r}")
    return net.to(dtype)


class WeightNet(nn.Module):
    """Meta-Weight-Net's weighting function: loss -> weight in (0, 1), an MLP 1-100-1."""

    def __init__(self, hidden: int = 100, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, 1)).to(dtype)

    def forward(self, losses: torch.Tensor) -> torch.Tensor:
        """Weights of shape ``(n,)`` for per-example losses of shape ``(n,)``."""
        return torch.sigmoid(self.net(losses.unsqueeze(1))).squeeze(1)


def combine(weights: torch.Tensor, losses: torch.Tensor, normalize: bool) -> torch.Tensor:
    """``(1/n) sum_i w_i l_i``, or ``sum_i w_i l_i / sum_i w_i`` with ``normalize``."""
    if normalize:
        return (weights * losses).sum() / weights.sum()
    return (weights * losses).mean()


def weighted_loss(
    model: nn.Module, wnet: WeightNet, x: torch.Tensor, y: torch.Tensor, normalize: bool = False
) -> torch.Tensor:
    """``(1/n) sum_i V(l_i; Theta) l_i`` with the weighting net fed the detached losses (as the
    authors' code: ``vnet(cost_v.data)``); ``normalize``: divided by the sum of the weights."""
    losses = F.cross_entropy(model(x), y, reduction="none")
    return combine(wnet(losses.detach()), losses, normalize)


def make_hyper_step(
    model: nn.Module, wnet: WeightNet, lr: float, normalize: bool = False
) -> hg.HyperStep:
    """The look-ahead hypergradient of steps 1-2: one plain SGD step of the classifier on the
    weighted training loss, then the meta-set cross-entropy, differentiated w.r.t. ``wnet``."""
    return hg.HyperStep(
        model,
        wnet,
        lambda m, batch: weighted_loss(m, wnet, *batch, normalize),
        lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        method=hg.Unrolled(optimizer=hg.optim.sgd(lr=lr), steps=1),
    )


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------


def lr_at(it: int, iters: int, lr: float) -> float:
    """Step schedule: ``lr``, then x0.1 after 2/3 and again after 5/6 of the iterations (the
    reference code's epochs 80 and 100 of 120)."""
    return lr * 0.1 ** ((it >= 2 * iters // 3) + (it >= 5 * iters // 6))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return acc


def progress(total: int, desc: str, enabled: bool):
    """A tqdm bar when enabled and tqdm is installed, else nothing."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, leave=False, mininterval=1.0)
        except ImportError:
            pass
    return None


def train(method: str, data: dict, args: argparse.Namespace, seed: int) -> dict:
    """Train one classifier (``method`` in :data:`METHODS`) and return its test accuracy and,
    for ``mwn``, the weighting net and the weights it assigned."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model = make_classifier(args.model)
    wnet = WeightNet() if method in MWN_METHODS else None
    normalize = method == "mwn"
    x, y = data["x_train"], data["y_train"]
    bad = data["corrupted"]
    if method == "ce_meta":
        x, y, bad = data["x_meta"], data["y_meta"], torch.zeros(len(data["y_meta"]), dtype=bool)
    elif method == "ce_noisy+meta":
        x, y = torch.cat([x, data["x_meta"]]), torch.cat([y, data["y_meta"]])
        bad = torch.cat([bad, torch.zeros(len(data["y_meta"]), dtype=bool)])
    elif method == "oracle":
        x, y, bad = x[~bad], y[~bad], bad[~bad]
    n, bs = len(y), min(args.batch, len(y))
    opt = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    if wnet is not None:
        wopt = torch.optim.Adam(wnet.parameters(), lr=args.meta_lr, weight_decay=1e-4)
    xm, ym = data["x_meta"], data["y_meta"]
    hist: dict[str, list] = {"it": [], "test_acc": [], "meta_loss": [], "w_bad": [], "w_clean": []}
    late = {"bad": [], "clean": []}  # weights used in the last 20% of the iterations
    perm, pos = torch.randperm(n, generator=gen), 0
    step, step_lr = None, None
    bar = progress(args.iters, method, args.progress)
    model.train()
    for it in range(args.iters):
        lr = lr_at(it, args.iters, args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        if pos + bs > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos : pos + bs]
        pos += bs
        xb, yb = x[idx], y[idx]
        if wnet is not None:
            if step is None or step_lr != lr:  # the look-ahead uses the current lr
                step, step_lr = make_hyper_step(model, wnet, lr, normalize), lr
            if len(ym) > args.meta_batch:
                midx = torch.randperm(len(ym), generator=gen)[: args.meta_batch]
                meta_batch = (xm[midx], ym[midx])
            else:
                meta_batch = (xm, ym)
            info = step((xb, yb), meta_batch)  # writes d CE_meta(w_hat) / d Theta to .grad
            wopt.step()
            losses = F.cross_entropy(model(xb), yb, reduction="none")
            with torch.no_grad():
                w = wnet(losses.detach())
            loss = combine(w, losses, normalize)
            if it >= args.iters - args.iters // 5:
                late["bad"].append(w[bad[idx]])
                late["clean"].append(w[~bad[idx]])
        else:
            loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1)
        if (it + 1) % args.eval_every == 0 or it + 1 == args.iters:
            hist["it"].append(it + 1)
            hist["test_acc"].append(accuracy(model, data["x_test"], data["y_test"]))
            if wnet is not None:
                hist["meta_loss"].append(info.outer_loss)
                wb, wc = final_weights(model, wnet, data)
                hist["w_bad"].append(float(wb.mean()))
                hist["w_clean"].append(float(wc.mean()))
    if bar is not None:
        bar.close()
    out = {
        "test_acc": accuracy(model, data["x_test"], data["y_test"]),
        "history": hist,
    }
    if wnet is not None:
        wb, wc = final_weights(model, wnet, data)
        out.update(
            wnet=wnet,
            model=model,
            weights_corrupted=wb,
            weights_clean=wc,
            mean_weight_corrupted=float(wb.mean()),
            mean_weight_clean=float(wc.mean()),
            late_mean_weight_corrupted=float(torch.cat(late["bad"]).mean()),
            late_mean_weight_clean=float(torch.cat(late["clean"]).mean()),
        )
    return out


@torch.no_grad()
def final_weights(model: nn.Module, wnet: WeightNet, data: dict):
    """Weights the net gives every training example at the current classifier (eval mode):
    ``(weights of corrupted examples, weights of clean examples)``."""
    model.eval()
    losses = F.cross_entropy(model(data["x_train"]), data["y_train"], reduction="none")
    model.train()
    w = wnet(losses)
    bad = data["corrupted"]
    return w[bad], w[~bad]


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict:
    """Mean and a 95% interval (Student t for the number of seeds; 0 width for one seed)."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return {"mean": mean, "half_width": 0.0, "values": v.tolist()}
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return {"mean": mean, "half_width": half, "values": v.tolist()}


def plot(path: str, runs: list[dict]) -> bool:
    """Weight vs loss of the learned nets, the weight histogram (clean vs corrupted, first seed)
    and the test accuracy during training."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ls = torch.linspace(0, 8, 200)
    for j, meth in enumerate(x for x in MWN_METHODS if x in runs[0]):
        for k, r in enumerate(runs):
            with torch.no_grad():
                w = r[meth]["wnet"](ls)
            label = f"{LABELS[meth]}, seed {r['seed']}" if k == 0 else None
            axes[0].plot(ls, w, color=f"C{j}", ls="-" if j == 0 else "--",
                         alpha=1.0 if k == 0 else 0.4, label=label)  # fmt: skip
    axes[0].set_xlabel("training loss (cross-entropy)")
    axes[0].set_ylabel("weight V(loss)")
    axes[0].set_title("learned weighting functions (all seeds)")
    axes[0].legend(fontsize=8)
    m = runs[0]["mwn"]
    bins = np.linspace(0, 1, 41)
    axes[1].hist(m["weights_clean"].numpy(), bins=bins, alpha=0.6, label="clean labels")
    axes[1].hist(m["weights_corrupted"].numpy(), bins=bins, alpha=0.6, label="corrupted labels")
    axes[1].set_xlabel("weight of a training example (final nets)")
    axes[1].set_ylabel("examples")
    axes[1].set_title(f"{LABELS['mwn']}, seed {runs[0]['seed']}: weights of training examples")
    axes[1].legend(fontsize=8)
    for j, meth in enumerate(x for x in METHODS if x in runs[0]):
        h = runs[0][meth]["history"]
        axes[2].plot(h["it"], h["test_acc"], color=f"C{j}", label=LABELS[meth])
    axes[2].set_xlabel("iteration")
    axes[2].set_ylabel("test accuracy")
    axes[2].set_title(f"seed {runs[0]['seed']}: test accuracy during training")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (seconds), for tests")
    ap.add_argument("--seed", type=int, default=0, help="first seed (split, noise, init)")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default 5; quick 1)")
    ap.add_argument("--out", default="runs/meta_weight_net", help="folder for results and plot")
    ap.add_argument("--iters", type=int, default=None, help="iterations (default 1000; quick 300)")
    ap.add_argument("--noise", type=float, default=0.4, help="fraction of corrupted labels")
    ap.add_argument("--noise-type", choices=("uniform", "pair"), default="uniform")
    ap.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    ap.add_argument("--meta-per-class", type=int, default=10, help="clean meta images per class")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--meta-batch", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1, help="classifier SGD learning rate")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--meta-lr", type=float, default=1e-3, help="Adam on the weighting net")
    ap.add_argument("--eval-every", type=int, default=None, help="test accuracy every N iters")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    if args.iters is None:
        args.iters = 300 if args.quick else 1000
    if args.seeds is None:
        args.seeds = 1 if args.quick else 5
    if args.eval_every is None:
        args.eval_every = max(1, args.iters // 20)
    if "mwn" not in args.methods:
        args.methods = ["mwn"] + args.methods
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _main(args)


def _main(args: argparse.Namespace) -> dict:
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    runs = []
    wall = {m: 0.0 for m in args.methods}
    cpu = {m: 0.0 for m in args.methods}
    for s in range(args.seed, args.seed + args.seeds):
        data = make_data(s, args.noise, args.noise_type, args.meta_per_class)
        run = {"seed": s, "corrupted": int(data["corrupted"].sum()), "train": len(data["y_train"])}
        for meth in args.methods:
            t, c = time.time(), time.process_time()
            run[meth] = train(meth, data, args, s)
            wall[meth] += time.time() - t
            cpu[meth] += time.process_time() - c
            if args.progress:
                print(f"seed {s} {LABELS[meth]:<34} test acc {run[meth]['test_acc']:.4f}")
        runs.append(run)
    n = len(runs)
    res: dict = {
        "args": vars(args),
        "sizes": {
            "train": runs[0]["train"],
            "corrupted": runs[0]["corrupted"],
            "meta": CLASSES * args.meta_per_class,
            "test": TEST_SIZE,
        },
        "test_acc": {m: summary([r[m]["test_acc"] for r in runs]) for m in args.methods},
        "wall_seconds_per_run": {m: wall[m] / n for m in args.methods},
        "cpu_seconds_per_run": {m: cpu[m] / n for m in args.methods},
        "weights": {},
        "mwn_minus": {},
    }
    for m in MWN_METHODS:
        if m in args.methods:
            res["weights"][m] = {k: summary([r[m][k] for r in runs]) for k in WEIGHT_KEYS}
    for m in args.methods:
        if m != "mwn":
            res["mwn_minus"][m] = summary([r["mwn"]["test_acc"] - r[m]["test_acc"] for r in runs])
    res["history"] = {str(r["seed"]): {m: r[m]["history"] for m in args.methods} for r in runs}
    print_table(res, args, n)
    png = os.path.join(args.out, "meta_weight_net.png")
    res["plot"] = png if plot(png, runs) else None
    res["seconds"] = time.time() - t_start
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}/results.json{' and ' + png if res['plot'] else ''}")
    print(f"total {res['seconds']:.1f} s wall")
    res["runs"] = runs
    return res


WEIGHT_KEYS = (
    "mean_weight_corrupted",
    "mean_weight_clean",
    "late_mean_weight_corrupted",
    "late_mean_weight_clean",
)


def print_table(res: dict, args: argparse.Namespace, n: int) -> None:
    sz = res["sizes"]
    print(
        f"\nnoisy digits: {sz['train']} training images, {sz['corrupted']} labels corrupted "
        f"({args.noise_type}), {sz['meta']} clean meta images, {sz['test']} test images; "
        f"{args.model}, {args.iters} iterations of batch {args.batch}; {n} seed(s)"
    )
    ci = "mean ± 95% CI" if n > 1 else "one seed"
    print(
        f"{'method':<36}{'test accuracy':>15}{'(' + ci + ')':>17}{'MWN - method':>20}"
        f"{'CPU s/run':>11}"
    )
    for m in args.methods:
        a = res["test_acc"][m]
        d = res["mwn_minus"].get(m)
        one = n < 2  # a single seed has no interval to print
        diff = "" if d is None else f"{d['mean']:+.4f}"
        diff += "" if one or d is None else f" ± {d['half_width']:.4f}"
        spread = "" if one else " ± " + format(a["half_width"], ".4f")
        print(
            f"{LABELS[m]:<36}{a['mean']:>15.4f}{spread:>17}"
            f"{diff:>20}{res['cpu_seconds_per_run'][m]:>11.1f}"
        )
    print("(MWN - method: paired difference of test accuracy on the same split and noise)")
    for m, w in res["weights"].items():
        print(
            f"{LABELS[m]}: mean weight of corrupted / clean training examples: final nets "
            f"{w['mean_weight_corrupted']['mean']:.3f} / {w['mean_weight_clean']['mean']:.3f}; "
            f"used in the last 20% of training {w['late_mean_weight_corrupted']['mean']:.3f} / "
            f"{w['late_mean_weight_clean']['mean']:.3f}"
        )


if __name__ == "__main__":
    main()
