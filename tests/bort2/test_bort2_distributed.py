"""The BORT2 pipeline under DistributedDataParallel: two gloo processes on the CPU, launched as
torchrun launches them (``WORLD_SIZE``/``RANK``/``MASTER_ADDR`` in the environment, ``env://``),
against one process with the same global batch.

What must be equal (to 1e-7, in float64: in float32 the summation order alone — one thread
against two in ONE process — moves BatchNorm biases by up to 3% after six iterations, so float32
equality would only test the tolerance): every stage whose random draws are made for the global
batch — source-only step 1, the naive model, Stage B and Stage C (with ``model.sync_bn=true``,
so BatchNorm sees the global batch, and ``step2.hyper.outer_relu=false``: ``relu(mean log
sigma)`` of a half batch is not half of the batch's) — their final weights, and every logged
value of their ``history.json`` (the every-10-iterations log, the periodic evaluations, the
hyper steps' diagnostics): the runs are long enough for each of those branches to run.
Documented and not tested for equality: FixMatch-style step-1 methods (CutMix and MixStyle mix
rows within the local batch, their dropout draws are per rank); the default pipeline (with
FixMatch-CM) runs through ``torch.distributed.run`` itself to its results table. The
hypergradient of one hyper step equals the one-process one to 1e-6 in float64.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bort2 import cli

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    pytest.mark.usefixtures("one_thread"),
]


def _run_module():
    return cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(data_root, out, *extra):
    return [
        "preset=smoke",
        "step1.methods=[source_only]",
        "step1.labeler=source_only",
        # past the every-10 log, two periodic evaluations and two checkpoints of every stage
        "step1.iters=11",
        "step2.iters=11",
        "step2.hyper.every=3",
        "step2.warmup=3",
        "step2.hyper.outer_relu=false",
        "model.sync_bn=true",
        "checkpoint_every=4",
        "eval_every=5",
        "data.max_test=64",
        "progress=false",
        "threads=1",
        f"data.root={data_root}",
        f"output_dir={out}",
        *extra,
    ]


def _torchrun_worker(rank: int, world: int, port: int, argv: list[str], errors: str) -> None:
    os.environ.update(
        WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    try:
        code = _run_module().main(argv)
        if code != 0:
            raise RuntimeError(f"rank {rank}: run.main returned {code}")
    except BaseException as exc:  # report to the parent, then fail the process
        Path(errors).with_suffix(f".{rank}").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        from bort2.dist import shutdown

        shutdown()


STAGES = ("step1_source_only", "step2_naive", "step2_robust", "step2_bort2")


@pytest.fixture(scope="module")
def two_runs(data_root, tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    one, two = base / "one", base / "two"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # float32 summation order alone moves BN biases by %
    try:
        assert _run_module().main(_args(data_root, one)) == 0
    finally:
        torch.set_default_dtype(old)
    mp.start_processes(
        _torchrun_worker,
        args=(2, _free_port(), _args(data_root, two), str(base / "err")),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return one / "uci_m" / "seed0", two / "uci_m" / "seed0"


@pytest.mark.parametrize("stage", STAGES)
def test_two_processes_equal_one_process(two_runs, stage):
    from bort2.checkpoint import IDENTITY_KEY, load_checkpoint

    one, two = (load_checkpoint(run / stage / "final.pt") for run in two_runs)
    assert one.keys() == two.keys()
    # the identity record (stage, target, seed, config fingerprint) is the same run's
    assert one.pop(IDENTITY_KEY) == two.pop(IDENTITY_KEY)
    compared = 0
    for part in one:
        for key, a in one[part].items():
            b = two[part][key]
            if a.is_floating_point():
                torch.testing.assert_close(b, a, rtol=1e-7, atol=1e-9, msg=f"{stage} {part}.{key}")
                compared += 1
            else:
                assert torch.equal(a, b), (stage, part, key)
    assert compared > 10


def test_only_rank_zero_wrote_and_metrics_agree(two_runs):
    import json

    one, two = two_runs
    for stage in STAGES:
        m1 = json.loads((one / stage / "metrics.json").read_text())
        m2 = json.loads((two / stage / "metrics.json").read_text())
        assert m1["acc"] == pytest.approx(m2["acc"], abs=1.0 / 64 + 1e-9), stage
    assert (two.parent.parent / "results.md").is_file()
    assert not list(two.parent.parent.glob("**/*.tmp"))


#: logged values that are not computed from the batch (wall-clock times)
NOT_COMPUTED = {"hyper_time_s"}


@pytest.mark.parametrize("stage", STAGES)
def test_logged_values_are_the_global_batch_values(two_runs, stage):
    """Issue 30: the every-10 log of the naive stage indexed this rank's mask against the
    global batch's labels (IndexError under torchrun); the other logs were rank 0's half batch.
    Every logged value under torchrun is the one-process value."""
    import json
    import math

    one, two = (json.loads((run / stage / "history.json").read_text()) for run in two_runs)
    h1, h2 = one["history"], two["history"]
    assert sorted(h1) == sorted(h2)
    assert [s for s, _ in h1["loss"]] == [10]  # the log branch ran
    assert [s for s, _ in h1["target_acc"]] == [5, 10, 11]  # and the periodic evaluations
    if stage == "step2_bort2":
        assert [s for s, _ in h1["hypergrad_norm"]] == [3, 6, 9]
        assert {"sigma_correct", "mean_log_sigma", "hyper_mean_log_sigma"} <= set(h1)
    for key in sorted(set(h1) - NOT_COMPUTED):
        assert [s for s, _ in h1[key]] == [s for s, _ in h2[key]], (stage, key)
        for (_, a), (_, b) in zip(h1[key], h2[key]):
            if math.isnan(a):
                assert math.isnan(b), (stage, key)
            else:
                assert b == pytest.approx(a, rel=1e-7, abs=1e-9), (stage, key)


def _torchrun(args: list[str], cwd: Path, timeout: float = 600):
    """``torchrun --standalone --nproc_per_node=2 examples/bort2/run.py ARGS`` (gloo, CPU)."""
    import subprocess

    from helpers import RUN_PY

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(RUN_PY), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check_torchrun_run(done, out: Path, iters: int, evals: list[int]) -> None:
    import json

    from bort2.rundir import unproven_entries

    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.count("| method |") == 1  # one results table (rank 0's)
    stages = [r["stage"] for r in json.loads((out / "results.json").read_text())["results"]]
    assert stages == [
        "step1/source_only", "step1/fixmatch_cm", "step2/naive", "step2/robust", "step2/bort2",
    ]  # fmt: skip
    for stage in stages:
        h = json.loads((out / "uci_m" / "seed0" / stage.replace("/", "_") / "history.json")
                       .read_text())["history"]  # fmt: skip
        assert [s for s, _ in h["loss"]] == list(range(10, iters + 1, 10)), stage
        assert [s for s, _ in h["target_acc"]] == evals, stage
    assert (out / "mechanism.md").is_file()
    assert unproven_entries(out) == []  # rank 0 wrote (and recorded) every file


def test_smoke_preset_under_torchrun(data_root, tmp_path):
    """The command of issue 30, ``torchrun --standalone --nproc_per_node=2 run.py preset=smoke``
    (the default stages, FixMatch-CM included, per-rank BatchNorm; 40 iterations a stage: four
    every-10 logs and two evaluations each), to its one results table, every file rank 0's.
    It stopped in step2/naive with an IndexError (a local mask indexed a global tensor)."""
    out = tmp_path / "smoke"
    args = ["preset=smoke", "progress=false", f"data.root={data_root}", f"output_dir={out}"]
    _check_torchrun_run(_torchrun(args, tmp_path), out, 40, [20, 40])


def _finite_worker(rank: int, world: int, init_file: str, out: str) -> None:
    from bort2.dist import DistEnv
    from bort2.errors import TrainingDiverged
    from bort2.trainer import StageContext, check_finite

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ctx = StageContext(
            None, None, "t", 0, torch.device("cpu"), Path(out), dist=DistEnv(rank, world)
        )
        loss = torch.tensor(float("nan") if rank == 1 else 1.0)
        try:
            check_finite(loss, "loss", ctx, "step2/naive", 4, "hint")
            said = "finite"
        except TrainingDiverged as exc:
            said = str(exc)
        Path(out).with_suffix(f".{rank}").write_text(said)
    finally:
        dist.destroy_process_group()


def test_a_loss_not_finite_on_one_rank_stops_every_rank(tmp_path):
    """A rank that stopped alone would leave the others waiting in DDP's all-reduce."""
    out = tmp_path / "said"
    mp.start_processes(
        _finite_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    for rank in (0, 1):
        said = out.with_suffix(f".{rank}").read_text()
        assert "not finite at iteration 5 on rank 1;" in said, (rank, said)


def test_jobs_with_torchrun_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = _run_module().main(["jobs=2", f"output_dir={tmp_path / 'o'}", "progress=false"])
    assert code == 2
    assert "cannot be combined with torchrun" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_uneven_batch_is_refused():
    from bort2.dist import DistEnv, shard_rows

    rows = shard_rows(12, 3, DistEnv(rank=1, world=2))
    assert rows.tolist() == [2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="divisible by 2"):
        shard_rows(9, 3, DistEnv(rank=0, world=2), "source batch")
    assert shard_rows(12, 3, DistEnv()) is None


# ----------------------------------------------------------------------------- hyper step
def _hyper_problem():
    from bort2.config import HyperConfig, Step2Config
    from bort2.models import DigitCNN
    from bort2.step2 import build_student
    from bort2.step2.losses import build_threshold

    torch.manual_seed(0)
    labeler = DigitCNN(num_classes=4, width=1 / 32, image_size=8).double()
    student = build_student(labeler, "bort2", 4, sigma_head="official").double()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    threshold = build_threshold("fixed", 0.0, 0.999, 4).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64)
    xw = torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64)
    settings = Step2Config(hyper=HyperConfig(
        convention="library", outer_relu=False, labeler_mode="train", steps=3, alpha=1e-3,
        lr=1.0, clip=1e300, apply=False,  # a clip never reached: the unclipped hypergradient
    ))  # fmt: skip
    return student, labeler, threshold, settings, x, xw


