"""Tests for hypergrad.labels: GumbelLabeler, AdaptiveThreshold and soft_cross_entropy.

Every number is checked against an independent reference: the Gumbel noise is re-drawn from an
identically seeded generator and the soft sample and its gradient are computed by hand in
float64; the threshold curriculum is replayed by a plain numpy loop; the loss is compared with
``F.cross_entropy`` and with a numpy log-sum-exp; the label hyper-network hypergradient is compared
with its closed form.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hypergrad as hg
from hypergrad.labels import (
    AdaptiveThreshold,
    GumbelLabeler,
    gumbel_softmax_labels,
    soft_cross_entropy,
)

# ----------------------------------------------------------------------------- helpers


def _mlp(d_in: int = 5, hidden: int = 7, classes: int = 4, dtype=torch.float64) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes)).to(dtype)


def _reference_noise(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Gumbel noise re-drawn by hand from an identically seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=gen, dtype=dtype).numpy().astype(np.float64)
    finfo = np.finfo(np.float32 if dtype == torch.float32 else np.float64)
    u = np.clip(u, finfo.tiny, 1.0 - finfo.eps)
    return torch.from_numpy(-np.log(-np.log(u)))


def _np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ----------------------------------------------------------------------------- GumbelLabeler


def test_hard_labels_are_exactly_one_hot_of_noisy_argmax():
    torch.manual_seed(1)
    net = _mlp(dtype=torch.float32)
    x = torch.randn(64, 5)
    labels, _ = GumbelLabeler(net, temperature=0.5, hard=True)(
        x, generator=torch.Generator().manual_seed(7)
    )
    # values are exactly 0 or 1, one 1 per row
    assert torch.all((labels == 0) | (labels == 1))
    assert torch.equal(labels.sum(dim=1), torch.ones(64))
    # and the 1 sits at the argmax of logits + g, with g reproduced by hand
    with torch.no_grad():
        z = net(x).double()
    expected = (z + _reference_noise((64, 4), 7, torch.float32)).argmax(dim=1)
    assert torch.equal(labels.argmax(dim=1), expected)
    assert labels.requires_grad


@pytest.mark.parametrize("hard", [True, False])
def test_gradient_equals_hand_computed_soft_sample_gradient(hard):
    torch.manual_seed(2)
    n, d, c, tau, seed = 16, 5, 4, 0.7, 123
    net = nn.Linear(d, c).double()
    labeler = GumbelLabeler(net, temperature=tau, hard=hard)
    x = torch.randn(n, d, dtype=torch.float64)
    w = torch.randn(n, c, dtype=torch.float64)

    labels, _ = labeler(x, generator=torch.Generator().manual_seed(seed))
    g_w, g_b = torch.autograd.grad((labels * w).sum(), [net.weight, net.bias])

    # by hand: y = softmax((x W^T + b + g) / tau);  d(sum w*y)/dz = y * (w - <w, y>) / tau
    xn, wn = x.numpy(), w.numpy()
    W, b = net.weight.detach().numpy(), net.bias.detach().numpy()
    g = _reference_noise((n, c), seed).numpy()
    y = _np_softmax((xn @ W.T + b + g) / tau)
    delta = y * (wn - (wn * y).sum(axis=1, keepdims=True)) / tau
    np.testing.assert_allclose(g_w.numpy(), delta.T @ xn, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_b.numpy(), delta.sum(axis=0), rtol=1e-10, atol=1e-12)
    if not hard:
        np.testing.assert_allclose(labels.detach().numpy(), y, rtol=1e-12, atol=1e-14)
    else:
        np.testing.assert_array_equal(labels.detach().numpy(), np.eye(c)[y.argmax(axis=1)])


def test_small_temperature_soft_samples_approach_one_hot():
    torch.manual_seed(3)
    net = _mlp()
    x = torch.randn(64, 5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    soft_cold, _ = GumbelLabeler(net, temperature=0.01, hard=False)(x, generator=gen)
    gen = torch.Generator().manual_seed(11)
    soft_warm, _ = GumbelLabeler(net, temperature=1.0, hard=False)(x, generator=gen)
    # Rows whose two best noisy logits nearly tie cannot be one-hot at any temperature; with
    # a gap > 0.06 the top entry is >= 1 / (1 + 3 exp(-6)) > 0.99 at tau = 0.01.
    with torch.no_grad():
        noisy = net(x) + _reference_noise((64, 4), 11)
    top2 = noisy.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.06
    assert clear.sum() >= 56  # the vast majority of rows
    cold_max = soft_cold.max(dim=1).values
    assert torch.all(cold_max[clear] > 0.99)
    assert cold_max.mean() > 0.99
    assert soft_warm.max(dim=1).values.min() < 0.9  # the warm sample is visibly not one-hot
    # the cold sample concentrates on the same class as the hard sample from the same noise
    gen = torch.Generator().manual_seed(11)
    hard, _ = GumbelLabeler(net, temperature=0.01, hard=True)(x, generator=gen)
    assert torch.equal(soft_cold.argmax(dim=1), hard.argmax(dim=1))


@pytest.mark.parametrize("hard", [True, False])
def test_identically_seeded_generators_agree_exactly(hard):
    net = _mlp(dtype=torch.float32)
    labeler = GumbelLabeler(net, temperature=0.8, hard=hard)
    x = torch.randn(32, 5)
    a, ca = labeler(x, generator=torch.Generator().manual_seed(5))
    b, cb = labeler(x, generator=torch.Generator().manual_seed(5))
    other, _ = labeler(x, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and torch.equal(ca, cb)
    assert not torch.equal(a, other)
    # gradients agree exactly too
    w = torch.randn(32, 4)
    ga = torch.autograd.grad((a * w).sum(), list(labeler.parameters()))
    gb = torch.autograd.grad((b * w).sum(), list(labeler.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(ga, gb))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hard", [True, False])
def test_a_cpu_generator_drives_cuda_logits_with_the_cpu_draw(hard):
    """The noise is drawn on the generator's device (a CPU generator with CUDA logits raised
    "Expected a 'cuda' device type for generator" in BORT²'s stage 2 on a GPU)."""
    logits = torch.randn(16, 5, dtype=torch.float64)
    cpu = gumbel_softmax_labels(logits, 0.7, hard, torch.Generator().manual_seed(3))
    cuda = gumbel_softmax_labels(logits.cuda(), 0.7, hard, torch.Generator().manual_seed(3))
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-12, atol=1e-12)
    gen = torch.Generator(device="cuda").manual_seed(3)  # a CUDA generator works as before
    assert gumbel_softmax_labels(logits.cuda(), 0.7, hard, gen).device.type == "cuda"


