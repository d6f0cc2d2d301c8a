"""Pytree helpers: round trips, leaf paths and wide accumulation of half-precision reductions."""

import gc
import weakref

import numpy as np
import pytest
import torch

import hypergrad as hg
from hypergrad.tree import (
    leaf_paths,
    tree_all_finite,
    tree_axpy,
    tree_flatten,
    tree_norm,
    tree_numel,
    tree_ravel,
    tree_sq_norm,
    tree_unflatten,
    tree_unravel,
    tree_vdot,
)


def _nested():
    a, b, c, d, e = (
        torch.randn(2, 3),
        torch.randn(4),
        torch.randn(()),
        torch.randn(1, 2),
        torch.randn(5),
    )
    tree = {"w": a, "blocks": (b, [c, {"k": d}]), "z": [e]}
    return tree, [a, b, c, d, e]


def _assert_same_tree(x, y):
    assert type(x) is type(y)
    if isinstance(x, torch.Tensor):
        assert x is y
    elif isinstance(x, dict):
        assert list(x.keys()) == list(y.keys())
        for k in x:
            _assert_same_tree(x[k], y[k])
    else:
        assert len(x) == len(y)
        for u, v in zip(x, y):
            _assert_same_tree(u, v)


def test_flatten_unflatten_round_trip_nested():
    tree, expected = _nested()
    leaves, spec = tree_flatten(tree)
    # depth-first, dict insertion order, leaves are the very same tensor objects
    assert len(leaves) == len(expected) == spec.num_leaves == 5
    assert all(a is b for a, b in zip(leaves, expected))
    rebuilt = tree_unflatten(spec, leaves)
    _assert_same_tree(rebuilt, tree)
    # rebuilding with other leaves keeps the structure (tuple stays tuple, list stays list)
    new = [t * 2 for t in leaves]
    other = tree_unflatten(spec, new)
    assert isinstance(other["blocks"], tuple) and isinstance(other["blocks"][1], list)
    assert isinstance(other["z"], list)
    torch.testing.assert_close(other["blocks"][1][1]["k"], 2 * expected[3])
    # the spec of the rebuilt tree is the same spec
    assert tree_flatten(other)[1] == spec


def test_flatten_single_tensor_and_specs_differ():
    t = torch.ones(3)
    leaves, spec = tree_flatten(t)
    assert leaves[0] is t and spec.kind == "leaf"
    assert tree_unflatten(spec, leaves) is t
    s_tuple = tree_flatten((t, t))[1]
    s_list = tree_flatten([t, t])[1]
    s_dict = tree_flatten({"a": t, "b": t})[1]
    assert s_tuple != s_list and s_tuple != s_dict and s_list != s_dict
    assert tree_flatten({"b": t, "a": t})[1] != s_dict  # key order is part of the structure


def test_unflatten_too_many_leaves_raises():
    _, spec = tree_flatten((torch.ones(1), torch.ones(1)))
    with pytest.raises(ValueError, match="too many leaves"):
        tree_unflatten(spec, [torch.ones(1)] * 3)


def test_flatten_rejects_non_tensor_leaf_with_path():
    with pytest.raises(hg.HypergradTypeError, match=r"params\['b'\]\[1\].*float"):
        tree_flatten({"a": torch.ones(1), "b": (torch.ones(1), 3.0)}, "params")


def test_leaf_paths():
    tree, _ = _nested()
    _, spec = tree_flatten(tree)
    assert leaf_paths(spec, "p") == [
        "p['w']",
        "p['blocks'][0]",
        "p['blocks'][1][0]",
        "p['blocks'][1][1]['k']",
        "p['z'][0]",
    ]
    assert leaf_paths(tree_flatten(torch.ones(1))[1], "x") == ["x"]


def test_ravel_unravel_round_trip_and_numel():
    tree, leaves = _nested()
    flat = tree_ravel(tuple(leaves))
    assert flat.shape == (tree_numel(tuple(leaves)),) == (6 + 4 + 1 + 2 + 5,)
    torch.testing.assert_close(flat, torch.cat([t.reshape(-1) for t in leaves]))
    back = tree_unravel(flat, tuple(leaves))
    for a, b in zip(back, leaves):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert tree_ravel(tuple(leaves), torch.float64).dtype == torch.float64


def test_vdot_norm_axpy_match_flat_float64():
    g = torch.Generator().manual_seed(3)
    x = tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in [(3, 2), (5,), ()])
    y = tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in [(3, 2), (5,), ()])
    fx = torch.cat([t.reshape(-1) for t in x])
    fy = torch.cat([t.reshape(-1) for t in y])
    assert float(tree_vdot(x, y)) == pytest.approx(float(fx @ fy), rel=1e-14)
    assert float(tree_norm(x)) == pytest.approx(float(torch.linalg.norm(fx)), rel=1e-14)
    z = tree_axpy(-0.7, x, y)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in z]), fy - 0.7 * fx)


