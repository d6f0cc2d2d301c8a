"""Tests of the BORT² authors' step-1 recipe: the official weak/strong views, MixStyle
switching, and FixMatch-CM's official loss, each against an independent computation in float64
(numpy for the arithmetic, replayed generators for the random draws)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bort2.data.transforms import (
    FIXMATCH_OPS,
    apply_fixmatch_op,
    cutout_fixed,
    strong,
    strong_view,
    weak,
    weak_view,
)
from bort2.models import DigitCNN
from bort2.models.mixstyle import MixStyle, mixstyle_disabled, sample_beta
from bort2.step1 import FixMatch, FixMatchCM, Step1Batch, cutmix
from torch import nn


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def _log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- views: styles
@pytest.mark.parametrize("photo", [False, True])
def test_legacy_style_is_weak_and_strong_bit_for_bit(photo):
    x = torch.rand(8, 3, 16, 16, generator=_gen(100))
    for seed in range(3):
        assert torch.equal(weak_view(x, _gen(seed), "legacy", photo), weak(x, _gen(seed)))
        assert torch.equal(strong_view(x, _gen(seed), "legacy", photo), strong(x, _gen(seed)))
    # and it really is random: another seed gives another view
    assert not torch.equal(strong_view(x, _gen(0), "legacy"), strong_view(x, _gen(1), "legacy"))


def test_official_weak_view_digits_is_identity_and_draws_nothing():
    x = torch.rand(5, 3, 16, 16, dtype=torch.float64)
    g = _gen(3)
    state = g.get_state()
    out = weak_view(x, g)  # style="official", photo=False are the defaults
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    assert torch.equal(g.get_state(), state)


def test_official_weak_view_photo_is_flip_and_translation():
    x = torch.rand(8, 3, 16, 16)
    assert torch.equal(weak_view(x, _gen(4), photo=True), weak(x, _gen(4), hflip=True))


def test_bad_style_lists_the_valid_styles():
    x = torch.rand(2, 3, 8, 8)
    for fn in (weak_view, strong_view):
        with pytest.raises(ValueError, match=r"'official', 'legacy'"):
            fn(x, style="fixmatch")


# ----------------------------------------------------------------------------- official ops
def test_enhance_factors_span_005_to_095():
    x = torch.rand(4, 3, 6, 6, dtype=torch.float64)
    u = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    factors = np.array([0.05, 0.275, 0.5, 0.95])
    xn = _np(x)
    out = _np(apply_fixmatch_op(x, "brightness", u))
    np.testing.assert_allclose(out, xn * factors[:, None, None, None], rtol=0, atol=1e-12)
    # color: blend with the ITU-R 601-2 grayscale image (PIL ImageEnhance.Color)
    gray = (0.299 * xn[:, 0] + 0.587 * xn[:, 1] + 0.114 * xn[:, 2])[:, None]
    ref = np.clip(gray + factors[:, None, None, None] * (xn - gray), 0, 1)
    np.testing.assert_allclose(_np(apply_fixmatch_op(x, "color", u)), ref, atol=1e-12)
    # contrast: blend with the mean gray level
    mean = gray.mean(axis=(1, 2, 3), keepdims=True)
    ref = np.clip(mean + factors[:, None, None, None] * (xn - mean), 0, 1)
    np.testing.assert_allclose(_np(apply_fixmatch_op(x, "contrast", u)), ref, atol=1e-12)
    # the factor never leaves [0.05, 0.95]: brightness of a white image is the factor itself
    u = torch.rand(1000, dtype=torch.float64)
    f = apply_fixmatch_op(torch.ones(1000, 3, 1, 1, dtype=torch.float64), "brightness", u)
    assert f.min() >= 0.05 and f.max() <= 0.95 and f.max() - f.min() > 0.85


def test_posterize_solarize_and_translate_match_pil_semantics():
    x = torch.rand(3, 3, 10, 10, dtype=torch.float64)
    xn = _np(x)
    levels = np.round(xn * 255)
    u = torch.tensor([0.0, 0.5, 0.99], dtype=torch.float64)  # 4, 6 and 8 bits kept
    step = np.array([16.0, 4.0, 1.0])[:, None, None, None]  # 2 ** (8 - bits)
    ref = np.floor(levels / step) * step / 255
    np.testing.assert_allclose(_np(apply_fixmatch_op(x, "posterize", u)), ref, atol=1e-12)
    u = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)  # solarize threshold
    ref = np.where(xn >= np.array([0.0, 0.3, 1.0])[:, None, None, None], 1 - xn, xn)
    np.testing.assert_allclose(_np(apply_fixmatch_op(x, "solarize", u)), ref, atol=1e-12)
    # u = 1: shift by 30% of the 10-px width = 3 px (content moves left, gray comes in)
    out = _np(apply_fixmatch_op(x, "translate_x", torch.ones(3, dtype=torch.float64)))
    np.testing.assert_allclose(out[..., :7], xn[..., 3:], atol=1e-9)
    np.testing.assert_allclose(out[..., 7:], 0.5, atol=1e-9)
    out = _np(apply_fixmatch_op(x, "translate_y", torch.zeros(3, dtype=torch.float64)))
    np.testing.assert_allclose(out[..., 3:, :], xn[..., :7, :], atol=1e-9)
    np.testing.assert_allclose(out[..., :3, :], 0.5, atol=1e-9)
    # u = 0.5 is the zero angle / zero shear
    for op in ("rotate", "shear_x", "shear_y"):
        out = apply_fixmatch_op(x, op, torch.full((3,), 0.5, dtype=torch.float64))
        np.testing.assert_allclose(_np(out), xn, atol=1e-9)
    with pytest.raises(ValueError, match="valid"):
        apply_fixmatch_op(x, "cutout", u)


def _cutout_boxes(r, h, w, side):
    """Hand-computed clipped boxes from the two uniforms per image."""
    boxes = []
    for ry, rx in zip(r[0].tolist(), r[1].tolist()):
        cy, cx = int(np.floor(ry * h)), int(np.floor(rx * w))
        y0, x0 = cy - side // 2, cx - side // 2
        boxes.append((max(y0, 0), min(y0 + side, h), max(x0, 0), min(x0 + side, w)))
    return boxes


def test_cutout_fixed_black_square_of_half_the_side():
    n, h, w = 64, 32, 32
    x = torch.rand(n, 3, h, w, dtype=torch.float64) * 0.9 + 0.05
    out = cutout_fixed(x, _gen(7))
    boxes = _cutout_boxes(torch.rand((2, n), generator=_gen(7)), h, w, 16)
    inside_count = 0
    for i, (y0, y1, x0, x1) in enumerate(boxes):
        expect = x[i].clone()
        expect[:, y0:y1, x0:x1] = 0.0
        assert torch.equal(out[i], expect)
        if (y1 - y0, x1 - x0) == (16, 16):
            inside_count += 1
            assert int((out[i] == 0).all(0).sum()) == 256
    assert 0 < inside_count < n  # some squares inside, some clipped


# ----------------------------------------------------------------------------- official strong
def _replay_strong(x, seed):
    """The official strong view rebuilt image by image from a replayed generator."""
    n, _, h, w = x.shape
    g = _gen(seed)
    flips = torch.rand(n, generator=g) < 0.5
    rounds = []
    for _ in range(2):
        ops = torch.randint(0, len(FIXMATCH_OPS), (n,), generator=g)
        u = torch.rand(n, generator=g)
        rounds.append((ops, u))
    boxes = _cutout_boxes(torch.rand((2, n), generator=g), h, w, h // 2)
    out = []
    for i in range(n):
        xi = x[i : i + 1].flip(-1) if flips[i] else x[i : i + 1]
        for ops, u in rounds:
            xi = apply_fixmatch_op(xi, FIXMATCH_OPS[int(ops[i])], u[i : i + 1])
        xi = xi.clone()
        y0, y1, x0, x1 = boxes[i]
        xi[:, :, y0:y1, x0:x1] = 0.0
        out.append(xi)
    return torch.cat(out), flips, rounds, boxes


def test_official_strong_view_is_flip_two_ops_and_cutout():
    n = 48
    x = torch.rand(n, 3, 32, 32, dtype=torch.float64)
    x_before = x.clone()
    out = strong_view(x, _gen(21))
    assert torch.equal(x, x_before)  # input untouched
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.min() >= 0.0 and out.max() <= 1.0
    ref, flips, rounds, _ = _replay_strong(x, 21)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert 0 < int(flips.sum()) < n
    used = set(torch.cat([ops for ops, _ in rounds]).tolist())
    assert len(used) >= 10  # the draws really pick among the 14 ops


def test_official_strong_view_flip_rate_and_op_distribution():
    n = 4000
    g = _gen(5)
    flips = torch.rand(n, generator=g) < 0.5
    ops = torch.randint(0, len(FIXMATCH_OPS), (n,), generator=g)
    assert abs(float(flips.double().mean()) - 0.5) < 0.03
    counts = torch.bincount(ops, minlength=len(FIXMATCH_OPS)).double() / n
    assert len(FIXMATCH_OPS) == 14 and (counts - 1 / 14).abs().max() < 0.02
    # the same draws drive strong_view: a left-dark/right-bright image keeps its orientation
    # under identity, so images whose two ops are identity are flipped exactly per ``flips``
    x = torch.zeros(n, 3, 8, 8, dtype=torch.float64)
    x[..., 4:] = 0.8
    out = strong_view(x, _gen(5))
    g = _gen(5)
    flips = torch.rand(n, generator=g) < 0.5
    ids = torch.ones(n, dtype=torch.bool)
    for _ in range(2):
        ids &= torch.randint(0, 14, (n,), generator=g) == FIXMATCH_OPS.index("identity")
        torch.rand(n, generator=g)
    assert int(ids.sum()) > 5
    r = torch.rand((2, n), generator=g)
    # a column outside the cutout square tells the orientation
    col = torch.where(r[1] * 8 < 4, 7, 0)
    for i in ids.nonzero().squeeze(1).tolist():
        v = out[i, 0, :, col[i]]
        bright = 0.8 if (col[i] == 7) != bool(flips[i]) else 0.0
        assert torch.all(v == bright)


def test_official_strong_view_constant_image_has_black_square():
    n = 64
    x = torch.full((n, 3, 32, 32), 0.7)
    out = strong_view(x, _gen(9))
    _, _, _, boxes = _replay_strong(x.double(), 9)
    black = (out == 0).all(1, keepdim=True).double()
    full_window = F.avg_pool2d(black, 16, stride=1) == 1.0  # an all-black 16x16 window
    checked = 0
    for i, (y0, y1, x0, x1) in enumerate(boxes):
        if (y1 - y0, x1 - x0) == (16, 16):
            assert bool(full_window[i, 0, y0, x0])
            checked += 1
        else:
            assert bool(black[i, 0, y0:y1, x0:x1].all())
    assert checked > 0


# ----------------------------------------------------------------------------- mixstyle_disabled
def _ms_net(p=1.0, seed=0):
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        MixStyle(p=p, mix="random", generator=_gen(seed)),
        nn.Tanh(),
        nn.Conv2d(4, 2, 1),
    ).double()


def test_mixstyle_disabled_is_identity_and_restores():
    torch.manual_seed(0)
    net = _ms_net()
    ms = net[1]
    plain = copy.deepcopy(net)
    plain[1] = nn.Identity()
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    assert net.training and not torch.allclose(net(x), plain(x))  # p=1: MixStyle acts
    state = ms.generator.get_state()
    with mixstyle_disabled(net) as m:
        assert m is net
        torch.testing.assert_close(net(x), plain(x), rtol=0, atol=0)
        # lam/perm given explicitly would force mixing otherwise: still the identity
        assert torch.equal(ms(x, lam=torch.zeros(6), perm=torch.arange(6).flip(0)), x)
        with mixstyle_disabled(net):
            pass
        assert ms.disabled  # the inner block restores the outer block's state
    assert torch.equal(ms.generator.get_state(), state)  # nothing drawn while disabled
    assert not ms.disabled and ms.p == 1.0 and ms.training
    assert not torch.allclose(net(x), plain(x))
    with pytest.raises(RuntimeError, match="boom"), mixstyle_disabled(net):
        raise RuntimeError("boom")
    assert not ms.disabled
    with mixstyle_disabled(ms):  # a bare MixStyle module works too
        assert torch.equal(ms(x), x)
    assert not ms.disabled


# ----------------------------------------------------------------------------- FixMatch-CM
class TinyMS(nn.Module):
    """1x1 conv -> MixStyle -> tanh -> spatial mean features, linear head."""

    def __init__(self, k=4, c=5, ms=None):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 1)
        self.mixstyle = ms if ms is not None else nn.Identity()
        self.head = nn.Linear(c, k)
        self.feature_dim = c

    def features(self, x):
        return torch.tanh(self.mixstyle(self.conv(x))).mean(dim=(2, 3))

    def forward(self, x):
        return self.head(self.features(x))


def _hand_logits(model, x, mix=None):
    """Numpy forward of TinyMS; ``mix=(lam, perm)`` applies MixStyle by hand."""
    w = _np(model.conv.weight)[:, :, 0, 0]
    h = np.einsum("oc,nchw->nohw", w, _np(x)) + _np(model.conv.bias)[None, :, None, None]
    if mix is not None:
        lam, perm = mix
        lam = lam[:, None, None, None]
        mu = h.mean(axis=(2, 3), keepdims=True)
        sig = np.sqrt(h.var(axis=(2, 3), ddof=1, keepdims=True) + 1e-6)
        h = (h - mu) / sig * (lam * sig + (1 - lam) * sig[perm]) + lam * mu + (1 - lam) * mu[perm]
    f = np.tanh(h).mean(axis=(2, 3))
    return f @ _np(model.head.weight).T + _np(model.head.bias)


def _replay_mixstyle(g, n, alpha):
    """MixStyle's draws for one forward (p=1, mix='random'): Bernoulli, partners, lam."""
    assert float(torch.rand(1, generator=g)) < 1.0
    perm = torch.randperm(n, generator=g).numpy()
    lam = _np(sample_beta(alpha, (n,), g))
    return lam, perm


