"""The step-2 stages' own rules (examples/bort2/bort2/step2/stages.py), each checked by hand:
Stage B's EMA labeler update, and Stage C starting F_θ and M_ψ from Stage B's target model."""

import copy

import pytest
import torch
from bort2 import engine
from bort2.config import load_config
from bort2.data.base import ArrayDomain, Benchmark
from bort2.models import DigitCNN
from bort2.step2 import build_student
from bort2.step2.stages import ema_update
from bort2.trainer import STAGES

pytestmark = pytest.mark.usefixtures("one_thread")


def _trained_pair(sigma_head, seed=0):
    torch.manual_seed(seed)
    labeler = DigitCNN(num_classes=3, width=1 / 32, image_size=8).double()
    student = build_student(labeler, "robust", 3, 0.1, sigma_head=sigma_head)
    x = torch.randn(16, 3, 8, 8, dtype=torch.float64)
    for m in (labeler, student):
        m.train()
        m(x + torch.randn_like(x))  # different running statistics in the two models
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.1 * torch.randn_like(p))  # and different weights
    return labeler.eval(), student


@pytest.mark.parametrize("sigma_head", ["official", "linear"])
def test_ema_labeler_update_by_hand(sigma_head):
    labeler, student = _trained_pair(sigma_head)
    before = {k: v.clone() for k, v in labeler.state_dict().items()}
    target = {k: v.clone() for k, v in student.classifier_state().items()}
    decay = 0.999
    ema_update(labeler, student, decay)
    after = labeler.state_dict()
    assert after.keys() == before.keys() == target.keys()
    checked = 0
    for k, v in after.items():
        if v.is_floating_point():
            expected = decay * before[k] + (1 - decay) * target[k]
            torch.testing.assert_close(v, expected, rtol=1e-14, atol=1e-15)
            checked += int(not torch.equal(before[k], target[k]))
        else:  # num_batches_tracked stays an integer count of the labeler's own batches
            assert torch.equal(v, before[k])
    assert checked > 10  # weights and BatchNorm statistics really differed and were averaged
    assert any("running_mean" in k for k in after)
    # with decay 0 the labeler becomes M_psi's deterministic (eval) path exactly
    labeler2 = copy.deepcopy(labeler)
    ema_update(labeler2, student, 0.0)
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    student.eval()
    torch.testing.assert_close(labeler2(x), student(x), rtol=1e-12, atol=1e-12)


def _bench(n=32, size=8, k=3):
    g = torch.Generator().manual_seed(0)
    splits = {}
    for d in ("a", "b", "t"):
        splits[d] = {
            s: ArrayDomain(
                torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8),
                torch.randint(0, k, (n,), generator=g),
            )
            for s in ("train", "test")
        }
    return Benchmark("synthetic", k, size, splits)


def test_stage_c_starts_both_networks_from_stage_b(tmp_path):
    cfg = load_config(
        None,
        [
            "model.width=0.0625",
            "data.image_size=8",
            "step2.batch_size=8",
            "progress=false",
            "tensorboard=false",
        ],
    )
    labeler = DigitCNN(num_classes=3, width=0.0625, image_size=8)
    student = build_student(labeler, "robust", 3, sigma_head="official")
    torch.manual_seed(3)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.2 * torch.randn_like(p))
    step1 = tmp_path / "step1.pt"
    engine.atomic_save({"model": labeler.state_dict()}, step1)
    robust = tmp_path / "robust.pt"
    engine.atomic_save(
        {"model": student.state_dict(), "classifier": student.classifier_state()}, robust
    )
    ctx = engine.StageContext(
        cfg, _bench(), "t", 0, torch.device("cpu"), tmp_path / "c", inputs={"labeler": step1}
    )
    ctx.inputs["robust"] = robust
    stage = STAGES["step2/bort2"](ctx)
    stage.setup()
    # F_theta (no sigma branch) = M_psi's trunk and head; M_psi = Stage B's model, sigma too
    f_state = stage.labeler.state_dict()
    m_trunk = stage.student.classifier_state()
    assert f_state.keys() == m_trunk.keys()
    for k in f_state:
        assert torch.equal(f_state[k], m_trunk[k]), k
        assert torch.equal(f_state[k], student.classifier_state()[k]), k
    for k, v in stage.student.state_dict().items():
        assert torch.equal(v, student.state_dict()[k]), k
    assert any(k.startswith("sigma_branch") for k in stage.student.state_dict())
    # F_theta is the hyperparameter: all of it, and no MixStyle in step 2
    assert all(p.requires_grad for p in stage.labeler.parameters())
    assert isinstance(stage.labeler.mixstyle, torch.nn.Identity)
    x = torch.randn(4, 3, 8, 8)
    stage.labeler.eval()
    stage.student.eval()
    torch.testing.assert_close(stage.labeler(x), stage.student(x), rtol=0, atol=0)
    # from step 1 instead (bort2_init=step1): F_theta = the step-1 model, a fresh sigma branch
    cfg.step2.bort2_init = "step1"
    ctx.stage_dir = tmp_path / "c1"
    stage = STAGES["step2/bort2"](ctx)
    stage.setup()
    for k, v in stage.labeler.state_dict().items():
        assert torch.equal(v, labeler.state_dict()[k]), k
