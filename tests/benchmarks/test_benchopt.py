"""What is ours in the race on benchopt's benchmark_bilevel (``benchmarks/benchopt``), tested
without benchopt, JAX or pandas: the time-to-suboptimality tables on hand-made rows with known
answers, the torch losses against numpy closed forms, the block sampler's exact full loss, the
Fashion-MNIST pickle writer on tiny idx files in the real layout, the installer and the CLI's
argument errors."""

from __future__ import annotations

import gzip
import math
import pickle
import struct

import numpy as np
import pytest
import torch

from benchmarks.benchopt import fashion, race, tables
from benchmarks.benchopt import torch_problems as tp


def rows(name, pts):
    return [{"solver_name": name, "time": t, "m": v} for t, v in pts]


def test_family_and_seed_parsing():
    n = "SABA[batch_size=64,random_state=3,step_size=0.1]"
    assert tables.family(n) == "SABA[batch_size=64,step_size=0.1]"
    assert tables.seed(n) == "3"
    assert tables.family("hg_SOBA[random_state=12,step_size=0.1]") == "hg_SOBA[step_size=0.1]"
    assert tables.family("jaxopt_GD[inner_solver=lbfgs]") == "jaxopt_GD[inner_solver=lbfgs]"
    assert tables.seed("jaxopt_GD[inner_solver=lbfgs]") == "0"


def test_time_to_levels_known_answers():
    # best value 1.0 (reached by B seed 2); A: seeds 1-3
    rec = rows("A[random_state=1]", [(0.0, 5.0), (1.0, 1.005), (2.0, 1.0005), (3.0, 1.2)])
    rec += rows("A[random_state=2]", [(0.0, 5.0), (2.0, 1.009), (4.0, 1.00005)])
    rec += rows("A[random_state=3]", [(0.0, 5.0), (3.0, 1.5)])  # never within 1e-2
    rec += rows("B[random_state=1]", [(0.5, 1.0001), (0.7, float("nan"))])
    rec += rows("B[random_state=2]", [(0.2, 1.0)])
    t = tables.time_to_levels(rec, "m")
    assert t["best"] == 1.0
    a, b = t["rows"]
    assert (a["solver"], b["solver"]) == ("A", "B")
    # A within 1e-2: seeds at 1, 2, never -> median 2; 1e-3: 2, 4, never -> 4; 1e-4: never x2
    assert a["times"][1e-2] == 2.0 and a["times"][1e-3] == 4.0 and math.isinf(a["times"][1e-4])
    assert a["reached"] == {1e-2: 2, 1e-3: 2, 1e-4: 1}
    assert a["final_gap"] == pytest.approx(0.2)  # median of 0.2, 5e-5, 0.5
    # B: two seeds: 0.5 and 0.2 -> 0.35 at every level (the NaN row is dropped)
    assert b["times"][1e-4] == pytest.approx(0.35) and b["seeds"] == 2
    w = tables.winners({"rows": [{**a, "solver": "hg_A"}, b]})
    assert w[1e-2]["peer"] == "B" and not w[1e-2]["target_met"]
    w = tables.winners({"rows": [a, {**b, "solver": "hg_B"}]})
    assert w[1e-4]["ours"] == "hg_B" and w[1e-4]["target_met"]


def test_median_time_counts_never_as_slowest():
    assert tables.median_time([1.0, math.inf, math.inf]) == math.inf
    assert tables.median_time([1.0, 3.0, math.inf]) == 3.0
    assert tables.median_time([1.0, 3.0]) == 2.0
    assert tables.first_time(np.array([2.0, 1.0]), np.array([0.0, 5.0]), 0.5) == 2.0


def test_median_curve_is_running_best():
    rec = rows("A[random_state=1]", [(1.0, 3.0), (2.0, 1.0), (3.0, 2.0)])
    c = tables.median_curve(rec, "m", 0.0, np.array([0.5, 1.5, 2.5, 3.5]))["A"]
    assert np.isnan(c[0]) and list(c[1:]) == [3.0, 1.0, 1.0]


def _quad_arrays(rng, n, dz, dx):
    a = rng.standard_normal((n, dz, dz)).astype(np.float32)
    return {"hess_inner": a, "hess_outer": rng.standard_normal((n, dx, dx)).astype(np.float32),
            "cross": rng.standard_normal((n, dx, dz)).astype(np.float32),
            "linear_inner": rng.standard_normal((n, dz)).astype(np.float32),
            "linear_outer": rng.standard_normal((n, dx)).astype(np.float32)}


