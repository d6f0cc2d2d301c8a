"""Tests of BORT² step 2 (examples/bort2/bort2/step2): pseudo-labels, thresholds, the step-2
losses, the target-model construction and the bilevel hypergradient, each against an
independent hand-written (mostly float64) reference."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bort2.config import HyperConfig, Step2Config
from bort2.models import DigitCNN, MixStyle, StochasticClassifier
from bort2.step2 import (
    BilevelLabelUpdater,
    build_student,
    build_threshold,
    naive_loss,
    outer_log_sigma,
    robust_loss,
    teacher_labels,
)
from helpers import LinTanh
from torch import nn
from torch.func import functional_call

import hypergrad as hg

pytestmark = pytest.mark.usefixtures("one_thread")


class IdNet(nn.Module):
    """Logits equal the flattened (N, C) input times a learnable scale: lets a test choose the
    logits while keeping a parameter to differentiate."""

    def __init__(self, k=3, dtype=torch.float64):
        super().__init__()
        self.head = nn.Linear(k, k, dtype=dtype)
        self.feature_dim = k
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(k, dtype=dtype))
            self.head.bias.zero_()

    def features(self, x):
        return x.flatten(1)

    def forward(self, x):
        return self.head(self.features(x))


class TinyNet(nn.Module):
    """A tiny classifier with BatchNorm and dropout: features = dropout(tanh(BN(W x)))."""

    def __init__(self, in_dim=12, d=4, k=3, p=0.25):
        super().__init__()
        self.body = nn.Linear(in_dim, d, bias=False)
        self.bn = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(d, k)
        self.feature_dim = d

    def features(self, x):
        return self.drop(torch.tanh(self.bn(self.body(x.flatten(1)))))

    def forward(self, x):
        return self.head(self.features(x))


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def _softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _softplus(z):
    return np.logaddexp(0.0, z)


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------- teacher_labels
def test_teacher_labels_argmax_mode_is_one_hot_of_clean_argmax():
    logits = torch.tensor(
        [[2.0, 0.5, -1.0], [0.1, 0.3, 0.2], [-3.0, -3.5, 4.0], [0.0, 1.0, 0.9]], dtype=torch.float64
    )
    labels, conf, pred = teacher_labels(IdNet(), logits, "argmax")
    expected_pred = np.array([0, 1, 2, 1])
    assert pred.tolist() == expected_pred.tolist()
    assert torch.equal(labels, torch.eye(3, dtype=torch.float64)[torch.tensor(expected_pred)])
    ref_conf = _softmax(_np(logits)).max(axis=1)
    np.testing.assert_allclose(_np(conf), ref_conf, rtol=1e-12, atol=0)
    assert not conf.requires_grad


def test_teacher_labels_gumbel_mode_reproduces_the_noise_and_straight_through_gradient():
    torch.manual_seed(3)
    n, k = 64, 4
    # small logit gaps so the Gumbel noise moves the argmax of many rows
    x = 0.3 * torch.randn(n, k, dtype=torch.float64)
    net = IdNet(k)
    labels, conf, pred = teacher_labels(net, x, "gumbel", 1.0, torch.Generator().manual_seed(11))
    # the Gumbel noise by hand from an identically seeded generator
    u = torch.rand((n, k), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    g = -torch.log(-torch.log(u))
    noisy_argmax = (x + g).argmax(1)
    # exactly one-hot values, at argmax(logits + g)
    assert set(labels.detach().unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(labels.detach().sum(1), torch.ones(n, dtype=torch.float64))
    assert torch.equal(labels.detach().argmax(1), noisy_argmax)
    # pred and confidence are those of the clean logits, even in gumbel mode
    clean = x.argmax(1)
    assert torch.equal(pred, clean)
    assert (noisy_argmax != clean).sum() >= 5  # the noise did change labels: pred is not them
    np.testing.assert_allclose(_np(conf), _softmax(_np(x)).max(axis=1), rtol=1e-12, atol=0)
    # gradient flows to the labeler's parameters: straight-through = gradient of the soft sample
    w = torch.randn(n, k, dtype=torch.float64)
    (labels * w).sum().backward()
    ref_net = IdNet(k)
    y_soft = torch.softmax(ref_net(x) + g, dim=1)
    ref_grads = torch.autograd.grad((y_soft * w).sum(), list(ref_net.parameters()))
    for p, r in zip(net.parameters(), ref_grads):
        assert p.grad is not None and p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-12)
    # same generator seed -> same labels; another seed -> other labels
    again = teacher_labels(net, x, "gumbel", 1.0, torch.Generator().manual_seed(11))[0]
    other = teacher_labels(net, x, "gumbel", 1.0, torch.Generator().manual_seed(12))[0]
    assert torch.equal(again, labels) and not torch.equal(other, labels)


def test_teacher_labels_rejects_unknown_mode():
    with pytest.raises(ValueError, match="gumbel"):
        teacher_labels(IdNet(), torch.zeros(2, 3, dtype=torch.float64), "soft")


# ----------------------------------------------------------------------------- thresholds
def test_fixed_threshold_is_conf_at_least_tau():
    thr = build_threshold("fixed", 0.5, 0.999, 10)
    conf = torch.tensor([0.2, 0.5, 0.7, 0.4999, 1.0], dtype=torch.float64)
    assert thr(conf, torch.zeros(5, dtype=torch.long)).tolist() == [False, True, True, False, True]
    assert float(thr.threshold) == 0.5
    # stateless: the same answer on the second call
    assert thr(conf).tolist() == [False, True, True, False, True]


def _adaptive_reference(batches, alpha, max_init=0.95):
    """tau0 = min(mean+std, max_init); tau <- alpha tau + (1-alpha)(mean-std); std unbiased."""
    tau, out = None, []
    for p in batches:
        p = np.asarray(p, dtype=np.float64)
        mean, std = p.mean(), p.std(ddof=1)
        if tau is None:
            tau = min(mean + std, max_init)
        tau = alpha * tau + (1 - alpha) * (mean - std)
        out.append((tau, p >= tau))
    return out


@pytest.mark.parametrize("alpha", [0.999, 0.5])
def test_adaptive_threshold_matches_hand_computed_sequence(alpha):
    b1 = [0.20, 0.40, 0.60, 0.90, 0.85, 0.55]
    b2 = [0.30, 0.97, 0.99, 0.50, 0.75]
    thr = build_threshold("adaptive", 0.95, alpha, 10)
    ref_lib = hg.AdaptiveThreshold(alpha=alpha)
    ref = _adaptive_reference([b1, b2], alpha)
    for p, (tau, mask) in zip([b1, b2], ref):
        got = thr(torch.tensor(p, dtype=torch.float64))
        assert float(thr.threshold) == pytest.approx(tau, rel=1e-12, abs=0)
        assert got.tolist() == mask.tolist()
        assert torch.equal(ref_lib(torch.tensor(p, dtype=torch.float64)), got)
        assert float(ref_lib.threshold) == float(thr.threshold)
    # by hand for alpha=0.5 (mean+std of b1 = 0.583333 + 0.265204 < 0.95, not clamped)
    if alpha == 0.5:
        m1, s1 = np.mean(b1), np.std(b1, ddof=1)
        tau1 = 0.5 * (m1 + s1) + 0.5 * (m1 - s1)  # = m1
        m2, s2 = np.mean(b2), np.std(b2, ddof=1)
        assert ref[0][0] == pytest.approx(tau1) and ref[1][0] == pytest.approx(
            0.5 * tau1 + 0.5 * (m2 - s2)
        )
    # the state round-trips through state_dict (it is checkpointed by the engine)
    clone = build_threshold("adaptive", 0.95, alpha, 10)
    clone.load_state_dict(thr.state_dict())
    b3 = torch.tensor([0.6, 0.7, 0.8], dtype=torch.float64)
    assert torch.equal(clone(b3), thr(b3)) and float(clone.threshold) == float(thr.threshold)


def test_adaptive_threshold_initial_value_is_clamped():
    p = [0.90, 0.99, 0.999, 0.5]  # mean + std > 0.95
    thr = build_threshold("adaptive", 0.95, 0.9, 10)
    thr(torch.tensor(p, dtype=torch.float64))
    mean, std = np.mean(p), np.std(p, ddof=1)
    assert mean + std > 0.95
    assert float(thr.threshold) == pytest.approx(0.9 * 0.95 + 0.1 * (mean - std), rel=1e-12)


def test_per_class_threshold_and_bad_kind():
    thr = build_threshold("per_class", 0.95, 0.5, 3)
    conf = torch.tensor([0.9, 0.5, 0.6, 0.8], dtype=torch.float64)
    pred = torch.tensor([0, 0, 1, 2])
    thr(conf, pred)
    tau = thr.threshold
    assert tau.shape == (3,)
    m0, s0 = 0.7, np.std([0.9, 0.5], ddof=1)
    assert float(tau[0]) == pytest.approx(0.5 * min(m0 + s0, 0.95) + 0.5 * (m0 - s0), rel=1e-12)
    assert float(tau[1]) == pytest.approx(0.6, rel=1e-12)  # one sample: std = 0
    with pytest.raises(ValueError, match="fixed, adaptive or per_class"):
        build_threshold("median", 0.95, 0.9, 3)


# ----------------------------------------------------------------------------- losses
def test_naive_loss_is_masked_cross_entropy_over_the_whole_batch():
    torch.manual_seed(1)
    model = LinTanh().double()
    x = torch.randn(6, 3, 2, 2, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 0, 2])
    labels = F.one_hot(y, 3).double()
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    loss = naive_loss(model, x, labels, mask)
    W1, b1 = _np(model.body.weight), _np(model.body.bias)
    W2, b2 = _np(model.head.weight), _np(model.head.bias)
    logits = np.tanh(_np(x).reshape(6, -1) @ W1.T + b1) @ W2.T + b2
    ce = -_log_softmax(logits)[np.arange(6), y.numpy()]
    ref = (ce * _np(mask)).sum() / 6  # divided by the whole batch, not by the mask count
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12, abs=0)
    # a bool mask gives the same value
    assert naive_loss(model, x, labels, mask.bool()).item() == pytest.approx(ref, rel=1e-12)


def _stochastic_student(seed=2, d=5):
    torch.manual_seed(seed)
    base = LinTanh(d=d).double()
    student = StochasticClassifier.from_classifier(base, sigma_init=0.1, num_classes=3)
    with torch.no_grad():  # move the stochastic layer away from its identity initialisation
        for p in student.stochastic.parameters():
            p.add_(0.7 * torch.randn_like(p))
    return student


def _by_hand_mu_sigma(student, x):
    W1, b1 = _np(student.backbone.body.weight), _np(student.backbone.body.bias)
    h = np.tanh(_np(x).reshape(x.shape[0], -1) @ W1.T + b1)
    lay = student.stochastic
    mu = h @ _np(lay.mu_head.weight).T + _np(lay.mu_head.bias)
    sigma = _softplus(h @ _np(lay.sigma_head.weight).T + _np(lay.sigma_head.bias)) + lay.eps
    return mu, sigma


@pytest.mark.parametrize("train", [False, True])
def test_robust_loss_matches_float64_hand_computation(train):
    student = _stochastic_student()
    student.train(train)
    n = 8
    x = torch.randn(n, 3, 2, 2, dtype=torch.float64)
    labels = F.one_hot(torch.tensor([0, 1, 2, 1, 0, 2, 2, 1]), 3).double()
    mask = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.float64)
    mu, sigma = _by_hand_mu_sigma(student, x)
    mean_log = np.log(sigma).mean(axis=1)
    margin = float(np.median(mean_log))  # the hinge is active for some rows, zero for others
    assert (mean_log < margin).any() and (mean_log > margin).any()
    lam = 0.3
    torch.manual_seed(9)
    loss, sig = robust_loss(student, x, labels, mask, lam, margin)
    if train:  # one sample per instance: z = mu + sigma * eps, eps the layer's N(0, I) draw
        torch.manual_seed(9)
        eps = _np(torch.randn(n, mu.shape[1], dtype=torch.float64))
        z = mu + sigma * eps
    else:  # the mean path
        z = mu
    logits = z @ _np(student.classifier.weight).T + _np(student.classifier.bias)
    ce = -(_np(labels) * _log_softmax(logits)).sum(1)
    hinge = np.maximum(0.0, margin - mean_log).mean()
    ref = (ce * _np(mask)).sum() / n + lam * hinge
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12, abs=0)
    np.testing.assert_allclose(_np(sig), sigma, rtol=1e-12, atol=0)
    # the outer loss: mean log(sigma + 1e-7), through a ReLU when asked
    ref_outer = np.log(sigma + 1e-7).mean()
    assert outer_log_sigma(sig, False).item() == pytest.approx(ref_outer, rel=1e-12)
    assert outer_log_sigma(sig, True).item() == pytest.approx(max(ref_outer, 0.0), abs=1e-15)
    # the hinge must matter: with lambda = 0 the value is the CE alone
    torch.manual_seed(9)
    ce_only = robust_loss(student, x, labels, mask, 0.0, margin)[0]
    assert float(ce_only.detach()) == pytest.approx((ce * _np(mask)).sum() / n, rel=1e-12)


# ----------------------------------------------------------------------------- build_student
def _eval_logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


def test_build_student_naive_is_an_independent_copy():
    torch.manual_seed(0)
    labeler = DigitCNN(num_classes=3, width=1 / 32, image_size=8, mixstyle=True).double()
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    labeler.train()
    labeler(x)  # non-trivial running statistics
    student = build_student(labeler, "naive", 3, 0.1)
    assert type(student) is DigitCNN
    assert isinstance(student.mixstyle, nn.Identity) and isinstance(labeler.mixstyle, MixStyle)
    torch.testing.assert_close(_eval_logits(student, x), _eval_logits(labeler, x), rtol=0, atol=0)
    lab_ptrs = {p.data_ptr() for p in labeler.parameters()}
    assert all(p.data_ptr() not in lab_ptrs for p in student.parameters())
    before = copy.deepcopy(labeler.state_dict())
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, labeler.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("variant", ["robust", "bort2"])
def test_build_student_stochastic_starts_at_the_labelers_logits(variant):
    torch.manual_seed(0)
    labeler = DigitCNN(num_classes=3, width=1 / 32, image_size=8, mixstyle=True).double()
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    labeler.train()
    labeler(x)
    student = build_student(labeler, variant, 3, 0.2, sigma_head="linear")
    assert isinstance(student, StochasticClassifier)
    assert isinstance(student.backbone.mixstyle, nn.Identity)
    assert isinstance(labeler.mixstyle, MixStyle)  # the labeler keeps its MixStyle
    d = labeler.feature_dim
    assert student.latent_dim == d and student.classifier.out_features == 3
    lab_logits = _eval_logits(labeler, x)
    torch.testing.assert_close(_eval_logits(student, x), lab_logits, rtol=1e-12, atol=1e-12)
    _, sigma = student.forward_with_sigma(x)
    # sigma = softplus(bias) + eps: sigma_init up to the layer's eps (1e-6)
    torch.testing.assert_close(sigma, torch.full_like(sigma, 0.2), rtol=0, atol=2e-6)
    # independent parameters
    lab_ptrs = {p.data_ptr() for p in labeler.parameters()}
    assert all(p.data_ptr() not in lab_ptrs for p in student.parameters())
    # in training the stochastic layer samples: logits differ from the mu path
    student.train()
    torch.manual_seed(1)
    assert not torch.allclose(student(x), lab_logits)


# ----------------------------------------------------------------------------- hypergradient
GSEED = 3  # the hyper step's generator: seeds of the replayed forward passes, then Gumbel noise


class _WithSigma(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m.forward_with_sigma(x)


def _gumbel_hard(logits, gen):
    """Straight-through Gumbel-softmax written independently of hypergrad.labels."""
    u = torch.rand(logits.shape, generator=gen, dtype=logits.dtype)
    y_soft = torch.softmax(logits - torch.log(-torch.log(u)), dim=1)
    y_hard = F.one_hot(y_soft.argmax(1), logits.shape[1]).to(logits.dtype)
    return y_hard + y_soft - y_soft.detach()


class DenseReference:
    """BORT²'s inner/outer losses (library convention) as functions of flat float64 vectors.

    The draws are pinned as the hyper step pins them: the outer loss and M_psi's forward in the
    inner loss both run under ``manual_seed(seed_m)``, F_theta's under ``manual_seed(seed_f)``,
    and the Gumbel noise comes from the generator after the seeds were drawn from it.
    """

    def __init__(self, student, labeler, batch, lam, margin, tau):
        self.student, self.labeler, self.batch = _WithSigma(student), labeler, batch
        self.lam, self.margin, self.tau = lam, margin, tau
        self.s_names = [n for n, p in student.named_parameters() if p.requires_grad]
        self.s_shapes = [p.shape for n, p in student.named_parameters() if p.requires_grad]
        self.l_names = [n for n, p in labeler.named_parameters() if p.requires_grad]
        self.l_shapes = [p.shape for n, p in labeler.named_parameters() if p.requires_grad]
        self.s_bufs = {n: b.detach().clone() for n, b in student.named_buffers()}
        self.l_bufs = {n: b.detach().clone() for n, b in labeler.named_buffers()}
        self.psi0 = torch.cat([p.detach().reshape(-1) for p in student.parameters()])
        self.theta0 = torch.cat([p.detach().reshape(-1) for p in labeler.parameters()])

    @staticmethod
    def _unflat(vec, names, shapes):
        out, i = {}, 0
        for n, s in zip(names, shapes):
            k = math.prod(s)
            out[n] = vec[i : i + k].view(s)
            i += k
        return out

    def _student(self, psi, x):
        torch.manual_seed(self.batch["seed_m"])
        params = {f"m.{n}": v for n, v in self._unflat(psi, self.s_names, self.s_shapes).items()}
        params.update({f"m.{n}": b.clone() for n, b in self.s_bufs.items()})
        return functional_call(self.student, params, (x,))

    def outer(self, psi):
        _, sigma = self._student(psi, self.batch["x"])
        return torch.log(sigma + 1e-7).mean()

    def inner(self, psi, theta):
        params = self._unflat(theta, self.l_names, self.l_shapes)
        params.update({n: b.clone() for n, b in self.l_bufs.items()})
        torch.manual_seed(self.batch["seed_f"])
        t_logits = functional_call(self.labeler, params, (self.batch["x_weak"],))
        mask = (t_logits.detach().softmax(1).amax(1) >= self.tau).to(t_logits.dtype)
        gen = torch.Generator()
        gen.set_state(self.batch["gumbel_state"])
        y = _gumbel_hard(t_logits, gen)
        logits, sigma = self._student(psi, self.batch["x"])
        n = logits.shape[0]
        ce = -(y * torch.log_softmax(logits, 1)).sum(1) * mask
        hinge = torch.relu(self.margin - torch.log(sigma + 1e-7).mean(1)).mean()
        return ce.sum() / n + self.lam * hinge

    def compute(self):
        p = self.psi0.clone().requires_grad_(True)
        out = self.outer(p)
        (self.b,) = torch.autograd.grad(out, p)
        self.outer_value = float(out.detach())
        self.inner_value = float(self.inner(self.psi0, self.theta0))
        self.H = torch.autograd.functional.hessian(lambda q: self.inner(q, self.theta0), self.psi0)

        def grad_psi(theta):
            q = self.psi0.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(self.inner(q, theta), q, create_graph=True)
            return g

        # J[i, j] = d^2 L / d psi_i d theta_j; the mixed product of the library is J^T v
        self.J = torch.autograd.functional.jacobian(grad_psi, self.theta0)
        return self

    def neumann(self, alpha, steps):
        v, acc = self.b.clone(), self.b.clone()
        eye = torch.eye(len(v), dtype=v.dtype)
        for _ in range(steps):
            v = (eye - alpha * self.H) @ v
            acc = acc + v
        return -self.J.T @ (alpha * acc)

    def exact(self, damping):
        eye = torch.eye(len(self.b), dtype=self.b.dtype)
        return -self.J.T @ torch.linalg.solve(self.H + damping * eye, self.b)


def _settings(alpha=5e-5, steps=3, lr=5e-5, clip=50.0):
    """The library convention (hypergrad.Neumann, true CE), no ReLU, F_theta in eval mode."""
    return Step2Config(
        hyper=HyperConfig(
            convention="library",
            outer_relu=False,
            labeler_mode="eval",
            steps=steps,
            alpha=alpha,
            lr=lr,
            clip=clip,
        )
    )


@pytest.fixture(scope="module")
def tiny_problem():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    labeler = TinyNet().double()
    with torch.no_grad():  # non-trivial running statistics: the labeler labels in eval mode
        labeler.bn.running_mean.normal_()
        labeler.bn.running_var.uniform_(0.5, 2.0)
    labeler.eval()
    student = build_student(labeler, "bort2", 3, 0.1, sigma_head="linear")
    student.train()
    with torch.no_grad():
        for p in student.stochastic.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(10, 3, 2, 2, dtype=torch.float64)
    x_weak = x + 0.1 * torch.randn_like(x)
    with torch.no_grad():
        tau = float(labeler(x_weak).softmax(1).amax(1).median())  # masks some rows
    threshold = build_threshold("fixed", tau, 0.999, 3)
    updater = BilevelLabelUpdater(student, labeler, threshold, _settings())
    batch, _ = updater.batches(x, x_weak, torch.Generator().manual_seed(GSEED))
    ref = DenseReference(student, labeler, batch, 0.1, 4.0, tau).compute()
    return updater, batch, ref


def _compute(updater, batch, solver=None, seed_shift=0):
    if solver is not None:
        updater.step.method = hg.Implicit(solver=solver)
    b = {**batch, "seed_m": batch["seed_m"] + seed_shift}
    hyper, info = updater.step.compute(b)
    return torch.cat([h.reshape(-1) for h in hyper]).double(), info


def test_dense_reference_sees_the_same_draws_as_the_hyperstep(tiny_problem):
    updater, batch, ref = tiny_problem
    hyper, info = _compute(updater, batch, hg.Neumann(maxiter=3, alpha=5e-5))
    assert info.inner_loss == pytest.approx(ref.inner_value, rel=1e-12)
    assert info.outer_loss == pytest.approx(ref.outer_value, rel=1e-12)
    assert info.outer_grad_norm == pytest.approx(float(ref.b.norm()), rel=1e-10)
    assert info.direct_norm == 0.0  # the outer loss does not involve F_theta
    assert torch.allclose(ref.H, ref.H.T, rtol=0, atol=1e-12)
    # the inner problem's Hessian is indefinite and singular here (softmax shift invariance)
    ev = torch.linalg.eigvalsh(ref.H)
    assert ev[0] < 0 < ev[-1]


@pytest.mark.parametrize("steps,alpha_kind", [(3, "paper"), (3, "large"), (6, "large")])
def test_bort2_neumann_hypergradient_equals_closed_form_series(tiny_problem, steps, alpha_kind):
    updater, batch, ref = tiny_problem
    lam_abs = float(torch.linalg.eigvalsh(ref.H).abs().max())
    # "large": the H-terms change the result by a few percent (terms cannot grow > 4%)
    alpha = 5e-5 if alpha_kind == "paper" else 0.04 / lam_abs
    hyper, info = _compute(updater, batch, hg.Neumann(maxiter=steps, alpha=alpha))
    assert not info.solve.diverged and info.solve.iterations == steps
    expected = ref.neumann(alpha, steps)
    assert _rel(hyper, expected) < 1e-8
    assert info.hypergrad_norm == pytest.approx(float(expected.norm()), rel=1e-8)
    # the comparison can fail: one term fewer or the wrong sign is far outside the tolerance
    assert _rel(hyper, ref.neumann(alpha, steps - 1)) > 1e-3
    assert _rel(hyper, -expected) > 1.0
    if alpha_kind == "large":  # and H matters at this alpha
        assert _rel(ref.neumann(alpha, steps), -ref.J.T @ (alpha * (steps + 1) * ref.b)) > 1e-3


def test_bort2_exact_hypergradient_equals_dense_solve(tiny_problem):
    updater, batch, ref = tiny_problem
    ev = torch.linalg.eigvalsh(ref.H)
    damping = float(-ev[0]) + 1.0  # H is singular and indefinite: H + damping I is SPD
    hyper, info = _compute(updater, batch, hg.Exact(damping=damping))
    expected = ref.exact(damping)
    assert _rel(hyper, expected) < 1e-8
    assert info.solve.residual < 1e-10
    # the result depends on H (not just on the damping) and on the draws
    assert _rel(hyper, -ref.J.T @ (ref.b / damping)) > 1e-2
    other, _ = _compute(updater, batch, hg.Exact(damping=damping), seed_shift=1)
    assert _rel(other, expected) > 1e-4


def test_bort2_hypergradient_is_deterministic_given_seeds(tiny_problem):
    updater, batch, _ = tiny_problem
    a, _ = _compute(updater, batch, hg.Neumann(maxiter=3, alpha=5e-5))
    b, _ = _compute(updater, batch, hg.Neumann(maxiter=3, alpha=5e-5))
    assert torch.equal(a, b)


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("clip_factor", [0.5, 10.0])
def test_bilevel_update_changes_only_the_labeler_by_minus_lr_clipped_hypergradient(clip_factor):
    torch.manual_seed(0)
    labeler = DigitCNN(num_classes=3, width=1 / 32, image_size=8).double()
    x = torch.randn(12, 3, 8, 8, dtype=torch.float64)
    labeler.train()
    for _ in range(3):
        labeler(x + torch.randn_like(x))  # non-trivial running statistics
    labeler.eval()
    student = build_student(labeler, "bort2", 3, 0.1, sigma_head="linear")
    student.train()
    x_weak = x + 0.05 * torch.randn_like(x)
    threshold = build_threshold("fixed", 0.0, 0.999, 3)
    # a larger Neumann alpha than the paper's 5e-5, so that the step is far above rounding
    probe = BilevelLabelUpdater(student, labeler, threshold, _settings(alpha=1e-2))
    batch, _ = probe.batches(x, x_weak, torch.Generator().manual_seed(GSEED))
    g, info = _compute(probe, batch)
    g_norm = float(g.norm())
    assert g_norm > 0 and not info.solve.diverged
    lr, clip = 1.0, clip_factor * g_norm
    updater = BilevelLabelUpdater(
        student, labeler, threshold, _settings(alpha=1e-2, lr=lr, clip=clip)
    )
    s_before, l_before = _state(student), _state(labeler)
    theta_before = torch.cat([p.detach().reshape(-1).clone() for p in labeler.parameters()])
    info = updater(x, x_weak, torch.Generator().manual_seed(GSEED))
    # the student (parameters and BatchNorm buffers) is bit-identical, its .grad untouched
    s_after = student.state_dict()
    assert all(torch.equal(s_after[k], v) for k, v in s_before.items())
    assert all(p.grad is None for p in student.parameters())
    # the labeler's buffers are bit-identical (labeler_mode=eval); only its parameters moved
    l_after = labeler.state_dict()
    param_names = {n for n, _ in labeler.named_parameters()}
    buffers = [k for k in l_before if k not in param_names]
    assert buffers and all(torch.equal(l_after[k], l_before[k]) for k in buffers)
    theta_after = torch.cat([p.detach().reshape(-1) for p in labeler.parameters()])
    scale = min(1.0, clip / g_norm)
    assert info.clipped == (clip_factor < 1)
    assert info.hypergrad_norm == pytest.approx(g_norm, rel=1e-10)
    step = -lr * scale * g
    # rtol 1e-7: HyperStep scales by clip / (norm + 1e-12), and norm is ~3e-5 here
    torch.testing.assert_close(theta_after - theta_before, step, rtol=1e-7, atol=1e-16)
    assert _rel(theta_after - theta_before, step) < 1e-7
    assert float((theta_after - theta_before).norm()) == pytest.approx(
        lr * min(clip, g_norm), rel=1e-9
    )
