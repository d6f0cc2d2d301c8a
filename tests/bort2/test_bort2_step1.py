"""Tests of the BORT² step-1 methods (SourceOnly, FixMatch, FixMatch-CM, DANN, M3SDA) and
CutMix, each against a hand-written reference computation."""

import math

import numpy as np
import pytest
import torch
from bort2.models import DigitCNN, MixStyle
from bort2.step1 import (
    DANN,
    M3SDA,
    METHODS,
    FixMatch,
    FixMatchCM,
    SourceOnly,
    Step1Batch,
    cutmix,
    grad_reverse,
    grl_schedule,
)
from helpers import LinTanh
from torch import nn


class IdNet(nn.Module):
    """Logits equal the (N, 3, 1, 1) input: lets a test craft the logits directly."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)
        self.feature_dim = 3
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(3))
            self.head.bias.zero_()

    def features(self, x):
        return x.flatten(1)

    def forward(self, x):
        return self.head(self.features(x))


def _log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _np(t):
    return t.detach().numpy().astype(np.float64)


def _batch(n=6, m=4, k=3, shape=(3, 2, 2), num_domains=2):
    return Step1Batch(
        src_x=torch.randn(n, *shape),
        src_y=torch.randint(0, k, (n,)),
        src_d=torch.arange(n) % num_domains,
        tgt_weak=torch.randn(m, *shape),
        tgt_strong=torch.randn(m, *shape),
    )


def _assert_backprops(method, loss):
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in method.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


# ----------------------------------------------------------------------------- CutMix
def test_cutmix_box_area_equals_mixing_ratio_and_labels_mix():
    n, h, w = 5, 10, 12
    x = torch.arange(n * 2 * h * w, dtype=torch.float32).view(n, 2, h, w)
    y = torch.eye(4)[torch.tensor([0, 1, 2, 3, 1])]
    mask = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0])
    seen_partial = False
    for seed in range(30):
        res = cutmix(x, y, mask, torch.Generator().manual_seed(seed), alpha=1.0)
        y0, y1, x0, x1 = res.box
        area = (y1 - y0) * (x1 - x0)
        assert res.lam == 1.0 - area / (h * w)  # exact
        seen_partial |= 0 < area < h * w
        # every pixel of the box comes from the partner, every other from the image itself
        inside = torch.zeros(h, w, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        for i in range(n):
            j = int(res.perm[i])
            torch.testing.assert_close(res.x[i][:, inside], x[j][:, inside], rtol=0, atol=0)
            torch.testing.assert_close(res.x[i][:, ~inside], x[i][:, ~inside], rtol=0, atol=0)
            changed = int((res.x[i] != x[i]).any(dim=0).sum())
            assert changed == (area if j != i else 0)
            lam = res.lam
            torch.testing.assert_close(res.y[i], lam * y[i] + (1 - lam) * y[j])
            assert float(res.mask[i]) == pytest.approx(
                lam * float(mask[i]) + (1 - lam) * float(mask[j])
            )
        assert sorted(res.perm.tolist()) == list(range(n))
    assert seen_partial
    a = cutmix(x, y, mask, torch.Generator().manual_seed(7))
    b = cutmix(x, y, mask, torch.Generator().manual_seed(7))
    assert a.box == b.box and torch.equal(a.perm, b.perm)


# ----------------------------------------------------------------------------- SourceOnly
def test_source_only_matches_cross_entropy():
    model = LinTanh()
    method = SourceOnly(model, num_domains=2)
    batch = _batch()
    loss, logs = method.loss(batch)
    logits = _np(model(batch.src_x))
    ref = -np.mean(_log_softmax(logits)[np.arange(6), batch.src_y.numpy()])
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert logs["loss"] == pytest.approx(ref, rel=1e-5)
    _assert_backprops(method, loss)


# ----------------------------------------------------------------------------- FixMatch
def test_fixmatch_masking_matches_hand_computation():
    weak_logits = torch.tensor(
        [[5.0, 0.0, 0.0], [1.0, 0.5, 0.0], [0.0, 0.0, 8.0], [3.0, 3.1, -2.0]]
    )
    strong_logits = torch.tensor(
        [[0.5, 1.0, -1.0], [2.0, 0.0, 0.0], [1.0, 1.0, 1.5], [0.0, 0.0, 0.0]]
    )
    src_logits = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    batch = Step1Batch(
        src_x=src_logits.view(2, 3, 1, 1),
        src_y=torch.tensor([1, 0]),
        src_d=torch.tensor([0, 1]),
        tgt_weak=weak_logits.view(4, 3, 1, 1),
        tgt_strong=strong_logits.view(4, 3, 1, 1),
    )
    method = FixMatch(IdNet(), num_domains=2, threshold=0.95, lambda_u=0.7)
    loss, logs = method.loss(batch)

    # reference: softmax max-probs of the weak rows are 0.987, 0.506, 0.999, 0.521
    p = np.exp(_log_softmax(_np(weak_logits)))
    mask = (p.max(axis=1) >= 0.95).astype(np.float64)
    np.testing.assert_array_equal(mask, [1.0, 0.0, 1.0, 0.0])
    labels = p.argmax(axis=1)
    ce_strong = -_log_softmax(_np(strong_logits))[np.arange(4), labels]
    loss_u = (ce_strong * mask).sum() / 4  # averaged over all M
    loss_src = -np.mean(_log_softmax(_np(src_logits))[[0, 1], [1, 0]])
    assert logs["mask_rate"] == 0.5
    assert logs["loss_unsup"] == pytest.approx(loss_u, rel=1e-6)
    assert loss.item() == pytest.approx(loss_src + 0.7 * loss_u, rel=1e-6)
    _assert_backprops(method, loss)


def test_fixmatch_loss_on_random_batch_matches_reference():
    model = LinTanh()
    batch = _batch()
    method = FixMatch(model, num_domains=2, threshold=0.4)
    loss, logs = method.loss(batch)
    ls, lw, lst = _np(model(batch.src_x)), _np(model(batch.tgt_weak)), _np(model(batch.tgt_strong))
    p = np.exp(_log_softmax(lw))
    mask = p.max(1) >= 0.4
    lu = np.sum(-_log_softmax(lst)[np.arange(4), p.argmax(1)] * mask) / 4
    lsrc = -np.mean(_log_softmax(ls)[np.arange(6), batch.src_y.numpy()])
    assert loss.item() == pytest.approx(lsrc + lu, rel=1e-5)
    assert logs["mask_rate"] == pytest.approx(mask.mean())
    _assert_backprops(method, loss)


def test_fixmatch_cm_matches_hand_computation():
    torch.manual_seed(1)
    model = LinTanh(k=4)
    batch = _batch(n=4, m=4, k=4)
    # threshold halfway between two weak confidences: some targets masked, some not
    with torch.no_grad():
        conf = torch.sort(model(batch.tgt_weak).softmax(1).max(1).values).values
    thr = float(conf[1] + conf[2]) / 2
    method = FixMatchCM(
        model,
        2,
        threshold=thr,
        lambda_u=0.5,
        require_mixstyle=False,
        generator=torch.Generator().manual_seed(11),
        variant="mixed",
    )
    loss, logs = method.loss(batch)

    lw = _np(model(batch.tgt_weak))
    p = np.exp(_log_softmax(lw))
    mask = (p.max(1) >= thr).astype(np.float64)
    assert mask.sum() == 2
    labels = np.concatenate([batch.src_y.numpy(), p.argmax(1)])
    weights = np.concatenate([np.ones(4), mask])
    x = torch.cat([batch.src_x, batch.tgt_strong])
    # the same draws as the method: one cutmix call with an identically seeded generator
    ref_mix = cutmix(x, torch.zeros(8, 4), torch.zeros(8), torch.Generator().manual_seed(11))
    y0, y1, x0, x1 = ref_mix.box
    lam, perm = ref_mix.lam, ref_mix.perm.numpy()
    xm = x.clone()
    for i in range(8):
        xm[i, :, y0:y1, x0:x1] = x[perm[i], :, y0:y1, x0:x1]
    logp = _log_softmax(_np(model(xm)))
    ce = np.array(
        [
            -lam * weights[i] * logp[i, labels[i]]
            - (1 - lam) * weights[perm[i]] * logp[i, labels[perm[i]]]
            for i in range(8)
        ]
    )
    ref = ce[:4].mean() + 0.5 * ce[4:].mean()
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert logs["cutmix_lam"] == pytest.approx(lam)
    assert logs["mask_rate"] == 0.5
    _assert_backprops(method, loss)


def test_fixmatch_cm_requires_mixstyle_and_runs_with_digit_cnn():
    with pytest.raises(ValueError, match="MixStyle"):
        FixMatchCM(LinTanh(), 2)
    ms = MixStyle(p=1.0, mix="crossdomain", generator=torch.Generator().manual_seed(0))
    model = DigitCNN(num_classes=10, width=0.125, mixstyle=ms)
    method = FixMatchCM(model, 3, threshold=0.0, variant="mixed")
    batch = _batch(n=6, m=4, k=10, shape=(3, 32, 32), num_domains=3)
    method.train()
    loss, logs = method.loss(batch)
    assert 0.0 <= logs["cutmix_lam"] <= 1.0 and logs["mask_rate"] == 1.0
    _assert_backprops(method, loss)
    assert ms.domains is None  # cleared after each forward
    out = method.predict(batch.tgt_weak)
    assert out.shape == (4, 10) and method.model.training  # train mode restored


# ----------------------------------------------------------------------------- DANN
def test_grad_reverse_sign_and_scale():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3)
    y = grad_reverse(x, 0.37)
    torch.testing.assert_close(y, x)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, -0.37 * w)
    assert grl_schedule(0.0) == 0.0
    assert grl_schedule(0.5) == pytest.approx(2 / (1 + math.exp(-5)) - 1)


def test_dann_feature_gradient_is_reversed_and_scaled():
    torch.manual_seed(2)
    model = LinTanh()
    method = DANN(model, 2, lambda_d=1.0, hidden=8)
    method.set_progress(0.3)
    coef = 2 / (1 + math.exp(-3)) - 1
    assert method.grl_coef == pytest.approx(coef)
    h = torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    bce = nn.functional.binary_cross_entropy_with_logits
    bce(method.discriminator(grad_reverse(h, method.grl_coef)).squeeze(1), target).backward()
    g_rev = h.grad.clone()
    h.grad = None
    bce(method.discriminator(h).squeeze(1), target).backward()
    torch.testing.assert_close(g_rev, -coef * h.grad)


def test_dann_loss_matches_reference():
    torch.manual_seed(3)
    model = LinTanh()
    method = DANN(model, 2, lambda_d=0.8, hidden=16)
    method.set_progress(0.5)
    batch = _batch()
    loss, logs = method.loss(batch)
    h_src, h_tgt = model.features(batch.src_x), model.features(batch.tgt_weak)
    logits = _np(model.head(h_src))
    lcls = -np.mean(_log_softmax(logits)[np.arange(6), batch.src_y.numpy()])
    s = _np(method.discriminator(torch.cat([h_src, h_tgt]))).ravel()
    lbl = np.r_[np.ones(6), np.zeros(4)]
    # BCE with logits: -(y log sigmoid(s) + (1 - y) log(1 - sigmoid(s)))
    ldom = np.mean(-(lbl * -np.log1p(np.exp(-s)) + (1 - lbl) * -np.log1p(np.exp(s))))
    assert logs["loss_dom"] == pytest.approx(ldom, rel=1e-5)
    assert loss.item() == pytest.approx(lcls + 0.8 * ldom, rel=1e-5)
    assert logs["grl_coef"] == pytest.approx(2 / (1 + math.exp(-5)) - 1)
    _assert_backprops(method, loss)


# ----------------------------------------------------------------------------- M3SDA
def test_m3sda_loss_matches_reference():
    torch.manual_seed(4)
    model = LinTanh()
    method = M3SDA(model, num_domains=3, lambda_m=0.3)
    batch = _batch(n=7, m=4)
    batch.src_d = torch.tensor([0, 0, 1, 1, 1, 0, 0])  # domain 2 absent from this batch
    loss, logs = method.loss(batch)
    hs, ht = _np(model.features(batch.src_x)), _np(model.features(batch.tgt_weak))
    groups = [hs[batch.src_d.numpy() == 0], hs[batch.src_d.numpy() == 1], ht]
    md = 0.0
    for k in (1, 2):
        moms = [(g**k).mean(axis=0) for g in groups]
        dists = [
            np.sqrt(((moms[a] - moms[b]) ** 2).sum()) for a in range(3) for b in range(a + 1, 3)
        ]
        md += np.mean(dists)
    lcls = -np.mean(
        _log_softmax(_np(model.head(model.features(batch.src_x))))[
            np.arange(7), batch.src_y.numpy()
        ]
    )
    assert logs["loss_moment"] == pytest.approx(md, rel=1e-5)
    assert loss.item() == pytest.approx(lcls + 0.3 * md, rel=1e-5)
    _assert_backprops(method, loss)


# ----------------------------------------------------------------------------- registry
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_trains_a_step(name):
    ms = MixStyle(p=1.0, mix="crossdomain")
    model = DigitCNN(num_classes=10, width=0.125, mixstyle=ms)
    kwargs = {"threshold": 0.0} if name.startswith("fixmatch") else {}
    if name == "fixmatch_cm":
        kwargs["variant"] = "mixed"
    method = METHODS[name](model, 2, **kwargs)
    opt = torch.optim.SGD(method.parameters(), lr=0.01)
    batch = _batch(n=6, m=4, k=10, shape=(3, 32, 32))
    method.train()
    loss, logs = method.loss(batch)
    assert all(isinstance(v, float) and math.isfinite(v) for v in logs.values())
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert method.predict(batch.src_x).shape == (6, 10)
