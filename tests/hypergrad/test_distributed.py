"""Distributed hypergradients: two gloo processes on the CPU against one process on the whole batch.

With losses that are means over equal-sized local batches, ``distributed="exact"`` must equal the
single-process hypergradient on the global batch (every product is all-reduced), and
``distributed="local"`` must equal the average of the per-shard hypergradients.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hypergrad as hg

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = torch.randn(40, generator=g, dtype=torch.float64)
    xv = torch.randn(30, 5, generator=g, dtype=torch.float64)
    yv = torch.randn(30, generator=g, dtype=torch.float64)
    lam = torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    return x, y, xv, yv, lam


def _losses(x, y, xv, yv):
    def inner(w, lam):
        return 0.5 * ((x @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()

    def outer(w, lam):
        return 0.5 * ((xv @ w - yv) ** 2).mean() + 0.01 * lam.sum()

    return inner, outer


def _solution(x, y, lam):
    a = x.T @ x / len(y) + torch.diag(lam)
    return torch.linalg.solve(a, x.T @ y / len(y))


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x, y, xv, yv, lam = _problem()
        w = _solution(x, y, lam)  # the global inner solution, known to every rank
        sl = slice(rank * 20, (rank + 1) * 20)
        slv = slice(rank * 15, (rank + 1) * 15)
        inner, outer = _losses(x[sl], y[sl], xv[slv], yv[slv])
        for mode in ("exact", "local"):
            g, info = hg.implicit_grad(
                inner, outer, w, lam, solver=hg.CG(tol=1e-13, maxiter=100), distributed=mode
            )
            torch.save(g, os.path.join(out_dir, f"{mode}_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_process_exact_and_local(tmp_path):
    init_file = str(tmp_path / "init")
    mp.spawn(_worker, args=(2, init_file, str(tmp_path)), nprocs=2, join=True)
    x, y, xv, yv, lam = _problem()
    w = _solution(x, y, lam)
    # exact: equals one process on the global batch (closed form in float64)
    a = x.T @ x / len(y) + torch.diag(lam)
    grad_w = xv.T @ (xv @ w - yv) / len(yv)
    expected = -w * torch.linalg.solve(a, grad_w) + 0.01
    for rank in range(2):
        g = torch.load(tmp_path / f"exact_{rank}.pt", weights_only=True)
        torch.testing.assert_close(g, expected, rtol=1e-9, atol=1e-12)
    # local: the mean of each shard's own implicit hypergradient at the same w
    per_shard = []
    for rank in range(2):
        sl, slv = slice(rank * 20, (rank + 1) * 20), slice(rank * 15, (rank + 1) * 15)
        a_r = x[sl].T @ x[sl] / 20 + torch.diag(lam)
        g_r = xv[slv].T @ (xv[slv] @ w - yv[slv]) / 15
        per_shard.append(-w * torch.linalg.solve(a_r, g_r) + 0.01)
    expected_local = (per_shard[0] + per_shard[1]) / 2
    for rank in range(2):
        g = torch.load(tmp_path / f"local_{rank}.pt", weights_only=True)
        torch.testing.assert_close(g, expected_local, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(expected_local, expected)  # the two modes really differ


def test_single_process_modes_equal_plain():
    x, y, xv, yv, lam = _problem(1)
    inner, outer = _losses(x, y, xv, yv)
    w = _solution(x, y, lam)
    plain, _ = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact())
    for mode in ("exact", "local"):
        g, _ = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact(), distributed=mode)
        torch.testing.assert_close(g, plain, rtol=0, atol=0)


def test_bad_mode():
    x, y, xv, yv, lam = _problem(2)
    inner, outer = _losses(x, y, xv, yv)
    with pytest.raises(hg.HypergradValueError, match="distributed must be"):
        hg.implicit_grad(inner, outer, _solution(x, y, lam), lam, distributed="ring")