def _official_setup():
    """TinyMS (3 channels) whose weak-view pseudo-labels differ across rows, and its batch."""
    torch.manual_seed(3)
    n, m, k, s = 4, 4, 4, 8
    ms = MixStyle(p=1.0, alpha=0.3, mix="random", generator=_gen(5))
    model = TinyMS(k=k, c=3, ms=ms).double()
    with torch.no_grad():
        model.conv.weight.copy_(2.0 * torch.eye(3).view(3, 3, 1, 1))
        model.conv.bias.zero_()
        rows = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [-1, -1, -1]])
        model.head.weight.copy_(3.0 * rows)
        model.head.bias.zero_()
    # one dominant colour per weak view (plus noise) -> pseudo-labels 0, 1, 2 and spread
    # confidences
    colours = torch.tensor(
        [
            [0.9, 0.1, 0.1],
            [0.2, 0.6, 0.3],
            [0.05, 0.05, 0.05],
            [0.3, 0.3, 0.8],
            [0.1, 0.8, 0.1],
            [0.5, 0.4, 0.45],
            [0.1, 0.1, 0.9],
            [0.7, 0.2, 0.6],
        ],
        dtype=torch.float64,
    )
    weak_x = colours.view(8, 3, 1, 1) + 0.1 * torch.rand(8, 3, s, s, dtype=torch.float64)
    src_x, tgt_weak = weak_x[:n], weak_x[n:]
    batch = Step1Batch(
        src_x=src_x,
        src_y=torch.zeros(n, dtype=torch.long),
        src_d=torch.tensor([0, 1, 0, 1]),
        src_strong=torch.rand(n, 3, s, s, dtype=torch.float64),
        tgt_weak=tgt_weak,
        tgt_strong=torch.rand(m, 3, s, s, dtype=torch.float64),
    )
    # pseudo-labels and confidences of a MixStyle-free forward, by hand
    p = np.exp(_log_softmax(_hand_logits(model, torch.cat([src_x, tgt_weak]))))
    yhat, conf = p.argmax(1), p.max(1)
    # ground truth of the source rows never equals their pseudo-label
    batch.src_y = torch.as_tensor((yhat[:n] + 1) % k)
    return model, ms, batch, yhat, conf