def _hyper_worker(rank: int, world: int, init_file: str, out: str) -> None:
    from bort2.dist import DistEnv, convert_batchnorm, global_rows, shard_rows, take
    from bort2.step2.hyper import BilevelLabelUpdater

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        student, labeler, threshold, settings, x, xw = _hyper_problem()
        convert_batchnorm(student)
        convert_batchnorm(labeler)
        rows = shard_rows(len(x), 1, DistEnv(rank, world))
        updater = BilevelLabelUpdater(student, labeler, threshold, settings, distributed="exact")
        gen = torch.Generator().manual_seed(5)
        with global_rows(rows, len(x)):
            info = updater(take(x, rows), take(xw, rows), gen)
        grads = [p.grad.clone() for p in labeler.parameters()]
        if rank == 0:
            torch.save({"grads": grads, "norm": info.hypergrad_norm}, out)
    finally:
        dist.destroy_process_group()


def test_hyper_step_hypergradient_equals_one_process(tmp_path):
    from bort2.step2.hyper import BilevelLabelUpdater

    student, labeler, threshold, settings, x, xw = _hyper_problem()
    updater = BilevelLabelUpdater(student, labeler, threshold, settings)
    info = updater(x, xw, torch.Generator().manual_seed(5))
    ref = [p.grad.clone() for p in labeler.parameters()]
    assert info.hypergrad_norm > 0
    out = tmp_path / "two.pt"
    mp.start_processes(
        _hyper_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    got = torch.load(out)
    scale = max(float(r.abs().max()) for r in ref)
    for a, b in zip(got["grads"], ref):  # conv biases before BatchNorm: exactly 0 up to rounding
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9 * scale)
    assert got["norm"] == pytest.approx(info.hypergrad_norm, rel=1e-6)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
