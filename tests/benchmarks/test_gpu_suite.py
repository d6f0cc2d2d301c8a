"""The prepared GPU run (``python -m benchmarks gpu``, benchmarks/suites/gpu.py): its plumbing
on the CPU (the parts at tiny sizes; the whole ``--quick`` command line in the slow suite; a
failing part recorded without losing the others; the run's budget; ``device=auto`` without CUDA),
and the CUDA-marked tests that its first part runs (``pytest -m cuda``; each skips without a CUDA
device)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import hypergrad as hg
from benchmarks import kit
from benchmarks.__main__ import main as bench_main
from benchmarks.__main__ import options
from benchmarks.suites import gpu

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device"


def _options(**change):
    return {**options(gpu, True, {}, 1), "device": "cpu", **change}


# ---------------------------------------------------------------------------- plumbing (CPU)
def _check_resnet(part, arch):
    recs = {r["config"]: r for r in part["records"]}
    names = {"backward", "cg5", "cg5+recompute", "cg5+damped", "minres5", "neumann3"}
    assert names | {"neumann3+damped", "cg5+bf16", "neumann3+damped+bf16"} <= set(recs)
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in recs.values())
    assert recs["minres5"]["solve"]["matvecs"] >= 5  # CG may stop at negative curvature
    assert recs["neumann3"]["solve"]["alpha"] == 1e-3 and part["info"]["arch"] == arch
    assert {"grad+graph", "hvp"} <= set(recs)  # the pieces of a step's cost
    info = part["info"]  # damping="auto": 1.1 |λ| of the power iteration's dominant eigenvalue
    assert info["damping"] > 0
    assert info["damping"] == pytest.approx(1.1 * abs(info["dominant_eigenvalue"]))


def _check_peers(part):
    for p in part["problems"]:
        ok = {(r["library"], r["solver"]) for r in p["records"] if r["status"] == "ok"}
        assert {
            ("hypergrad", "cg"),
            ("torchopt", "cg" if p["problem"][0] == "m" else "cg+bnpatch"),
        } <= ok
        cg = [r for r in p["records"] if r["solver"].startswith("cg") and r["status"] == "ok"]
        assert all(r["median_ms"] > 0 and math.isfinite(r["rel_error"]) for r in cg)
        assert p["info"]["extras"]["reference"]["iters"] > 0


def test_parts_run_on_the_cpu_at_tiny_sizes(tmp_path, one_thread):
    """The CUDA-marked tests (skipped here), a HyperStep on a small torchvision network and the
    peer CNN, each at a size that takes seconds; the result files and their tables."""
    pytest.importorskip("torchvision")
    o = _options(parts=["tests", "resnet", "peers"], arch="shufflenet_v2_x0_5", image=32)
    o["commit"] = "abc1234"  # recorded in place of git's answer (stale on a device machine)
    o.update(peer_problems=["cnn_digit5"], lbfgs_iters=5, ref_iters=50, ks=[3])
    path = gpu.measure(o, tmp_path, "gpu")
    assert path == tmp_path / "gpu" / "cpu.json"
    res = json.loads(path.read_text())
    parts = res["parts"]
    assert {p: parts[p]["status"] for p in parts} == dict.fromkeys(o["parts"], "ok")
    assert res["gpu"]["name"] == "cpu" and res["gpu"]["torch"] == torch.__version__
    assert res["gpu"]["git"] == "abc1234"
    tests = parts["tests"]  # this file's CUDA-marked tests, skipped without CUDA
    assert tests["rc"] == 0 and (CUDA or tests["counts"]["skipped"] >= 7)
    _check_resnet(parts["resnet"], "shufflenet_v2_x0_5")
    _check_peers(parts["peers"])
    md = path.with_suffix(".md").read_text()
    assert md.startswith("# GPU run: cpu") and "| part | commit | status |" in md
    assert "| config | status | ms / step |" in md and "| library | solver | K |" in md


@pytest.mark.slow
def test_quick_cpu_command_line_runs_every_part(tmp_path):
    """``python -m benchmarks gpu --quick --set device=cpu``: ResNet-18 at 32 px, batch 2, the
    smoke preset with 4 iterations per stage, both peer networks at their quick sizes."""
    pytest.importorskip("torchvision")
    pytest.importorskip("sklearn")
    cmd = [sys.executable, "-m", "benchmarks", "gpu", "--quick", "--out", str(tmp_path)]
    subprocess.run([*cmd, "--set", "device=cpu"], cwd=kit.ROOT, check=True, timeout=1800)
    res = json.loads((tmp_path / "gpu" / "cpu.json").read_text())
    parts = res["parts"]
    assert {p: parts[p]["status"] for p in parts} == dict.fromkeys(gpu.PARTS_ORDER, "ok")
    stages = [r["stage"] for r in parts["bort2"]["results"]]
    assert stages[-1] == "step2/bort2" and len(stages) == 5
    _check_resnet(parts["resnet"], "resnet18")
    _check_peers(parts["peers"])
    assert "**BORT² smoke preset**" in (tmp_path / "gpu" / "cpu.md").read_text()


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def boom(o, device, limit):
        raise RuntimeError("out of memory (planted)")

    monkeypatch.setitem(gpu.PARTS, "resnet", boom)
    monkeypatch.setitem(gpu.PARTS, "peers", lambda o, device, limit: {"limit": limit})
    path = gpu.measure(_options(parts=["resnet", "peers", "nonsense"]), tmp_path, "gpu")
    parts = json.loads(path.read_text())["parts"]
    assert parts["resnet"]["status"] == "error" and "planted" in parts["resnet"]["error"]
    assert parts["peers"]["status"] == "ok" and 0 < parts["peers"]["limit"] <= 150
    assert parts["nonsense"]["status"] == "error"
    assert "out of memory (planted)" in path.with_suffix(".md").read_text()


def test_a_spent_budget_skips_the_remaining_parts(tmp_path):
    path = gpu.measure(_options(budget_s=0, parts=["tests", "resnet"]), tmp_path, "gpu")
    parts = json.loads(path.read_text())["parts"]
    assert all(p["status"].startswith("skipped: the run's budget") for p in parts.values())


@pytest.mark.skipif(CUDA, reason="with CUDA this would run the whole GPU suite")
def test_auto_device_without_cuda_writes_nothing(tmp_path):
    assert bench_main(["gpu", "--quick", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "gpu").exists()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        gpu.measure(_options(device="cuda"), tmp_path, "gpu")


# ------------------------------------------------------------------- CUDA-marked (pytest -m cuda)
def _ridge(device, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 5, generator=g, dtype=dtype).to(device)
    y = torch.randn(50, generator=g, dtype=dtype).to(device)
    lam = torch.full((5,), 0.1, dtype=dtype, device=device)
    w = torch.linalg.solve(X.T @ X / 50 + torch.diag(lam), X.T @ y / 50)

    def inner(w, lam):
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()

    def outer(w, lam):
        return 0.5 * ((X @ w - 1) ** 2).mean()

    return inner, outer, w, lam


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("solver", [hg.CG(tol=1e-12), hg.Exact(), hg.MINRES(tol=1e-12)])
def test_implicit_grad_on_cuda_matches_the_cpu(solver):
    out = []
    for device in ("cpu", "cuda"):
        inner, outer, w, lam = _ridge(device)
        g, info = hg.implicit_grad(inner, outer, w, lam, solver=solver)
        assert g.device.type == device and info.solve.converged
        out.append(g.cpu())
    torch.testing.assert_close(out[1], out[0], rtol=1e-9, atol=1e-12)


def _hyperstep_problem(device, dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)
    ).to(device, dtype)
    labeler = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10)).to(device, dtype)
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=dtype)

    def inner(m, b):
        # .to(dtype): float32 losses under autocast, and float64 stays float64 (a .float()
        # here capped the float64 test at float32's precision: CG stalled at residual 2e-7)
        t = labeler(b).to(dtype).softmax(1)
        reg = 1e-2 * sum((p.to(dtype) ** 2).sum() for p in m.parameters())
        return -(t * m(b).to(dtype).log_softmax(1)).sum(1).mean() + reg

    def outer(m, b):
        return m(b).to(dtype).logsumexp(1).mean()

    # the Hessian at this random init is indefinite (plain CG stops at negative curvature after
    # 4 iterations on the CPU too, float32 and float64): damping 1 makes H + I positive definite
    # and CG converges (float32: 27 iterations to 1e-6; float64: to 1e-12)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    solver = hg.CG(maxiter=200, tol=tol, damping=1.0)
    step = hg.HyperStep(model, labeler, inner, outer, solver=solver)
    return step, x.to(device), model


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_hyperstep_on_cuda_matches_the_cpu_and_keeps_running_stats():
    """BatchNorm in train mode, float64 on both devices (cuDNN's float64 convolutions)."""
    grads = []
    for device in ("cpu", "cuda"):
        step, x, model = _hyperstep_problem(device, torch.float64)
        before = model[1].running_mean.clone()
        hyper, info = step.compute(x)
        assert info.solve.converged and torch.equal(model[1].running_mean, before)
        grads.append(torch.cat([h.flatten().cpu() for h in hyper]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-9)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 0.15), (torch.float16, 2e-2)])