def test_fixmatch_cm_official_matches_hand_computation():
    model, ms, batch, yhat, conf = _official_setup()
    n, k = 4, 4
    srt = np.sort(conf)
    thr = float(srt[3] + srt[4]) / 2  # half of the 8 rows masked
    w = (conf >= thr).astype(np.float64)
    assert 0 < w[:n].sum() < n and 0 < w[n:].sum() < 4  # masked and kept rows on both sides
    assert len(set(yhat.tolist())) >= 3
    calls = []
    ms.register_forward_hook(
        lambda mod, inp, out: calls.append((out is inp[0], mod.domains.clone()))
    )
    method = FixMatchCM(model, 2, threshold=thr, lambda_u=0.7, generator=_gen(16))
    assert method.variant == "official"
    loss, logs = method.loss(batch)

    # MixStyle: off for the pseudo-label pass, on (with the row domains) for the two others
    dom = torch.tensor([0, 1, 0, 1, 2, 2, 2, 2])
    assert [c[0] for c in calls] == [True, False, False]
    assert torch.equal(calls[0][1], dom) and torch.equal(calls[1][1], batch.src_d)
    assert torch.equal(calls[2][1], dom)

    g_ms = _gen(5)  # replay MixStyle's draws: the source pass, then the CutMix pass
    mix_src = _replay_mixstyle(g_ms, n, 0.3)
    mix_cm = _replay_mixstyle(g_ms, 2 * n, 0.3)
    ls = _log_softmax(_hand_logits(model, batch.src_x, mix_src))
    loss_x = -ls[np.arange(n), batch.src_y.numpy()].mean()

    x2 = torch.cat([batch.src_strong, batch.tgt_strong])
    ref = cutmix(torch.zeros_like(x2), torch.zeros(8, k), torch.zeros(8), _gen(16))
    y0, y1, x0, x1 = ref.box
    lam, perm = ref.lam, ref.perm.numpy()
    # the draws make every part of the formula matter: partner labels and partner masks
    assert 0 < lam < 1 and (w[perm] != w).any()
    assert ((w[perm] > 0) & (yhat[perm] != yhat)).any() and ((w > 0) & (yhat[perm] != yhat)).any()
    xm = _np(x2)
    xm[:, :, y0:y1, x0:x1] = _np(x2)[perm][:, :, y0:y1, x0:x1]
    lm = _log_softmax(_hand_logits(model, torch.from_numpy(xm), mix_cm))
    ce_a = -lm[np.arange(8), yhat]
    ce_b = -lm[np.arange(8), yhat[perm]]
    loss_u = lam * np.mean(w * ce_a) + (1 - lam) * np.mean(w[perm] * ce_b)

    assert logs["loss_x"] == pytest.approx(loss_x, rel=1e-10)
    assert logs["loss_u"] == pytest.approx(loss_u, rel=1e-10)
    assert loss.item() == pytest.approx(loss_x + 0.7 * loss_u, rel=1e-10)
    assert logs["loss"] == pytest.approx(loss.item())
    assert logs["mask_rate"] == pytest.approx(w[n:].mean())
    assert logs["src_mask_rate"] == pytest.approx(w[:n].mean())
    assert logs["cutmix_lam"] == pytest.approx(lam)
    assert set(logs) == {"loss", "loss_x", "loss_u", "mask_rate", "src_mask_rate", "cutmix_lam"}

    # negative control: ground truth (instead of pseudo-labels) for the source rows, unmasked
    y_gt = np.concatenate([batch.src_y.numpy(), yhat[n:]])
    w_gt = np.concatenate([np.ones(n), w[n:]])
    wrong = lam * np.mean(w_gt * -lm[np.arange(8), y_gt]) + (1 - lam) * np.mean(
        w_gt[perm] * -lm[np.arange(8), y_gt[perm]]
    )
    assert abs(wrong - loss_u) > 1e-3

    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert ms.domains is None and not ms.disabled