def test_quadratic_loss_matches_numpy_and_closure_reading():
    rng = np.random.default_rng(0)
    ai, ao = _quad_arrays(rng, 7, 4, 3), _quad_arrays(rng, 5, 4, 3)

    def get(arrs):  # the benchmark's closure shape: the arrays are free variables
        hess_inner, hess_outer, cross = arrs["hess_inner"], arrs["hess_outer"], arrs["cross"]
        linear_inner, linear_outer = arrs["linear_inner"], arrs["linear_outer"]

        def f(z, x, start=0, batch_size=1):
            s = slice(start, start + batch_size)
            v = [0.5 * z @ hess_inner[i] @ z + 0.5 * x @ hess_outer[i] @ x + x @ cross[i] @ z
                 + linear_inner[i] @ z + linear_outer[i] @ x for i in range(len(hess_inner))[s]]
            return float(np.mean(v))

        return f

    fi, fo = get(ai), get(ao)
    assert sorted(tp.closure_arrays(fi)) == sorted(ai)
    p = tp.build(fi, fo)
    assert (p.kind, p.n_inner, p.n_outer) == ("quadratic", 7, 5)
    z, x = rng.standard_normal(4), rng.standard_normal(3)
    zt, xt = torch.tensor(z, dtype=torch.float32), torch.tensor(x, dtype=torch.float32)
    got = float(p.inner_loss(zt, xt, (torch.tensor([2, 3, 4]), 3.0)))
    assert float(p.inner_loss(zt, xt, (slice(2, 5), 3.0))) == pytest.approx(got, rel=1e-6)
    assert got == pytest.approx(fi(z, x, 2, 3), rel=1e-5)
    worst = tp.check_losses(p, fi, fo, np.zeros(4, np.float32), np.zeros(3, np.float32), batch=3)
    assert worst["inner"] < 1e-5 and worst["outer"] < 1e-5
    # a wrong reference is caught
    worst = tp.check_losses(p, lambda *a: fi(*a) + 1.0, fi, np.zeros(4, np.float32),
                            np.zeros(3, np.float32), batch=3)
    assert worst["inner"] > 0.1


def test_regsel_and_datacleaning_losses_match_numpy():
    rng = np.random.default_rng(1)
    a, y = rng.standard_normal((9, 3)), np.sign(rng.standard_normal(9))
    av, yv = rng.standard_normal((4, 3)), np.sign(rng.standard_normal(4))
    p = tp.regsel(a.astype(np.float32), y.astype(np.float32), av.astype(np.float32),
                  yv.astype(np.float32))
    z, x = rng.standard_normal(3), rng.standard_normal(3)
    ref = np.mean(np.log1p(np.exp(-y * (a @ z)))) + 0.5 * np.sum(np.exp(x) * z**2)
    zt, xt = torch.tensor(z, dtype=torch.float32), torch.tensor(x, dtype=torch.float32)
    assert float(p.full_inner(zt, xt)) == pytest.approx(ref, rel=1e-5)
    assert float(p.full_outer(zt, xt)) == pytest.approx(np.mean(np.log1p(np.exp(-yv * (av @ z)))),
                                                        rel=1e-5)
    # hyper-cleaning: 6 samples, 3 features, 4 classes, one-hot labels
    a, lab = rng.standard_normal((6, 3)), rng.integers(0, 4, 6)
    onehot = np.eye(4)[lab]
    p = tp.datacleaning(a, onehot, a[:2], onehot[:2], reg=0.2)
    w, x = rng.standard_normal((3, 4)), rng.standard_normal(6)
    logits = a @ w
    ce = np.log(np.exp(logits).sum(1)) - logits[np.arange(6), lab]
    ref = np.mean(ce / (1 + np.exp(-x))) + 0.2 * np.sum(w**2)
    got = p.full_inner(torch.tensor(w.ravel()), torch.tensor(x))
    assert float(got) == pytest.approx(ref, rel=1e-10)
    assert float(p.full_outer(torch.tensor(w.ravel()), torch.tensor(x))) == pytest.approx(
        np.mean(ce[:2]), rel=1e-10)