def test_hyperstep_under_cuda_autocast_is_close_to_float32(dtype, tol):
    """Relative error of the autocast hypergradient on this problem under CPU autocast: bf16
    5.3e-2, fp16 5.7e-3 (46 CG iterations each; bf16's 8-bit significand, fp16's 11-bit one);
    the tolerances leave about 3x (a wrong hypergradient is off by O(1))."""
    step, x, _ = _hyperstep_problem("cuda")
    ref = torch.cat([h.flatten() for h in step.compute(x)[0]])
    with torch.autocast("cuda", dtype=dtype), warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.HypergradWarning)  # the residual floor of low precision
        hyper, _ = step.compute(x)
    got = torch.cat([h.flatten() for h in hyper])
    assert torch.isfinite(got).all() and got.dtype == torch.float32
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel < tol, rel


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_bort2_runs_every_stage_on_cuda_with_amp(data_root, tmp_path, amp):
    """amp=fp16 is refused without CUDA (test_bort2_amp.py); here it runs, as bf16 does."""
    from bort2 import cli

    args = [
        "preset=smoke", "step1.iters=4", "step2.iters=4", "step2.hyper.every=2",
        "step2.warmup=2", "eval_every=100", "data.max_test=32", "progress=false",
        f"data.root={data_root}", f"output_dir={tmp_path / amp}", "device=cuda", f"amp={amp}",
    ]  # fmt: skip
    assert cli.main(args) == 0
    res = json.loads((tmp_path / amp / "results.json").read_text())["results"]
    assert [r["stage"] for r in res][-1] == "step2/bort2"
    assert all(0.0 <= r["acc"] <= 1.0 for r in res)
