"""The BORT2 pipeline under DistributedDataParallel: two gloo processes on the CPU, launched as
torchrun launches them (``WORLD_SIZE``/``RANK``/``MASTER_ADDR`` in the environment, ``env://``),
against one process with the same global batch.

What must be equal (to 1e-7, in float64: in float32 the summation order alone — one thread
against two in ONE process — moves BatchNorm biases by up to 3% after six iterations, so float32
equality would only test the tolerance): every stage whose random draws are made for the global
batch — source-only step 1, the naive model, Stage B and
Stage C (with ``model.sync_bn=true``, so BatchNorm sees the global batch, and
``step2.hyper.outer_relu=false``: ``relu(mean log sigma)`` of a half batch is not half of the batch's).
Documented and not tested for equality: FixMatch-style step-1 methods (CutMix and MixStyle mix
rows within the local batch, their dropout draws are per rank). The hypergradient of one hyper
step equals the one-process one to 1e-6 in float64.
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
        "step1.iters=6",
        "step2.iters=6",
        "step2.hyper.every=3",
        "step2.warmup=3",
        "step2.hyper.outer_relu=false",
        "model.sync_bn=true",
        "checkpoint_every=4",
        "eval_every=100",
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
    from bort2.models import DigitCNN
    from bort2.step2 import build_student
    from bort2.step2.hyper import HyperSettings
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
    settings = HyperSettings(
        convention="library", outer_relu=False, labeler_mode="train", steps=3, alpha=1e-3,
        lr=1.0, clip=None, apply=False,
    )  # fmt: skip
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
