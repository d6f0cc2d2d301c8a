"""Tests of the BORT² models (DigitCNN, ResNet wrapper, MixStyle, stochastic layer) and the
batched augmentations, against hand-computed references."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bort2.data.transforms import OPS, apply_op, normalize, strong, to_float, translate, weak
from bort2.models import (
    DigitCNN,
    MixStyle,
    ResNetClassifier,
    StochasticClassifier,
    StochasticLayer,
    entropy_hinge,
    sample_beta,
    set_mixstyle_domains,
)
from torch import nn


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------- DigitCNN
def test_digit_cnn_full_width_parameter_count_and_shapes():
    model = DigitCNN(num_classes=10, width=1.0)
    # conv weights + biases, BN gamma/beta, FC weights + biases, by hand from the layer sizes
    conv = (3 * 64 * 25 + 64) + (64 * 64 * 25 + 64) + (64 * 128 * 25 + 128)
    bn2d = 2 * (64 + 64 + 128)
    fc = (8192 * 3072 + 3072) + (3072 * 2048 + 2048)
    bn1d = 2 * (3072 + 2048)
    head = 2048 * 10 + 10
    assert _n_params(model) == conv + bn2d + fc + bn1d + head == 31_805_898
    assert model.feature_dim == 2048
    assert model.fc[1].in_features == 128 * 8 * 8
    x = torch.rand(3, 3, 32, 32)
    model.eval()
    h = model.features(x)
    assert h.shape == (3, 2048)
    out = model(x)
    assert out.shape == (3, 10)
    torch.testing.assert_close(out, model.head(h))
    torch.testing.assert_close(model(x), out, rtol=0, atol=0)  # eval is deterministic


def test_digit_cnn_small_width_and_mixstyle_slot():
    model = DigitCNN(num_classes=10, width=0.25)
    assert model.feature_dim == 512
    assert _n_params(model) == 1_995_642
    assert isinstance(model.mixstyle, nn.Identity)
    with_ms = DigitCNN(num_classes=4, width=0.25, mixstyle=True, image_size=28)
    assert isinstance(with_ms.mixstyle, MixStyle)
    assert with_ms(torch.rand(4, 3, 28, 28)).shape == (4, 4)


# ----------------------------------------------------------------------------- ResNet
def test_resnet_classifier_local_weights(tmp_path):
    import torchvision

    ref = torchvision.models.resnet18(weights=None)
    path = tmp_path / "r18.pth"
    torch.save(ref.state_dict(), path)
    model = ResNetClassifier("resnet18", num_classes=7, weights_path=path, mixstyle=True)
    torch.testing.assert_close(model.backbone.conv1.weight, ref.conv1.weight)
    torch.testing.assert_close(
        model.backbone.layer4[1].bn2.running_var, ref.layer4[1].bn2.running_var
    )
    assert model.feature_dim == 512
    model.eval()
    x = torch.rand(2, 3, 32, 32)
    assert model(x).shape == (2, 7)
    # features equal torchvision's forward without fc (MixStyle is the identity in eval)
    ref.fc = nn.Identity()
    ref.eval()
    torch.testing.assert_close(model.features(x), ref(x))
    # a classifier's own state dict round-trips
    path2 = tmp_path / "clf.pth"
    torch.save(model.state_dict(), path2)
    again = ResNetClassifier("resnet18", num_classes=7, weights_path=path2).eval()
    torch.testing.assert_close(again(x), model(x))


def test_resnet_classifier_missing_weights_is_clear(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        ResNetClassifier("resnet18", num_classes=3, weights_path=missing)
    with pytest.raises(ValueError, match="unknown arch"):
        ResNetClassifier("vgg", num_classes=3)


# ----------------------------------------------------------------------------- MixStyle
def _mixstyle_reference(x, lam, perm, eps):
    x = x.detach().numpy().astype(np.float64)
    n, c = x.shape[:2]
    out = np.empty_like(x)
    for i in range(n):
        j = int(perm[i])
        for ch in range(c):
            a, b = x[i, ch], x[j, ch]
            mu_a, mu_b = a.mean(), b.mean()
            sd_a = math.sqrt(a.var(ddof=1) + eps)
            sd_b = math.sqrt(b.var(ddof=1) + eps)
            lm = float(lam[i])
            out[i, ch] = (a - mu_a) / sd_a * (lm * sd_a + (1 - lm) * sd_b) + (
                lm * mu_a + (1 - lm) * mu_b
            )
    return torch.from_numpy(out).float()


def test_mixstyle_matches_hand_computation():
    ms = MixStyle(p=1.0, alpha=0.1, eps=1e-6).train()
    x = torch.randn(4, 3, 5, 6) * 2 + 1
    lam = torch.tensor([0.2, 0.9, 0.5, 0.0])
    perm = torch.tensor([2, 0, 3, 1])
    out = ms(x, lam=lam, perm=perm)
    torch.testing.assert_close(out, _mixstyle_reference(x, lam, perm, 1e-6), rtol=1e-5, atol=1e-5)
    # seeded draws with p=1: the Bernoulli draw, the permutation and lam come from the generator
    ms_g = MixStyle(p=1.0, alpha=0.1, generator=torch.Generator().manual_seed(3)).train()
    y = ms_g(x)
    g = torch.Generator().manual_seed(3)
    torch.rand(1, generator=g)
    perm_g = torch.randperm(4, generator=g)
    lam_g = sample_beta(0.1, (4,), g)
    torch.testing.assert_close(y, _mixstyle_reference(x, lam_g, perm_g, 1e-6), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y, x)
    # eval: identity, p=0: identity
    ms.eval()
    assert ms(x) is x
    assert MixStyle(p=0.0).train()(x) is x


def test_mixstyle_gradient_treats_statistics_as_constants():
    ms = MixStyle(p=1.0).train()
    x = torch.randn(2, 2, 3, 3, requires_grad=True)
    lam = torch.tensor([0.3, 0.6])
    perm = torch.tensor([1, 0])
    ms(x, lam=lam, perm=perm).sum().backward()
    sig = (x.detach().var(dim=(2, 3), keepdim=True) + 1e-6).sqrt()
    sig_mix = lam.view(2, 1, 1, 1) * sig + (1 - lam.view(2, 1, 1, 1)) * sig[perm]
    torch.testing.assert_close(x.grad, (sig_mix / sig).expand_as(x))


def test_mixstyle_crossdomain_pairs_other_domains_and_is_seeded():
    x = torch.randn(8, 2, 4, 4)
    d = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    ms = MixStyle(p=1.0, mix="crossdomain", generator=torch.Generator().manual_seed(0)).train()
    model = nn.Sequential(ms)
    assert set_mixstyle_domains(model, d) == 1
    for _ in range(20):
        perm = ms._partners(8, x.device)
        assert torch.all(d[perm] != d)
    ms.set_domains(torch.zeros(8, dtype=torch.long))  # a single domain: random fallback
    assert sorted(ms._partners(8, x.device).tolist()) == list(range(8))
    ms.set_domains(d[:3])
    with pytest.raises(ValueError):
        ms(x)
    a = MixStyle(p=1.0, generator=torch.Generator().manual_seed(5)).train()(x)
    b = MixStyle(p=1.0, generator=torch.Generator().manual_seed(5)).train()(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sample_beta_seeded_moments():
    s = sample_beta(0.5, (20000,), torch.Generator().manual_seed(0))
    assert s.min() >= 0 and s.max() <= 1
    # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)) = 1/8 for a = 0.5
    assert abs(float(s.mean()) - 0.5) < 0.01
    assert abs(float(s.var()) - 0.125) < 0.005


# ----------------------------------------------------------------------------- stochastic
def test_entropy_hinge_against_numpy():
    sigma = torch.tensor([[0.5, 2.0, 100.0], [60.0, 70.0, 80.0], [1.0, 1.0, 1.0]])
    s = sigma.numpy().astype(np.float64)
    ref = np.mean(np.maximum(4.0 - np.log(s).mean(axis=1), 0.0))
    assert float(entropy_hinge(sigma, margin=4.0)) == pytest.approx(ref, rel=1e-6)
    assert float(entropy_hinge(sigma, margin=0.0)) == pytest.approx(
        np.mean(np.maximum(-np.log(s).mean(axis=1), 0.0)), abs=1e-7
    )


class _Tiny(nn.Module):
    def __init__(self, d=6, k=3):
        super().__init__()
        self.body = nn.Linear(12, d)
        self.head = nn.Linear(d, k)
        self.feature_dim = d

    def features(self, x):
        return torch.tanh(self.body(x.flatten(1)))

    def forward(self, x):
        return self.head(self.features(x))


def test_stochastic_layer_shapes_sampling_and_gradients():
    layer = StochasticLayer(5, 4)
    h = torch.randn(1, 5).expand(6, 5).contiguous()  # identical rows
    layer.train()
    z, sigma = layer(h)
    assert z.shape == sigma.shape == (6, 4)
    assert torch.all(sigma > 0)
    # one sample per instance: identical inputs give different samples per row
    assert torch.unique(z, dim=0).shape[0] == 6
    torch.testing.assert_close(sigma, F.softplus(layer.sigma_head(h)) + layer.eps)
    (z.sum() + sigma.sum()).backward()
    assert layer.mu_head.weight.grad.abs().sum() > 0
    assert layer.sigma_head.weight.grad.abs().sum() > 0
    layer.eval()
    z_eval, _ = layer(h)
    torch.testing.assert_close(z_eval, layer.mu_head(h))


def test_stochastic_classifier_eval_mu_path_and_train_grads():
    model = StochasticClassifier(_Tiny(), num_classes=3)
    assert isinstance(model.backbone.head, nn.Identity)
    x = torch.randn(5, 3, 2, 2)
    model.eval()
    h = model.features(x)
    expected = model.classifier(model.stochastic.mu_head(h))
    torch.testing.assert_close(model(x), expected)
    logits, sigma = model.forward_with_sigma(x)
    torch.testing.assert_close(logits, expected)
    assert sigma.shape == (5, 6) and torch.all(sigma > 0)
    model.train()
    logits, sigma = model.forward_with_sigma(x)
    (F.cross_entropy(logits, torch.tensor([0, 1, 2, 0, 1])) + entropy_hinge(sigma)).backward()
    for p in model.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
    assert model.stochastic.sigma_head.weight.grad.abs().sum() > 0
    assert model.stochastic.mu_head.weight.grad.abs().sum() > 0


def test_stochastic_classifier_from_classifier_keeps_eval_logits():
    base = DigitCNN(num_classes=10, width=0.125).eval()
    x = torch.rand(4, 3, 32, 32)
    ref = base(x)
    model = StochasticClassifier.from_classifier(base, sigma_init=0.1).eval()
    torch.testing.assert_close(model(x), ref)
    _, sigma = model.forward_with_sigma(x)
    torch.testing.assert_close(sigma, torch.full_like(sigma, 0.1 + 1e-6))
    assert isinstance(base.head, nn.Linear)  # the original is untouched
    assert model.backbone is not base


# ----------------------------------------------------------------------------- transforms
def test_to_float_and_normalize():
    u = torch.tensor([[[[0, 255], [51, 102]]]], dtype=torch.uint8).expand(1, 3, 2, 2)
    f = to_float(u)
    assert f.dtype == torch.float32
    torch.testing.assert_close(f[0, 0], torch.tensor([[0.0, 1.0], [0.2, 0.4]]))
    n = normalize(f, (0.5, 0.5, 0.5), (0.25, 0.5, 1.0))
    torch.testing.assert_close(n[0, :, 0, 1], torch.tensor([2.0, 1.0, 0.5]))


def test_translate_is_exact_reflect_shift():
    x = torch.rand(3, 3, 8, 8)
    dx, dy = torch.tensor([2, -1, 0]), torch.tensor([-2, 1, 0])
    out = translate(x, dx, dy, pad=2)
    xn = x.numpy()
    for n in range(3):
        padded = np.pad(xn[n], ((0, 0), (2, 2), (2, 2)), mode="reflect")
        ref = padded[:, 2 - dy[n] : 2 - dy[n] + 8, 2 - dx[n] : 2 - dx[n] + 8]
        np.testing.assert_array_equal(out[n].numpy(), ref)
    # interior: a pure shift of the original
    np.testing.assert_array_equal(out[0, :, 0:6, 2:8].numpy(), xn[0, :, 2:8, 0:6])


def test_weak_is_an_allowed_shift_for_a_seeded_draw():
    x = torch.rand(6, 3, 32, 32)
    out = weak(x, torch.Generator().manual_seed(1))
    assert out.shape == x.shape
    again = weak(x, torch.Generator().manual_seed(1))
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    xn = x.numpy()
    for n in range(6):
        padded = np.pad(xn[n], ((0, 0), (4, 4), (4, 4)), mode="reflect")
        matches = [
            (a, b)
            for a in range(9)
            for b in range(9)
            if np.array_equal(padded[:, a : a + 32, b : b + 32], out[n].numpy())
        ]
        assert len(matches) == 1  # exactly one crop offset of the reflect-padded image
    flipped = weak(x, torch.Generator().manual_seed(0), hflip=True, max_translate=0.0)
    for n in range(6):
        assert torch.equal(flipped[n], x[n]) or torch.equal(flipped[n], x[n].flip(-1))


def test_strong_shape_range_and_ops():
    x = torch.rand(64, 3, 32, 32)
    out = strong(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.min() >= 0 and out.max() <= 1
    assert not torch.equal(out, x)
    v = torch.linspace(-1, 1, 64)
    for op in OPS:
        y = apply_op(x, op, v)
        assert y.shape == x.shape and y.min() >= 0 and y.max() <= 1, op
    # spot checks against hand computations
    torch.testing.assert_close(
        apply_op(x, "brightness", v), (x * (1 + 0.9 * v).view(-1, 1, 1, 1)).clamp(0, 1)
    )
    thr = (1 - v.abs()).view(-1, 1, 1, 1)
    torch.testing.assert_close(apply_op(x, "solarize", v), torch.where(x >= thr, 1 - x, x))
    ramp = torch.linspace(0.2, 0.6, 16).view(1, 1, 4, 4).expand(1, 3, 4, 4)
    torch.testing.assert_close(
        apply_op(ramp, "autocontrast", torch.zeros(1)), (ramp - 0.2) / 0.4, rtol=1e-5, atol=1e-5
    )
    zero = torch.zeros(x.shape[0])
    for op in ("rotate", "shear_x", "translate_y"):  # zero magnitude: identity up to rounding
        torch.testing.assert_close(apply_op(x, op, zero), x, rtol=0, atol=1e-5)