def test_vdot_half_accumulates_in_float32():
    n = 100_000
    a = torch.full((n // 2,), 1e-2, dtype=torch.float16)
    b = torch.full((n - n // 2,), 1e-2, dtype=torch.float16)
    ones = (torch.ones_like(a), torch.ones_like(b))
    exact = float(a.double().sum() + b.double().sum())  # sum of the half-rounded values
    got = tree_vdot((a, b), ones)
    assert got.dtype in (torch.float32, torch.float64)
    assert abs(float(got) - exact) / exact < 1e-3
    # a naive running sum in half precision stalls far below (it cannot add 0.01 to 32)
    naive = float(np.cumsum(np.full(n, 1e-2, dtype=np.float16), dtype=np.float16)[-1])
    assert abs(naive - exact) / exact > 0.5
    # the norm also accumulates wide: sqrt(n * 0.01^2) = sqrt(n) * 0.01
    nrm = float(tree_norm((a, b)))
    ref = float(torch.cat([a, b]).double().pow(2).sum().sqrt())
    assert abs(nrm - ref) / ref < 1e-3


def test_vdot_long_float32_leaf_is_pairwise_accurate():
    # one BLAS dot over 10^6 float32 elements errs by ~1e-6 relative, enough to slow float32 CG;
    # tree_vdot sums 64k-element chunks in float64 and must stay near float64 accuracy
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1_000_003, generator=g) + 0.3
    b = torch.randn(1_000_003, generator=g) + 0.3
    ref = float(torch.dot(a.double(), b.double()))
    got = tree_vdot((a, b[:5]), (b, a[:5]))
    ref += float(torch.dot(a[:5].double(), b[:5].double()))
    assert got.dtype == torch.float32
    assert abs(float(got) - ref) / abs(ref) < 1e-7
    assert float(tree_sq_norm((a,))) == pytest.approx(float(a.double().pow(2).sum()), rel=1e-7)


def test_all_finite():
    assert tree_all_finite((torch.ones(2), torch.zeros(3)))
    assert not tree_all_finite((torch.ones(2), torch.tensor([0.0, float("nan")])))
    assert not tree_all_finite((torch.tensor([float("inf")]),))


def _cyclic_garbage(fn):
    """Run ``fn`` with the cyclic collector off; return the tensors that only it could free."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        return [o for o in gc.garbage if torch.is_tensor(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_tree_functions_create_no_reference_cycles():
    """A nested self-recursive helper is a reference cycle that keeps the leaves alive until the
    cyclic collector runs (truncated unrolling held ~0.5 MiB per inner step that way)."""
    box = [torch.ones(3)]
    ref = weakref.ref(box[0])

    def use():
        t = box[0]
        leaves, spec = tree_flatten({"a": t, "b": (t, [t])}, "p")
        tree_unflatten(spec, leaves)
        leaf_paths(spec, "p")

    assert _cyclic_garbage(use) == []
    box.clear()
    assert ref() is None  # freed by reference counting alone


def test_truncated_unrolling_leaves_no_tensor_to_the_cyclic_collector():
    import torchopt

    x, y = torch.randn(32, 4), torch.randn(32)

    def run():
        hg.unrolled_grad(
            lambda p, h: ((x @ p["w"] - y) ** 2).mean() + h * (p["w"] ** 2).sum(),
            lambda p, h: ((x @ p["w"] - y) ** 2).mean(),
            {"w": torch.zeros(4)}, torch.tensor(0.1), steps=12,
            optimizer=torchopt.sgd(lr=0.1), truncate=3,
        )  # fmt: skip
        hg.implicit_grad(
            lambda p, h: ((x @ p["w"] - y) ** 2).mean() + h * (p["w"] ** 2).sum(),
            lambda p, h: ((x @ p["w"] - y) ** 2).mean(),
            {"w": torch.zeros(4)}, torch.tensor(0.1), solver=hg.CG(maxiter=5),
        )  # fmt: skip

    assert _cyclic_garbage(run) == []


def _leaves(dtype, sizes=((300, 7), (7,), (1000,), (3, 4, 5)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen, dtype=dtype) for s in sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_vdot_and_axpy_match_the_per_leaf_forms(dtype):
    """The multi-tensor forms used for small pytrees of CUDA leaves, run on the CPU: the dot
    against a float64 reference, the axpy against the per-leaf one to a rounding (addcmul rounds
    once, a product and a sum twice)."""
    from hypergrad.tree import _fusable, _fused_axpy, _fused_vdot

    x, y = _leaves(dtype), _leaves(dtype, seed=1)
    ref = sum(float((a.double() * b.double()).sum()) for a, b in zip(x, y))
    got = _fused_vdot(x, y)
    assert got.dtype == dtype
    assert abs(float(got) - ref) <= (1e-6 if dtype == torch.float32 else 1e-12) * abs(ref) + 1e-9
    alpha = torch.tensor(-0.37, dtype=dtype)
    fused = _fused_axpy(alpha, x, y)
    for f, a, b in zip(fused, x, y, strict=True):
        assert f.shape == a.shape and f.dtype == dtype
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(f, torch.addcmul(b, a, alpha), rtol=2 * eps, atol=2 * eps)
    assert not _fusable(x, y)  # CPU leaves keep the per-leaf forms


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tree_vdot_and_axpy_take_the_fused_path_and_match_the_cpu():
    from hypergrad.tree import _fusable

    x, y = _leaves(torch.float32), _leaves(torch.float32, seed=1)
    xc, yc = tuple(a.cuda() for a in x), tuple(b.cuda() for b in y)
    assert _fusable(xc, yc)
    assert not _fusable(xc, (*yc[:-1], yc[-1].double()))  # mixed dtypes: per leaf
    # under vmap the per-leaf forms (the _foreach ops have no batching rule)
    batched = torch.func.vmap(lambda a, b: tree_vdot((a, a), (b, b)))(xc[0], yc[0])
    torch.testing.assert_close(batched.cpu(), 2 * (x[0] * y[0]).sum(1), rtol=1e-5, atol=1e-5)
    ref = sum(float((a.double() * b.double()).sum()) for a, b in zip(x, y))
    assert abs(float(tree_vdot(xc, yc)) - ref) <= 1e-6 * abs(ref)
    alpha = torch.tensor(0.25, device="cuda")
    for got, want in zip(tree_axpy(alpha, xc, yc), tree_axpy(alpha.cpu(), x, y), strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