def test_fixmatch_cm_official_threshold_masks_every_row_alike():
    model, _, batch, yhat, conf = _official_setup()
    # threshold above every confidence: no pseudo-label survives, only the clean source CE
    method = FixMatchCM(model, 2, threshold=float(conf.max()) + 1e-6, generator=_gen(1))
    loss, logs = method.loss(batch)
    assert logs["loss_u"] == 0.0 and logs["mask_rate"] == 0.0 and logs["src_mask_rate"] == 0.0
    assert loss.item() == pytest.approx(logs["loss_x"], rel=1e-12)
    # threshold 0: every row kept, the source rows included
    method = FixMatchCM(model, 2, threshold=0.0, generator=_gen(1))
    _, logs = method.loss(batch)
    assert logs["mask_rate"] == 1.0 and logs["src_mask_rate"] == 1.0 and logs["loss_u"] > 0


def test_fixmatch_cm_official_needs_src_strong_and_valid_variant():
    model, _, batch, _, _ = _official_setup()
    batch.src_strong = None
    with pytest.raises(ValueError, match="src_strong"):
        FixMatchCM(model, 2).loss(batch)
    with pytest.raises(ValueError, match=r"'official', 'mixed'"):
        FixMatchCM(model, 2, variant="dassl")


def test_fixmatch_cm_mixed_variant_is_the_original_loss():
    model, _, batch, _, conf = _official_setup()
    thr = float(np.median(conf))
    ref_model = copy.deepcopy(model)
    mixed = FixMatchCM(model, 2, threshold=thr, variant="mixed", generator=_gen(2))
    loss, logs = mixed.loss(batch)
    ref = FixMatch(ref_model, 2, threshold=thr, cutmix=True, generator=_gen(2))
    ref_loss, ref_logs = ref.loss(batch)
    assert loss.item() == ref_loss.item() and logs == ref_logs
    assert set(logs) == {"loss", "loss_src", "loss_unsup", "mask_rate", "cutmix_lam"}
    # src_strong plays no part in the mixed variant
    batch.src_strong = None
    mixed2 = FixMatchCM(ref_model, 2, threshold=thr, variant="mixed", generator=_gen(2))
    assert mixed2.loss(batch)[1]["cutmix_lam"] == logs["cutmix_lam"]