def test_every_labeler_parameter_gets_nonzero_gradient():
    torch.manual_seed(4)
    net = _mlp()
    labeler = GumbelLabeler(net, temperature=1.0, hard=True)
    names = [name for name, _ in labeler.named_parameters()]
    assert names == ["net." + name for name, _ in net.named_parameters()]
    x = torch.randn(32, 5, dtype=torch.float64)
    labels, _ = labeler(x, generator=torch.Generator().manual_seed(0))
    (labels * torch.randn(32, 4, dtype=torch.float64)).sum().backward()
    for name, p in labeler.named_parameters():
        assert p.grad is not None and torch.linalg.vector_norm(p.grad) > 1e-6, name


def test_confidence_is_clean_softmax_max():
    torch.manual_seed(5)
    net = _mlp()
    x = torch.randn(20, 5, dtype=torch.float64)
    _, conf = GumbelLabeler(net)(x, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = net(x).numpy()
    np.testing.assert_allclose(conf.numpy(), _np_softmax(z).max(axis=1), rtol=1e-13)
    assert not conf.requires_grad


def test_labeler_validation():
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            GumbelLabeler(nn.Linear(3, 2), temperature=bad)
    labeler = GumbelLabeler(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="temperature"):
        labeler.temperature = 0.0
    with pytest.raises(ValueError, match="2-D"):
        labeler(torch.randn(4, 5, 3))


# ----------------------------------------------------------------------------- AdaptiveThreshold


def _ref_threshold(batches, alpha, max_init):
    """Plain float64 replay of the global curriculum; returns [(tau, mask), ...]."""
    tau, out = None, []
    for p in batches:
        p = np.asarray(p, dtype=np.float64)
        m = float(np.mean(p))
        s = float(np.std(p, ddof=1)) if p.size > 1 else 0.0
        if tau is None:
            tau = min(m + s, max_init)
        tau = alpha * tau + (1.0 - alpha) * (m - s)
        out.append((tau, p >= tau))
    return out


def _ref_threshold_per_class(batches, alpha, max_init, num_classes):
    taus: dict[int, float] = {}
    out = []
    for p, pred in batches:
        p, pred = np.asarray(p, dtype=np.float64), np.asarray(pred)
        for c in sorted(set(pred.tolist())):
            pc = p[pred == c]
            m = float(np.mean(pc))
            s = float(np.std(pc, ddof=1)) if pc.size > 1 else 0.0
            if c not in taus:
                taus[c] = min(m + s, max_init)
            taus[c] = alpha * taus[c] + (1.0 - alpha) * (m - s)
        tau_vec = np.array([taus.get(c, np.nan) for c in range(num_classes)])
        mask = np.array([c in taus and p[i] >= taus[c] for i, c in enumerate(pred.tolist())])
        out.append((tau_vec, mask))
    return out


def _batches(seed: int, sizes, lo=0.2, hi=1.0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(lo, hi, size=n) for n in sizes]


@pytest.mark.parametrize("alpha", [0.0, 0.9, 0.999])
def test_global_threshold_sequence_matches_reference(alpha):
    batches = _batches(0, [32, 17, 1, 40, 8])  # includes a batch of one sample
    p0 = batches[0]
    assert p0.mean() + p0.std(ddof=1) < 0.95  # the clamp is not active here
    thr = AdaptiveThreshold(alpha=alpha)
    assert torch.isnan(thr.threshold)
    for p, (tau_ref, mask_ref) in zip(batches, _ref_threshold(batches, alpha, 0.95)):
        mask = thr(torch.from_numpy(p))
        assert mask.dtype == torch.bool
        assert float(thr.threshold) == pytest.approx(tau_ref, rel=1e-12, abs=1e-14)
        np.testing.assert_array_equal(mask.numpy(), mask_ref)


def test_global_threshold_with_active_clamp():
    batches = [b.astype(np.float32) for b in _batches(1, [50, 30, 20, 60], lo=0.9, hi=1.0)]
    p0 = batches[0].astype(np.float64)
    assert p0.mean() + p0.std(ddof=1) > 0.95  # the clamp to max_init is active
    alpha = 0.8
    thr = AdaptiveThreshold(alpha=alpha, max_init=0.95)
    # float32 input, float64 statistics: the reference sees the same float32 values
    for p, (tau_ref, mask_ref) in zip(batches, _ref_threshold(batches, alpha, 0.95)):
        mask = thr(torch.from_numpy(p))
        assert float(thr.threshold) == pytest.approx(tau_ref, rel=1e-12)
        np.testing.assert_array_equal(mask.numpy(), mask_ref)
    # the first tau after the clamp, written out: alpha*0.95 + (1-alpha)*(mean-std)
    thr = AdaptiveThreshold(alpha=alpha, max_init=0.95)
    thr(torch.from_numpy(p0))
    expected = alpha * 0.95 + (1 - alpha) * (p0.mean() - p0.std(ddof=1))
    assert float(thr.threshold) == pytest.approx(expected, rel=1e-13)


def test_per_class_threshold_sequence_matches_reference():
    rng = np.random.default_rng(2)
    c = 4
    batches = [
        (rng.uniform(0.3, 1.0, 20), rng.integers(0, 2, 20)),  # classes 0, 1 only
        (rng.uniform(0.3, 1.0, 25), rng.integers(0, 3, 25)),  # class 2 appears
        (np.array([0.97]), np.array([1])),  # single sample of class 1
        (rng.uniform(0.9, 1.0, 30), rng.integers(0, 3, 30)),  # high confidences
    ]
    batches[1][1][:3] = 2  # make sure class 2 appears
    thr = AdaptiveThreshold(alpha=0.7, per_class=True, num_classes=c)
    for (p, pred), (tau_ref, mask_ref) in zip(
        batches, _ref_threshold_per_class(batches, 0.7, 0.95, c)
    ):
        mask = thr(torch.from_numpy(p), torch.from_numpy(pred))
        np.testing.assert_allclose(thr.threshold.numpy(), tau_ref, rtol=1e-12, equal_nan=True)
        np.testing.assert_array_equal(mask.numpy(), mask_ref)
    assert torch.isnan(thr.threshold[3])  # class 3 never appeared
    assert thr.threshold.shape == (c,)


def test_per_class_clamp_is_per_class():
    thr = AdaptiveThreshold(alpha=0.5, per_class=True, num_classes=2)
    p = torch.tensor([0.99, 0.97, 0.985, 0.3, 0.5, 0.4], dtype=torch.float64)
    pred = torch.tensor([0, 0, 0, 1, 1, 1])
    thr(p, pred)
    p0, p1 = p[:3].numpy(), p[3:].numpy()
    s0, s1 = p0.std(ddof=1), p1.std(ddof=1)
    assert p0.mean() + s0 > 0.95 > p1.mean() + s1
    expected = [
        0.5 * 0.95 + 0.5 * (p0.mean() - s0),
        0.5 * (p1.mean() + s1) + 0.5 * (p1.mean() - s1),
    ]
    np.testing.assert_allclose(thr.threshold.numpy(), expected, rtol=1e-13)


@pytest.mark.parametrize("per_class", [False, True])
def test_threshold_state_dict_round_trip(per_class):
    rng = np.random.default_rng(3)
    batches = [
        (torch.from_numpy(rng.uniform(0.2, 1.0, 24)), torch.from_numpy(rng.integers(0, 3, 24)))
        for _ in range(6)
    ]
    kwargs = dict(alpha=0.9, per_class=per_class, num_classes=3)
    a = AdaptiveThreshold(**kwargs)
    for p, pred in batches[:3]:
        a(p, pred)
    b = AdaptiveThreshold(**kwargs)
    b.load_state_dict(a.state_dict())
    fresh = AdaptiveThreshold(**kwargs)
    for p, pred in batches[3:]:
        ma, mb, mf = a(p, pred), b(p, pred), fresh(p, pred)
        assert torch.equal(a.threshold, b.threshold)
        assert torch.equal(ma, mb)
        assert not torch.equal(a.threshold, fresh.threshold)  # the state really mattered
        del mf
    assert set(a.state_dict()) == {"tau", "initialized"}


def test_threshold_ignores_gradient_and_empty_batch():
    thr = AdaptiveThreshold(alpha=0.5)
    p = torch.tensor([0.2, 0.4, 0.6, 0.8], requires_grad=True)
    mask = thr(p)
    assert not thr.threshold.requires_grad and not mask.requires_grad
    before = thr.threshold
    assert thr(torch.empty(0)).shape == (0,)
    assert torch.equal(thr.threshold, before)


def test_threshold_validation():
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="alpha"):
            AdaptiveThreshold(alpha=bad)
    with pytest.raises(ValueError, match="num_classes"):
        AdaptiveThreshold(per_class=True)
    thr = AdaptiveThreshold(per_class=True, num_classes=3)
    with pytest.raises(ValueError, match="pred"):
        thr(torch.rand(5))
    with pytest.raises(ValueError, match="pred"):
        thr(torch.rand(5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="pred"):
        thr(torch.rand(5), torch.full((5,), 3))
    with pytest.raises(ValueError, match="confidence"):
        AdaptiveThreshold()(torch.rand(5, 2))


# ----------------------------------------------------------------------------- soft_cross_entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_soft_cross_entropy_equals_cross_entropy_on_one_hot(reduction):
    logits = torch.randn(13, 6, dtype=torch.float64) * 3
    y = torch.randint(0, 6, (13,))
    ours = soft_cross_entropy(logits, F.one_hot(y, 6).double(), reduction=reduction)
    ref = F.cross_entropy(logits, y, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_soft_cross_entropy_mask_means_over_whole_batch():
    logits = torch.randn(10, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (10,))
    onehot = F.one_hot(y, 4).double()
    per = F.cross_entropy(logits, y, reduction="none")
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    torch.testing.assert_close(
        soft_cross_entropy(logits, onehot, mask), (per * mask).sum() / 10, rtol=1e-12, atol=0
    )
    torch.testing.assert_close(
        soft_cross_entropy(logits, onehot, mask, reduction="sum"),
        per[mask].sum(),
        rtol=1e-12,
        atol=0,
    )
    none = soft_cross_entropy(logits, onehot, mask, reduction="none")
    torch.testing.assert_close(none, torch.where(mask, per, 0.0), rtol=1e-12, atol=0)
    weights = torch.rand(10, dtype=torch.float64)
    torch.testing.assert_close(
        soft_cross_entropy(logits, onehot, weights), (per * weights).mean(), rtol=1e-12, atol=0
    )
    zero = soft_cross_entropy(logits, onehot, torch.zeros(10, dtype=torch.bool))
    assert zero.item() == 0.0


def test_soft_cross_entropy_soft_targets_against_numpy():
    rng = np.random.default_rng(4)
    z = rng.normal(size=(9, 5)) * 4
    t = rng.dirichlet(np.ones(5), size=9)
    zmax = z.max(axis=1, keepdims=True)
    logp = z - zmax - np.log(np.exp(z - zmax).sum(axis=1, keepdims=True))
    ref = -(t * logp).sum(axis=1)
    logits, targets = torch.from_numpy(z), torch.from_numpy(t).requires_grad_()
    out = soft_cross_entropy(logits, targets, reduction="none")
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-12)
    loss = soft_cross_entropy(logits, targets)
    assert loss.item() == pytest.approx(ref.mean(), rel=1e-12)
    # gradient with respect to the targets (how a label hyper-network is trained): -log p / N
    (g,) = torch.autograd.grad(loss, targets)
    np.testing.assert_allclose(g.numpy(), -logp / 9, rtol=1e-12)


def test_soft_cross_entropy_errors():
    logits = torch.randn(4, 3)
    with pytest.raises(ValueError, match="targets"):
        soft_cross_entropy(logits, torch.rand(4, 2))
    with pytest.raises(ValueError, match="mask"):
        soft_cross_entropy(logits, torch.rand(4, 3), mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="'mean', 'sum', 'none'"):
        soft_cross_entropy(logits, torch.rand(4, 3), reduction="avg")
    with pytest.raises(ValueError, match="logits"):
        soft_cross_entropy(torch.randn(4), torch.rand(4))


# ----------------------------------------------------------------------------- with implicit_grad

_HAS_IMPLICIT = all(hasattr(hg, n) for n in ("implicit_grad", "HypergradError", "Exact", "CG"))
needs_implicit = pytest.mark.skipif(
    not _HAS_IMPLICIT, reason="hypergrad.implicit_grad is not available yet"
)


@needs_implicit
def test_unused_labeler_raises():
    torch.manual_seed(6)
    labeler = GumbelLabeler(_mlp(5, 8, 3), temperature=1.0, hard=True)
    x, xv = torch.randn(20, 5, dtype=torch.float64), torch.randn(10, 5, dtype=torch.float64)
    yv = F.one_hot(torch.randint(0, 3, (10,)), 3).double()
    theta = {n: p.detach().clone().requires_grad_() for n, p in labeler.named_parameters()}
    psi = (0.1 * torch.randn(5, 3, dtype=torch.float64)).requires_grad_()

    def make_inner(detach: bool):
        def inner(psi, theta):
            gen = torch.Generator().manual_seed(0)  # same noise on every call
            labels = torch.func.functional_call(labeler, theta, (x,), {"generator": gen})[0]
            if detach:
                labels = labels.detach()
            return soft_cross_entropy(x @ psi, labels) + 0.05 * (psi**2).sum()

        return inner

    def outer(psi, theta):
        return soft_cross_entropy(xv @ psi, yv)

    with pytest.raises(hg.HypergradError):
        hg.implicit_grad(make_inner(True), outer, psi, theta, solver=hg.Exact())

    # contrast: the same problem without the detach has a genuine, nonzero hypergradient
    grads, _ = hg.implicit_grad(make_inner(False), outer, psi, theta, solver=hg.Exact())
    assert set(grads) == set(theta)
    total = sum(float(torch.linalg.vector_norm(g)) for g in grads.values())
    assert np.isfinite(total) and total > 0


@needs_implicit
@pytest.mark.parametrize("solver", ["exact", "cg"])
def test_least_squares_label_hypernetwork_closed_form(solver):
    torch.manual_seed(7)
    dt = torch.float64
    n, d, k, c, nv, lam = 30, 6, 4, 3, 20, 0.3
    X, Z = torch.randn(n, d, dtype=dt), torch.randn(n, k, dtype=dt)
    Xv, Yv = torch.randn(nv, d, dtype=dt), torch.randn(nv, c, dtype=dt)
    theta = torch.randn(k, c, dtype=dt, requires_grad=True)

    def labeler(theta):  # linear label hyper-network: soft targets Y(theta) = Z theta
        return Z @ theta

    def inner(psi, theta):
        return 0.5 * ((X @ psi - labeler(theta)) ** 2).sum() + 0.5 * lam * (psi**2).sum()

    def outer(psi, theta):
        return 0.5 * ((Xv @ psi - Yv) ** 2).sum()

    A = X.T @ X + lam * torch.eye(d, dtype=dt)
    with torch.no_grad():
        psi_star = torch.linalg.solve(A, X.T @ Z @ theta)
        ref = Z.T @ X @ torch.linalg.solve(A, Xv.T @ (Xv @ psi_star - Yv))

    method = hg.Exact() if solver == "exact" else hg.CG(maxiter=200, tol=1e-12)
    params = psi_star.detach().clone().requires_grad_()
    grad, info = hg.implicit_grad(inner, outer, params, theta, solver=method)
    assert grad.shape == theta.shape
    rel = torch.linalg.vector_norm(grad - ref) / torch.linalg.vector_norm(ref)
    assert rel < 1e-8, float(rel)
    assert info.solve.converged
