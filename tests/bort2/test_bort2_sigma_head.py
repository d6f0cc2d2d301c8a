"""Tests of BORT²'s official sigma head (OfficialStochasticClassifier), the classifier-state
export of both stochastic heads, ``build_stochastic`` and ``entropy_hinge``'s ``eps``, against
hand-computed references."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bort2.dist import RowDropout
from bort2.models import (
    SIGMA_HEADS,
    DigitCNN,
    OfficialStochasticClassifier,
    ResNetClassifier,
    StochasticClassifier,
    build_stochastic,
    entropy_hinge,
)
from torch import nn


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _randomise_bn(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial BN statistics and affine parameters, so eval mode differs from train mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.1)


# ----------------------------------------------------------------------------- DigitCNN hooks
def test_features_with_fc1_matches_features_under_the_same_seed():
    net = DigitCNN(num_classes=10, width=0.125).train()
    assert net.fc1_dim == 384 and net.feature_dim == 256
    x = torch.rand(5, 3, 32, 32)
    torch.manual_seed(7)
    h_ref = net.features(x)
    torch.manual_seed(7)
    h, a1 = net.features_with_fc1(x)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    assert a1.shape == (5, net.fc1_dim)
    # a1 is the input of the second linear layer: recompute h from it
    torch.testing.assert_close(net.fc[7](net.fc[6](net.fc[5](a1))), h, rtol=0, atol=0)
    # dropout p=0.5 in train mode: about half of a1 is zeroed, survivors scaled by 2
    assert (a1 == 0).float().mean() > 0.4
    net.eval()
    h_eval, a1_eval = net.features_with_fc1(x)
    torch.testing.assert_close(h_eval, net.features(x), rtol=0, atol=0)
    assert torch.all(a1_eval >= 0)


def test_resnet_features_with_map_pools_the_layer4_map():
    net = ResNetClassifier("resnet18", num_classes=3).eval()
    x = torch.rand(2, 3, 64, 64)
    h, fmap = net.features_with_map(x)
    assert fmap.shape == (2, 512, 2, 2)
    torch.testing.assert_close(h, fmap.mean(dim=(2, 3)))
    torch.testing.assert_close(net.features(x), h, rtol=0, atol=0)


# ----------------------------------------------------------------------------- official digit
@pytest.mark.parametrize("width", [0.125, 1.0])
def test_official_digit_head_shapes_and_branch_size(width):
    net = DigitCNN(num_classes=10, width=width)
    keys = set(net.state_dict())
    model = OfficialStochasticClassifier(net)
    assert model.net is net  # taken over, not copied
    assert set(model.net.state_dict()) == keys
    d, f1 = net.feature_dim, net.fc1_dim
    assert model.feature_dim == model.latent_dim == d and model.num_classes == 10
    branch = model.sigma_branch
    assert [type(m) for m in branch] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, RowDropout]
    assert branch[3].p == 0.5
    assert _n_params(branch) == f1 * d + d + 2 * d
    if width == 1.0:
        assert _n_params(branch) == 3072 * 2048 + 2048 + 2 * 2048
    x = torch.rand(3, 3, 32, 32)
    for train in (True, False):
        model.train(train)
        logits, sigma = model.forward_with_sigma(x)
        assert logits.shape == (3, 10)
        assert sigma.shape == (3, d)


def test_official_digit_sigma_lower_bound_and_eval_logits():
    net = DigitCNN(num_classes=10, width=0.125)
    _randomise_bn(net)
    original = copy.deepcopy(net).eval()
    model = OfficialStochasticClassifier(net)
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32) * 3
    # eval first: a train-mode pass updates the BN running statistics
    model.eval()
    logits, sigma = model.forward_with_sigma(x)
    assert torch.all(sigma >= math.log(2) - 1e-6)
    ref = original(x)
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(model.head(model.features(x)), ref, rtol=0, atol=0)
    model.train()
    for _ in range(3):
        _, sigma = model.forward_with_sigma(torch.randn(8, 3, 32, 32) * 3)
        assert torch.all(sigma >= math.log(2) - 1e-6)
        assert torch.any(sigma == math.log(2))  # dropped units give exactly softplus(0)


def test_official_digit_train_logits_match_hand_computation():
    net = DigitCNN(num_classes=10, width=0.125).double()
    model = OfficialStochasticClassifier(net).train()
    assert next(model.sigma_branch.parameters()).dtype == torch.float64
    x = torch.rand(6, 3, 32, 32, dtype=torch.float64)
    torch.manual_seed(11)
    logits, sigma = model.forward_with_sigma(x)

    torch.manual_seed(11)
    mu, a1 = net.features_with_fc1(x)
    lin, bn, _, drop = model.sigma_branch
    # contiguous (N, D), as the module's output: the dropout mask follows the memory layout
    pre = a1 @ lin.weight.T + lin.bias
    assert pre.is_contiguous()
    # BatchNorm1d in training: batch mean and biased batch variance
    mean = pre.mean(dim=0)
    var = ((pre - mean) ** 2).mean(dim=0)
    normed = (pre - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
    raw = drop(torch.clamp(normed, min=0.0))  # draws the dropout mask from the global RNG
    sig = torch.log1p(torch.exp(raw))
    eps = torch.randn(mu.shape, dtype=torch.float64)
    z = mu + sig * eps
    ref = z @ net.head.weight.T + net.head.bias
    torch.testing.assert_close(sigma, sig, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits, ref, rtol=1e-12, atol=1e-12)
    # the sample is not the mean path
    assert not torch.allclose(logits, net.head(mu))
    # gradients reach the sigma branch through the sample
    F.cross_entropy(logits, torch.arange(6) % 10).backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- classifier_state
def test_classifier_state_round_trip_official():
    net = DigitCNN(num_classes=10, width=0.125).double()
    _randomise_bn(net, seed=1)
    model = build_stochastic(net, "official")
    # train a little so the weights move away from net's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    x = torch.rand(8, 3, 32, 32, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), torch.arange(8) % 10).backward()
        opt.step()
    model.eval()
    state = model.classifier_state()
    plain = DigitCNN(num_classes=10, width=0.125).double()
    plain.load_state_dict(state, strict=True)
    plain.eval()
    torch.testing.assert_close(plain(x), model(x), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(plain(x), net.eval()(x))


def test_classifier_state_round_trip_linear():
    net = DigitCNN(num_classes=10, width=0.125).double()
    _randomise_bn(net, seed=2)
    model = build_stochastic(net, "linear", sigma_init=0.2)
    assert isinstance(model, StochasticClassifier)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # make the composition classifier o mu-head non-trivial
        for p in (
            model.stochastic.mu_head.weight,
            model.stochastic.mu_head.bias,
            model.classifier.weight,
            model.classifier.bias,
        ):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    model.eval()
    x = torch.rand(7, 3, 32, 32, dtype=torch.float64)
    state = model.classifier_state()
    plain = DigitCNN(num_classes=10, width=0.125).double()
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    plain.eval()
    torch.testing.assert_close(plain(x), model(x), rtol=1e-12, atol=1e-12)
    # hand composition of the head
    w_mu = model.stochastic.mu_head.weight.detach().numpy()
    b_mu = model.stochastic.mu_head.bias.detach().numpy()
    w_c = model.classifier.weight.detach().numpy()
    b_c = model.classifier.bias.detach().numpy()
    np.testing.assert_allclose(state["head.weight"].numpy(), w_c @ w_mu, rtol=1e-12)
    np.testing.assert_allclose(state["head.bias"].numpy(), w_c @ b_mu + b_c, rtol=1e-12)
    assert not torch.allclose(plain(x), net.eval()(x))


# ----------------------------------------------------------------------------- official ResNet
@pytest.mark.parametrize("side", [32, 224])
def test_official_resnet_head(side):
    torch.manual_seed(0)
    net = ResNetClassifier("resnet18", num_classes=5)
    model = OfficialStochasticClassifier(net)
    assert model.feature_dim == 512 and model.num_classes == 5
    pool, conv, _ = model.sigma_branch
    assert conv.kernel_size == (7, 7) and conv.padding == (0, 0) and conv.bias is not None
    assert conv.in_channels == conv.out_channels == 512
    x = torch.rand(2, 3, side, side)
    for train in (True, False):
        model.train(train)
        logits, sigma = model.forward_with_sigma(x)
        assert logits.shape == (2, 5)
        assert sigma.shape == (2, 512)
        assert torch.all(sigma > 0)
    model.eval()
    _, fmap = net.features_with_map(x)
    _, sigma = model.forward_with_sigma(x)
    if side == 224:
        assert fmap.shape[-2:] == (7, 7)
        torch.testing.assert_close(pool(fmap), fmap, rtol=0, atol=0)
        raw = F.conv2d(fmap, conv.weight, conv.bias).flatten(1)
        torch.testing.assert_close(sigma, F.softplus(raw + 1e-10))
    else:
        assert fmap.shape[-2:] == (1, 1)
        raw = F.conv2d(fmap.expand(-1, -1, 7, 7), conv.weight, conv.bias).flatten(1)
        torch.testing.assert_close(sigma, F.softplus(raw + 1e-10))
    torch.testing.assert_close(model(x), net(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- builder
def test_build_stochastic_kinds_and_errors():
    assert SIGMA_HEADS == ("official", "linear")
    net = DigitCNN(num_classes=4, width=0.125)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    head = net.head
    official = build_stochastic(net, "official")
    linear = build_stochastic(net, "linear", num_classes=4, sigma_init=0.3)
    assert isinstance(official, OfficialStochasticClassifier) and official.net is not net
    assert isinstance(linear, StochasticClassifier) and linear.backbone is not net
    assert net.head is head and isinstance(net.head, nn.Linear)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match=r"'official', 'linear'"):
        build_stochastic(net, "gaussian")
    with pytest.raises(ValueError, match="num_classes"):
        build_stochastic(net, "official", num_classes=7)
    with pytest.raises(TypeError):
        OfficialStochasticClassifier(nn.Linear(3, 2))


# ----------------------------------------------------------------------------- entropy hinge
def test_entropy_hinge_eps():
    sigma = torch.tensor([[1e-8, 2.0, 100.0], [60.0, 70.0, 80.0], [0.0, 1.0, 1.0]])
    s = sigma.double().numpy()
    ref = np.mean(np.maximum(4.0 - np.log(s + 1e-7).mean(axis=1), 0.0))
    assert float(entropy_hinge(sigma, margin=4.0, eps=1e-7)) == pytest.approx(ref, rel=1e-6)
    pos = sigma[:2]
    assert torch.equal(entropy_hinge(pos, eps=0.0), entropy_hinge(pos))