def test_step1_batch_moves_src_strong():
    x = torch.rand(2, 3, 4, 4)
    batch = Step1Batch(x, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), x)
    assert batch.src_strong is x and batch.tgt_weak is None
    moved = batch.to("meta")
    assert moved.src_strong.device.type == "meta" and moved.tgt_strong is None


def test_fixmatch_cm_official_trains_a_step_with_official_views():
    ms = MixStyle(p=1.0, mix="crossdomain", generator=_gen(0))
    model = DigitCNN(num_classes=10, width=0.125, mixstyle=ms)
    method = FixMatchCM(model, 3, threshold=0.0, generator=_gen(1))
    g = _gen(2)
    xs, xt = torch.rand(6, 3, 32, 32), torch.rand(4, 3, 32, 32)
    batch = Step1Batch(
        src_x=weak_view(xs, g),
        src_y=torch.randint(0, 10, (6,)),
        src_d=torch.arange(6) % 3,
        src_strong=strong_view(xs, g),
        tgt_weak=weak_view(xt, g),
        tgt_strong=strong_view(xt, g),
    )
    method.train()
    opt = torch.optim.SGD(method.parameters(), lr=0.01)
    loss, logs = method.loss(batch)
    assert torch.isfinite(loss) and logs["mask_rate"] == 1.0 and logs["src_mask_rate"] == 1.0
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert ms.domains is None and not ms.disabled
