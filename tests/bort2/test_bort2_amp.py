"""The pipeline's ``amp`` switch: bf16 autocast runs every stage (CPU), changes the arithmetic,
keeps the weights float32 and finite; fp16 without CUDA is refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from bort2 import cli

pytestmark = pytest.mark.usefixtures("one_thread")


def _run():
    return cli


def _args(data_root, out, *extra):
    return [
        "preset=smoke", "step1.iters=4", "step2.iters=4", "step2.hyper.every=2",
        "step2.warmup=2", "eval_every=100", "data.max_test=32", "progress=false", "threads=1",
        f"data.root={data_root}", f"output_dir={out}", *extra,
    ]  # fmt: skip


def test_bf16_runs_every_stage_and_changes_the_arithmetic(data_root, tmp_path):
    from bort2.checkpoint import load_checkpoint

    run = _run()
    assert run.main(_args(data_root, tmp_path / "off")) == 0
    assert run.main(_args(data_root, tmp_path / "bf16", "amp=bf16")) == 0
    stages = (
        "step1_source_only",
        "step1_fixmatch_cm",
        "step2_naive",
        "step2_robust",
        "step2_bort2",
    )
    for stage in stages:
        a = load_checkpoint(tmp_path / "off" / "uci_m" / "seed0" / stage / "final.pt")["model"]
        b = load_checkpoint(tmp_path / "bf16" / "uci_m" / "seed0" / stage / "final.pt")["model"]
        weights = [k for k in a if a[k].is_floating_point()]
        assert all(b[k].dtype == torch.float32 and torch.isfinite(b[k]).all() for k in weights)
        assert any(not torch.equal(a[k], b[k]) for k in weights), stage


def test_fp16_without_cuda_is_refused(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: fp16 is allowed")
    assert _run().main(["amp=fp16", f"output_dir={tmp_path / 'o'}"]) == 2
    assert "amp=fp16 needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
