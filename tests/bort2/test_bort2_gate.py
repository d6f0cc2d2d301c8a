"""The gate script (``examples/bort2/scripts/gate.py``): its alignment, its null and one
checkpoint's measurement end to end on a smoke-size model."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples" / "bort2" / "scripts"), str(ROOT / "examples" / "bort2")]

gate = pytest.importorskip("gate")


def test_cosine_matches_a_hand_computed_value():
    a = (torch.tensor([1.0, 0.0]), torch.tensor([[0.0, 2.0]]))
    b = (torch.tensor([1.0, 1.0]), torch.tensor([[0.0, 0.0]]))
    # a.b = 1, |a| = sqrt(5), |b| = sqrt(2)
    assert gate.cosine(a, b) == pytest.approx(1 / math.sqrt(10), abs=1e-12)
    assert gate.cosine(a, a) == pytest.approx(1.0)
    assert math.isnan(gate.cosine(a, (torch.zeros(2), torch.zeros(1, 2))))


def test_true_direction_on_a_tiny_model_and_its_alignment():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    d = gate.true_direction(lin, {"x_weak": x, "seed_f": 5}, y)
    # by hand: dCE/dW = (softmax - onehot)^T x / n, dCE/db = mean(softmax - onehot)
    r = (F.softmax(lin(x), 1) - F.one_hot(y, 2).float()).detach() / 4
    assert torch.allclose(d[0], r.T @ x, atol=1e-6)
    assert torch.allclose(d[1], r.sum(0), atol=1e-6)
    g = (-d[0], -d[1])  # a hypergradient pointing exactly uphill on the true-label CE: -1
    assert gate.cosine(g, d) == pytest.approx(-1.0)


def test_null_shuffling_keeps_the_label_marginal():
    y = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
    gen = torch.Generator().manual_seed(0)
    outs = [gate.shuffled(y, gen) for _ in range(5)]
    for s in outs:
        assert torch.equal(torch.bincount(s, minlength=4), torch.bincount(y, minlength=4))
    assert any(not torch.equal(s, y) for s in outs)  # it does permute


def test_summary_and_decision_follow_the_rule():
    cells = {
        "oracle": [[b, 0, 0.3 + 0.01 * b] for b in range(4)],
        "teacher": [[b, 0, 0.1] for b in range(4)],
        "consistency": [[b, 0, 0.2 + 0.01 * b] for b in range(4)],
        "paper": [[b, 0, 0.0] for b in range(4)],
        "null": [[b, 0, 0.1 + 0.02 * (b % 2)] for b in range(4)],
    }
    cks = [{"name": f"c{i}", "cells": {"e": cells}} for i in range(4)]
    s = gate.summarize(cks)
    assert s["e"]["oracle"]["c0"]["beats_null"] and not s["e"]["teacher"]["c0"]["beats_null"]
    dec = gate.decide(s, 4)
    assert dec["pass"] and dec["per_estimator"]["e"]["wins"]["consistency"] == 4


def test_merge_extra_appends_further_draws():
    ck = {"cells": {"e": {"oracle": [[0, 0, 0.1]]}}, "solve": {}, "time_s": {"e": 1.0}}
    extra = {
        "cells": {"e": {"oracle": [[0, 2, 0.3]]}},
        "solve": {"e": {"diverged": 1, "solves": 5, "mean_iterations": 3.0}},
        "time_s": {"e": 2.0},
    }
    gate.merge_extra(ck, extra)
    assert ck["cells"]["e"]["oracle"] == [[0, 0, 0.1], [0, 2, 0.3]]
    assert ck["time_s"]["e"] == 3.0 and ck["solve"]["e"]["solves"] == 5


def test_grids_are_the_preregistered_counts_and_the_first_gates():
    import json

    counts = {e.name: (e.batches, e.draws) for e in gate.GRIDS["preregistered"]}
    assert counts == {  # docs/bort2.md, "Pre-registration": E1, E2 10 x 5, E3 10 x 1, E4 5 x 2
        "hard-N3-64": (10, 5),
        "soft-N3-64": (10, 5),
        "soft-MINRES-64": (10, 1),
        "soft-N3-256": (5, 2),
    }
    assert gate.GRID == gate.GRIDS["preregistered"]
    first = json.loads((ROOT / "examples/bort2/results/gate.json").read_text())["grid"]
    assert [
        {k: v for k, v in e.items() if k != "first_draw"} for e in first
    ] == [  # what the committed first gate ran
        {"name": e.name, "soft": e.soft, "solver": e.solver, "batch": e.batch,
         "batches": e.batches, "draws": e.draws}
        for e in gate.GRIDS["first"]
    ]  # fmt: skip


def test_make_jobs_and_the_workers_grid(monkeypatch, tmp_path):
    cmd = gate.pipeline_command(Path("r"), "uci_m", 2, jobs=1)
    assert "jobs=1" in cmd and "jobs=2" not in cmd
    assert "jobs=2" in gate.pipeline_command(Path("r"), "uci_m", 2)
    seen = {}

    class _U:
        name = "uci_m/seed0"

    monkeypatch.setattr(gate, "load_unit", lambda *a: _U())

    def fake(u, grid, seed, on_estimator):
        seen["grid"] = grid
        return {}

    monkeypatch.setattr(gate, "measure_checkpoint", fake)
    threads = torch.get_num_threads()
    try:
        gate._worker(("r", "uci_m", 0, str(tmp_path / "p.json"), 1, "pipeline", "first"))
    finally:
        torch.set_num_threads(threads)
    assert seen["grid"] == gate.GRIDS["first"]


@pytest.mark.slow
def test_one_checkpoint_end_to_end_returns_every_cell(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many threads on a loaded machine are far slower
    try:
        _end_to_end(monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _end_to_end(monkeypatch):
    from bort2.config import load_config
    from bort2.step2.losses import build_student
    from bort2.trainer import build_model

    torch.manual_seed(0)
    cfg = load_config(None, ["preset=smoke"])
    labeler = build_model(cfg, 10, mixstyle=False)
    student = build_student(labeler, "robust", 10, 0.1, cfg.model.sigma_head)
    teacher = build_model(cfg, 10, mixstyle=False)
    gen = torch.Generator().manual_seed(0)
    img = lambda n: torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen)  # noqa: E731
    unit = gate.Unit(
        cfg, labeler, student, teacher, 0.0,
        img(16), torch.arange(16) % 10, img(8), torch.arange(8) % 10, "smoke",
    )  # fmt: skip
    grid = (
        gate.Estimator("hard-N3-64", False, "n3", 8, 2, 1),
        gate.Estimator("soft-N3-64", True, "n3", 8, 1, 1),
        gate.Estimator("soft-MINRES-64", True, "minres", 8, 1, 1),
        gate.Estimator("soft-N3-256", True, "n3", 16, 1, 1),
    )
    monkeypatch.setattr(gate, "TEACHER_CONF", 0.0)  # every held-out row counts (random teacher)
    res = gate.measure_checkpoint(unit, grid, outer_batch=8, minres_steps=2)
    names = [e.name for e in grid] + list(gate.AVERAGED.values())
    assert sorted(res["cells"]) == sorted(names)
    for est in grid:
        for o in gate.OBJECTIVES:
            vals = [a for _, _, a in res["cells"][est.name][o]]
            assert len(vals) == est.batches * est.draws
            assert all(-1 - 1e-9 <= a <= 1 + 1e-9 for a in vals), (est.name, o, vals)
    for o in gate.OBJECTIVES:
        assert len(res["cells"]["hard-N3-64-avg"][o]) == 1  # one per draw
    s = gate.summarize([res])
    assert set(s) == set(names) and set(s["hard-N3-64"]) == set(gate.OBJECTIVES)
    md = gate.to_md({"summary": s, "decision": gate.decide(s, 1), "checkpoints": [res]})
    assert "Decision (pre-registered rule)" in md
