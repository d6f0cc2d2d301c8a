"""``examples/meta_weight_net.py``: Meta-Weight-Net on noisy digits with
``hg.HyperStep(method=hg.Unrolled(optimizer, steps=1))``.

References: central finite differences of the one-step look-ahead written out in this file (a
detached copy of the classifier, one plain SGD step by hand, the meta-set loss), and the quick run
against its own plain cross-entropy baseline. The example is imported in-process
(tests/conftest.py puts ``examples/`` on the path); every output goes under ``tmp_path``.
"""

from __future__ import annotations

import copy
import json

import meta_weight_net as mwn
import pytest
import torch
import torch.nn.functional as F

F64 = torch.float64
LR = 0.1  # the example's classifier learning rate, used by the look-ahead


def _setup(kind: str, seed: int = 0, batch: int = 16):
    data = mwn.make_data(seed, dtype=F64)
    torch.manual_seed(seed)
    model = mwn.make_classifier(kind, dtype=F64)
    wnet = mwn.WeightNet(dtype=F64)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randperm(len(data["y_train"]), generator=g)[:batch]
    midx = torch.randperm(len(data["y_meta"]), generator=g)[:batch]
    train = (data["x_train"][idx], data["y_train"][idx])
    meta = (data["x_meta"][midx], data["y_meta"][midx])
    return model, wnet, train, meta


def _lookahead_meta_loss(model, wnet, train, meta, normalize: bool) -> float:
    """The meta loss after one plain SGD step of a detached copy of the classifier on the
    weighted training loss (no autograd graph kept; the weights are those of ``wnet``)."""
    m = copy.deepcopy(model)
    params = list(m.parameters())
    losses = F.cross_entropy(m(train[0]), train[1], reduction="none")
    w = wnet(losses.detach())
    loss = (w * losses).sum() / w.sum() if normalize else (w * losses).mean()
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= LR * g
        return float(F.cross_entropy(m(meta[0]), meta[1]))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("normalize", [True, False])
def test_hyperstep_matches_central_differences(kind, normalize, one_thread):
    model, wnet, train, meta = _setup(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = mwn.make_hyper_step(model, wnet, LR, normalize)
    hyper, info = step.compute(train, meta)
    assert info.outer_loss == pytest.approx(
        _lookahead_meta_loss(model, wnet, train, meta, normalize), rel=1e-12
    )
    for k, v in model.state_dict().items():  # parameters and BatchNorm statistics untouched
        assert torch.equal(v, before[k]), k
    g = torch.Generator().manual_seed(7)
    eps = 1e-5
    for _ in range(3):
        d = [torch.randn(p.shape, generator=g, dtype=F64) for p in wnet.parameters()]
        vals = []
        for sign in (1.0, -1.0):
            shifted = copy.deepcopy(wnet)
            with torch.no_grad():
                for p, di in zip(shifted.parameters(), d):
                    p += sign * eps * di
            vals.append(_lookahead_meta_loss(model, shifted, train, meta, normalize))
        fd = (vals[0] - vals[1]) / (2 * eps)
        analytic = sum(float((h * di).sum()) for h, di in zip(hyper, d))
        assert abs(fd) > 1e-6  # a real slope
        assert analytic == pytest.approx(fd, rel=1e-6)


# Quick run (--quick: 300 iterations, one seed, MLP, 40% uniform noise, 10 clean meta images per
# class). Measured with exactly these arguments, one thread, seeds 0 / 1 / 2:
#   test accuracy  Meta-Weight-Net 0.898 / 0.900 / 0.888, CE on the noisy labels 0.728 / 0.746 /
#   0.726 (margin 0.170 / 0.154 / 0.162);
#   mean weight (final nets) corrupted / clean 0.109 / 0.538, 0.094 / 0.442, 0.082 / 0.396.
# The asserted margin (0.08) is half the smallest measured one.
MARGIN = 0.08


def test_quick_run_downweights_corrupted_labels_and_beats_noisy_ce(tmp_path):
    res = mwn.main(
        ["--quick", "--no-progress", "--seed", "0", "--methods", "mwn", "ce_noisy",
         "--out", str(tmp_path)]
    )  # fmt: skip
    acc = res["test_acc"]
    assert acc["mwn"]["mean"] >= acc["ce_noisy"]["mean"] + MARGIN, acc
    w = res["weights"]["mwn"]
    assert w["mean_weight_corrupted"]["mean"] < 0.5 * w["mean_weight_clean"]["mean"], w
    assert w["late_mean_weight_corrupted"]["mean"] < 0.5 * w["late_mean_weight_clean"]["mean"]
    run = res["runs"][0]
    assert run["corrupted"] == round(0.4 * run["train"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["test_acc"]["mwn"]["mean"] == acc["mwn"]["mean"]
    assert (tmp_path / "meta_weight_net.png").is_file()


def test_noise_is_exact_and_labels_wrong():
    for kind in ("uniform", "pair"):
        data = mwn.make_data(1, noise=0.4, noise_type=kind)
        bad = data["corrupted"]
        assert int(bad.sum()) == round(0.4 * len(bad))
        assert torch.all(data["y_train"][bad] != data["y_train_clean"][bad])
        assert torch.equal(data["y_train"][~bad], data["y_train_clean"][~bad])
    pair = mwn.make_data(1, noise_type="pair")
    src, dst = pair["y_train_clean"][pair["corrupted"]], pair["y_train"][pair["corrupted"]]
    for c in range(10):  # pair noise: every class goes to one fixed other class
        assert len(set(dst[src == c].tolist())) == 1
