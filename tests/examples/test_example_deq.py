"""Fast checks of examples/deq_fashion_mnist.py: the DEQ gradients (implicit by GMRES and by the
adjoint fixed-point iteration, torchdeq's, unrolled) against central finite differences and a
dense per-example reference on a tiny float64 model, the memory meter, and a one-epoch run on a
Fashion-MNIST subset (skipped without ``dataset-fashion-mnist``)."""

from __future__ import annotations

import json
import os

import _fashion_mnist as fm
import deq_fashion_mnist as deq
import pytest
import torch
import torch.nn.functional as F

needs_fmnist = pytest.mark.skipif(
    not fm.available(fm.DEFAULT_DIR),
    reason=f"Fashion-MNIST not in {fm.DEFAULT_DIR}: apt-get install dataset-fashion-mnist",
)

D_IN, WIDTH, CLASSES, BATCH = 7, 5, 3, 4
TIGHT = ["--f-tol", "1e-13", "--f-maxiter", "500", "--b-tol", "1e-12", "--b-maxiter", "300"]


def tiny(seed: int = 0, kappa: float = 0.9):
    """A float64 DEQ with 5 hidden units, 7 inputs, 3 classes, batch 4; ``V`` is scaled so that
    the cap ``κ`` is active (``W = κ V / ||V||₂``), which the gradient then goes through."""
    cfg = deq.parse_args(TIGHT + ["--kappa", str(kappa)])
    p = deq.init_params(WIDTH, d_in=D_IN, classes=CLASSES, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        p["V"].mul_(3.0)  # ||V||₂ ≈ 1.5 > κ
        p["U"].mul_(3.0)
        p["b"].copy_(0.3 * torch.randn(WIDTH, generator=g, dtype=torch.float64))
        p["c"].copy_(0.1 * torch.randn(CLASSES, generator=g, dtype=torch.float64))
    x = torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return cfg, p, x, y


def solved_loss(cfg, p, x, y) -> float:
    """The loss at the fixed point solved to 1e-14 (no autograd): what finite differences need."""
    with torch.no_grad():
        W, u = deq.hparams_of(p, x, cfg.kappa)
        z, info = deq.hg.inner.FixedPoint(deq.T, maxiter=500, tol=1e-14).solve(
            torch.zeros_like(u), (W, u)
        )
        assert info.converged
        return float(F.cross_entropy(deq.readout(p, z), y))


def grad_of(name: str, cfg, p, x, y) -> dict[str, torch.Tensor]:
    method = deq.make_method(name, cfg) if isinstance(name, str) else name
    g, _ = deq.method_grad(method, p, x, y, torch.float64)
    return g


def rel(a: dict, b: dict) -> float:
    fa, fb = deq.flat_grad(a), deq.flat_grad(b)
    return float((fa - fb).norm() / fb.norm())


def test_implicit_grad_matches_central_differences():
    """∂L/∂(V, U, b) through the fixed point (Anderson + GMRES) against central differences of
    the re-solved loss, coordinate by coordinate (ε = 1e-6), and ∂L/∂(R, c) likewise."""
    cfg, p, x, y = tiny()
    assert float(torch.linalg.matrix_norm(p["V"].detach(), ord=2)) > cfg.kappa  # the cap is active
    g = grad_of("hypergrad", cfg, p, x, y)
    eps = 1e-6
    for name in deq.PARAM_NAMES:
        fd = torch.zeros_like(p[name])
        flat = fd.view(-1)
        for i in range(flat.numel()):
            q = {k: v.detach().clone() for k, v in p.items()}
            q[name].view(-1)[i] += eps
            plus = solved_loss(cfg, q, x, y)
            q[name].view(-1)[i] -= 2 * eps
            minus = solved_loss(cfg, q, x, y)
            flat[i] = (plus - minus) / (2 * eps)
        err = float((g[name] - fd).norm() / fd.norm())
        assert err < 1e-7, (name, err)


def test_implicit_grad_without_cap_matches_central_differences_in_W():
    """With κ large the cap is inactive and ``V`` is ``W`` itself: ∂L/∂W directly."""
    cfg, p, x, y = tiny(seed=1, kappa=50.0)
    with torch.no_grad():
        p["V"].mul_(0.9 / float(torch.linalg.matrix_norm(p["V"], ord=2)))
    assert torch.equal(deq.weight(p["V"], cfg.kappa), p["V"])
    g = grad_of("hypergrad", cfg, p, x, y)["V"]
    eps, fd = 1e-6, torch.zeros(WIDTH, WIDTH, dtype=torch.float64)
    for i in range(WIDTH):
        for j in range(WIDTH):
            q = {k: v.detach().clone() for k, v in p.items()}
            q["V"][i, j] += eps
            plus = solved_loss(cfg, q, x, y)
            q["V"][i, j] -= 2 * eps
            fd[i, j] = (plus - solved_loss(cfg, q, x, y)) / (2 * eps)
    assert float((g - fd).norm() / fd.norm()) < 1e-7


def test_dense_reference_and_every_implicit_variant_agree():
    """The dense per-example adjoint (the script's reference) against Anderson + GMRES, Anderson
    + Neumann(α = 1) and, when installed, torchdeq, all in float64 with tight tolerances."""
    cfg, p, x, y = tiny(seed=2)
    ref = deq.reference_grad(p, x, y, cfg.kappa)
    assert ref["fixed_point_residual"] < 1e-13
    names = ["hypergrad", "hypergrad-neumann"] + (["torchdeq"] if deq.torchdeq else [])
    for name in names:
        err = rel(grad_of(name, cfg, p, x, y), ref["grad"])
        assert err < 1e-9, (name, err)
    cmp = deq.compare(grad_of("hypergrad", cfg, p, x, y), ref["grad"])
    assert cmp["cosine"] > 1 - 1e-12 and set(cmp) >= {f"rel_error_{k}" for k in "VUbRc"}


def test_torchdeq_gradient_matches_reference():
    pytest.importorskip("torchdeq")
    cfg, p, x, y = tiny(seed=3)
    ref = deq.reference_grad(p, x, y, cfg.kappa)["grad"]
    assert rel(grad_of("torchdeq", cfg, p, x, y), ref) < 1e-9


def test_unrolled_gradient_converges_to_implicit():
    """Backprop through K Picard steps: far from the implicit gradient at K = 2, equal to it (to
    1e-10) once K is long enough for the forward iteration to converge."""
    cfg, p, x, y = tiny(seed=4)
    implicit = grad_of("hypergrad", cfg, p, x, y)
    short = rel(grad_of(deq.UnrolledMethod(cfg, steps=2), cfg, p, x, y), implicit)
    long_ = rel(grad_of(deq.UnrolledMethod(cfg, steps=400), cfg, p, x, y), implicit)
    assert short > 1e-2 and long_ < 1e-10, (short, long_)


def test_peak_tensor_memory_meter():
    """The meter counts live storages allocated inside the block (views once), not older ones,
    and its peak of an unrolled step grows with K while the implicit step's does not."""
    old = torch.zeros(10_000)
    with deq.PeakTensorMemory() as mem:
        a = torch.ones(1000, dtype=torch.float64)  # 8,000 bytes
        b = a.view(10, 100)  # a view: no new storage
        c = a * 2  # 8,000 more
        del a, b, c
        d = torch.ones(500, dtype=torch.float64)  # 4,000, after the others were freed
        old.add_(1)  # in place on an older tensor: counted once at most
    assert 16_000 <= mem.peak <= 16_100, mem.peak
    del d
    cfg, p, x, y = tiny(seed=5)
    peaks = {}
    for k in (10, 100):
        _, peaks[k] = deq.method_grad(deq.UnrolledMethod(cfg, steps=k), p, x, y, torch.float64)
    assert peaks[100] > 3 * peaks[10], peaks


def test_missing_data_exits_with_code_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        deq.main(["--quick", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_run_on_synthetic_data_without_torchdeq(monkeypatch, tmp_path):
    """``run`` end to end on synthetic separable data (no Fashion-MNIST needed), with torchdeq
    made unavailable: the variant is skipped with a note, the others report every field."""
    g = torch.Generator().manual_seed(0)
    centers = 0.3 * torch.randn(10, 784, generator=g)

    def fake(data_dir, seed, n_train, n_test):
        ytr, yte = torch.arange(n_train) % 10, torch.arange(n_test) % 10
        noise = lambda n: 0.1 * torch.randn(n, 784, generator=g)  # noqa: E731
        return {"xtr": centers[ytr] + noise(n_train), "ytr": ytr,
                "xte": centers[yte] + noise(n_test), "yte": yte}  # fmt: skip

    monkeypatch.setattr(deq, "load_data", fake)
    monkeypatch.setattr(deq, "torchdeq", None)
    args = deq.parse_args(
        ["--quick", "--n-train", "300", "--n-test", "200", "--variants", "unrolled,torchdeq",
         "--grad-batch", "16", "--grad-unroll", "", "--no-progress", "--out", str(tmp_path)]
    )  # fmt: skip
    res = deq.run(args)
    assert [r["variant"] for r in res["variants"]] == ["unrolled"]
    assert any("torchdeq" in n for n in res["notes"])
    assert res["variants"][0]["test_accuracy"] > 0.5
    json.dumps(res)  # serialisable as saved


@needs_fmnist
def test_quick_run_on_fashion_mnist(tmp_path):
    """One epoch on 1,000 training images (width 32), tested on 1,000: every variant well above
    chance (0.1; measured 0.61 for each at seed 0), gradients that agree with the reference, and
    the JSON and plot written under --out."""
    res = deq.main(
        ["--quick", "--no-progress", "--out", str(tmp_path), "--grad-batch", "32",
         "--grad-unroll", "50"]
    )  # fmt: skip
    names = [r["variant"] for r in res["variants"]]
    expected = ["hypergrad", "hypergrad-neumann", "unrolled"] + (["torchdeq"] * bool(deq.torchdeq))
    assert names == expected
    for r in res["variants"]:
        assert r["test_accuracy"] > 0.4, r
        assert len(r["test_accuracy_per_epoch"]) == 1 and r["median_epoch_time_s"] > 0
        assert r["peak_step_memory_bytes"] > 0 and r["spectral_norm_W"] <= 0.9 + 1e-5
        assert r["mean_forward_residual"] < 1e-3
    for row in res["gradient_agreement"]["rows"]:
        assert row["cosine"] > 0.999 and row["rel_error"] < 1e-2, row
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["variants"][0]["test_accuracy"] == res["variants"][0]["test_accuracy"]
    assert os.path.isfile(tmp_path / "deq_fashion_mnist.png")