def test_build_refuses_unknown_closures():
    with pytest.raises(TypeError, match="free variables"):
        k = 1.0
        tp.build(lambda z, x: z * k, lambda z, x: z * k)
    with pytest.raises(TypeError, match="not a closure"):
        tp.closure_arrays(len)


@pytest.mark.parametrize("n, bs", [(20, 6), (64, 8), (10, 10)])
def test_block_sampler_blocks_give_the_full_loss_exactly(n, bs):
    s = tp.BlockSampler(n, bs, seed=3)
    assert s.num_blocks == n // bs
    ar = torch.arange(n)
    assert torch.equal(torch.cat([ar[b] for b in s.blocks]), ar)  # a partition
    assert {len(ar[b]) for b in s.blocks} <= {bs, bs + 1}
    vals = torch.randn(n, dtype=torch.float64)
    mean_of_blocks = sum(vals[b].sum() / s.block_denominator for b in s.blocks) / s.num_blocks
    assert float(mean_of_blocks) == pytest.approx(float(vals.mean()), rel=1e-12)
    assert s(5) == s(5) and s.block(4) == s.block(4) and s.block(4)[1] == s(4)
    assert torch.equal(ar[s.full()[0]], ar) and s.full()[1] == n
    # the draws are uniform over the blocks: each is drawn about 1/num_blocks of the time
    draws = torch.tensor([s.block(k)[0] for k in range(4000)])
    freq = torch.bincount(draws, minlength=s.num_blocks).double() / 4000
    sd = math.sqrt((1 / s.num_blocks) * (1 - 1 / s.num_blocks) / 4000)
    assert float((freq - 1 / s.num_blocks).abs().max()) <= 5 * sd


def _idx(path, arr, gz=True):
    dims = arr.shape
    raw = struct.pack(">HBB", 0, 8, len(dims)) + struct.pack(f">{len(dims)}I", *dims)
    raw += arr.astype(np.uint8).tobytes()
    (gzip.open(path, "wb") if gz else open(path, "wb")).write(raw)


def test_fashion_pickle_writer_in_the_mnist_layout(tmp_path):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (5, 28, 28)).astype(np.uint8)
    _idx(tmp_path / "train-images-idx3-ubyte.gz", imgs)
    _idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(5) % 10)
    _idx(tmp_path / "t10k-images-idx3-ubyte", imgs[:3], gz=False)
    _idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([9, 8, 7]))
    out = tmp_path / "mnist.pkl"
    fashion.write_pickle(out, tmp_path)
    with open(out, "rb") as f:
        d = pickle.load(f)
    assert sorted(d) == ["test_images", "test_labels", "training_images", "training_labels"]
    assert d["training_images"].shape == (5, 784) and d["training_images"].dtype == np.uint8
    assert np.array_equal(d["training_images"][2], imgs[2].ravel())
    assert list(d["test_labels"]) == [9, 8, 7] and d["test_images"].shape == (3, 784)
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x0d\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="unsigned-byte"):
        fashion.read_idx(bad)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        fashion.write_pickle(out, tmp_path)


def test_cli_argument_errors(tmp_path, capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["benchopt"])
    assert e.value.code == 2 and "--bench-dir PATH is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        race.main(["--bench-dir", str(tmp_path)])
    assert "not a benchmark_bilevel checkout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        race.main(["--bench-dir", str(tmp_path), "--problems", "nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_install_only_copies_our_files_into_a_checkout(tmp_path):
    for d in ("solvers", "datasets", "benchmark_utils"):
        (tmp_path / d).mkdir()
    (tmp_path / "objective.py").write_text("")
    (tmp_path / "solvers" / "hypergrad_soba.py").write_text("stale")
    assert race.main(["--bench-dir", str(tmp_path), "--install-only"]) == 0
    for src, dst in race.INSTALL.items():
        assert (tmp_path / dst).read_bytes() == (race.HERE / src).read_bytes()


def test_solver_specs_are_benchopt_grid_strings():
    s = race.solver_specs(race.PROBLEMS["quadratic"], 3, False, ["SABA"])
    assert s[0] == ("SABA[batch_size=64,eval_freq=64,outer_ratio=1.0,random_state=[1,2,3],"
                    "step_size=0.1]")
    assert s[1].startswith("hg_SABA[") and s[2].startswith("jaxopt_GD[")
    assert s[3].startswith("hg_implicit[")
