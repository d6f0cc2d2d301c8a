"""The one table of the pipeline's stages: names, display names, order and inputs.

Every stage of the BORT² pipeline (a step-1 method, the naive two-step model, Stage B, Stage C)
has one :class:`StageSpec` row in :data:`SPECS`; everything else reads it:

* :mod:`bort2.config` validates ``step1.methods`` / ``step2.methods`` against
  :func:`step1_methods` / :func:`step2_methods`;
* :func:`bort2.trainer.register_stage` refuses a class whose name has no row (and a test checks
  that every row has a class);
* :mod:`bort2.runner` runs :func:`plan` (the requested stages plus what they need, in an order
  derived from ``needs``) and hands each stage the ``final.pt`` of what it needs;
* :mod:`bort2.report` shows ``display`` in table order (the order of :data:`SPECS`) and compares
  consecutive stages of ``paper_order``.

No torch import: the configuration reads this module before anything heavy loads.

A new step-2 method is one :class:`~bort2.step2.stages.Step2Stage` subclass registered under
``"step2/<name>"``, one row here, and its config fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: the input key under which a stage receives the step-1 labeler's ``final.pt`` (or the file of
#: ``step1.checkpoint``): whichever step-1 method ``step1.labeler`` names
LABELER = "labeler"


def _none(cfg: Any) -> tuple[str, ...]:
    return ()


def labeler_stage(cfg: Any) -> str:
    """The step-1 stage whose model becomes F_theta: ``step1/<step1.labeler>``."""
    return f"step1/{cfg.step1.labeler}"


def _from_labeler(cfg: Any) -> tuple[str, ...]:
    return (labeler_stage(cfg),)


@dataclass(frozen=True)
class StageSpec:
    """What a stage is, for everything but its training code.

    Attributes:
        name: the registry name, ``"<step>/<method>"``; also the ``stage`` field of result rows.
        display: the name in result tables and figures.
        needs: ``cfg -> stage names`` whose ``final.pt`` this stage starts from (a step-1 name
            stands for the labeler: with ``step1.checkpoint`` that file is used instead).
        paper_order: position in the paper's chain of comparisons (each method against the one
            before it); None: not in the chain.
        stochastic: M_psi carries the stochastic (sigma) layer: its sigma logs feed the
            mechanism analysis and plots.
        plain_student: M_psi is a plain copy of F_theta (no stochastic layer).

    Which configuration keys a stage reads is declared beside each key (``read_by`` in
    :mod:`bort2.config.schema`); :attr:`ignores` lists the others.
    """

    name: str
    display: str
    needs: Callable[[Any], tuple[str, ...]] = field(default=_none, compare=False)
    paper_order: int | None = None
    stochastic: bool = False
    plain_student: bool = False

    @property
    def step(self) -> str:
        """``"step1"`` or ``"step2"``."""
        return self.name.split("/", 1)[0]

    @property
    def method(self) -> str:
        """The method's name as the config writes it (``"fixmatch_cm"``, ``"bort2"``)."""
        return self.name.split("/", 1)[1]

    @property
    def ignores(self) -> tuple[str, ...]:
        """The configuration keys (dotted) that do not change what this stage computes, from
        the keys' ``read_by`` declarations: left out of its checkpoints' fingerprint, so a stage
        copied from a run that differs only there (``examples/bort2/attribution.py`` reuses
        stages so) is accepted as this stage's."""
        from .config import ignored_keys  # the config imports this module

        return ignored_keys(self.name)

    @property
    def dir_name(self) -> str:
        """The stage's folder inside a unit's run directory (``step2_bort2``)."""
        return stage_dir_name(self.name)


#: Stage C's ``step2.bort2_init`` choices: the stage F_theta and M_psi start from
#: (``None``: the step-1 labeler).
BORT2_INITS: dict[str, str | None] = {"robust": "step2/robust", "step1": None}

#: Stage B, the stage Stage C starts from by default
STAGE_B = "step2/robust"
#: Stage C
STAGE_C = "step2/bort2"


def bort2_start(cfg: Any) -> str:
    """The stage Stage C starts from under ``cfg`` (Stage B, or the step-1 labeler)."""
    return BORT2_INITS[cfg.step2.bort2_init] or labeler_stage(cfg)


def _bort2_needs(cfg: Any) -> tuple[str, ...]:
    return (bort2_start(cfg),)


_ROWS = (
    # step 1 (the order of the results table)
    StageSpec("step1/source_only", "Source-only", paper_order=0),
    StageSpec("step1/fixmatch", "FixMatch"),
    StageSpec("step1/fixmatch_cm", "FixMatch-CM", paper_order=1),
    StageSpec("step1/dann", "DANN"),
    StageSpec("step1/m3sda", "M3SDA"),
    # step 2
    StageSpec(
        "step2/naive",
        "Naive two-step",
        _from_labeler,
        paper_order=2,
        plain_student=True,
    ),
    StageSpec(
        STAGE_B,
        "BORT² w/o bi-level",
        _from_labeler,
        paper_order=3,
        stochastic=True,
    ),
    StageSpec(STAGE_C, "BORT²", _bort2_needs, paper_order=4, stochastic=True),
)

#: every stage, by name, in the order of the results table
SPECS: dict[str, StageSpec] = {s.name: s for s in _ROWS}


def stage_dir_name(name: str) -> str:
    """A stage's folder name: ``"step2/bort2"`` -> ``"step2_bort2"``."""
    return name.replace("/", "_")


def methods(step: str) -> tuple[str, ...]:
    """The valid method names of ``step`` (``"step1"`` / ``"step2"``), in table order."""
    return tuple(s.method for s in SPECS.values() if s.step == step)


def step1_methods() -> tuple[str, ...]:
    """Valid ``step1.methods`` / ``step1.labeler`` values, in table order."""
    return methods("step1")


def step2_methods() -> tuple[str, ...]:
    """Valid ``step2.methods`` values, in table order."""
    return methods("step2")


def display(name: str) -> str:
    """The display name of stage ``name`` (the name itself for an unknown stage)."""
    spec = SPECS.get(name)
    return spec.display if spec else name


def paper_chain() -> list[str]:
    """The stages of the paper's comparisons, in order."""
    chain = [s for s in SPECS.values() if s.paper_order is not None]
    return [s.name for s in sorted(chain, key=lambda s: s.paper_order)]


def ordered(names: list[str], cfg: Any) -> list[str]:
    """``names`` plus the stages of the same step they need, each after what it needs.

    Topological over ``needs(cfg)``; among stages ready at the same time, the earlier one in
    :data:`SPECS` first. Needs of another step (the step-1 labeler of a step-2 stage) are
    outside this list: the runner trains every step-1 stage first.

    Raises:
        ValueError: an unknown stage, or stages that need each other.
    """
    todo: list[str] = []
    stack = list(names)
    while stack:
        name = stack.pop()
        if name not in SPECS:
            raise ValueError(f"unknown stage {name!r}; known: {', '.join(SPECS)}")
        if name in todo:
            continue
        todo.append(name)
        step = SPECS[name].step
        stack += [n for n in SPECS[name].needs(cfg) if SPECS[n].step == step]
    rank = {n: i for i, n in enumerate(SPECS)}
    out: list[str] = []
    while todo:
        ready = [n for n in todo if all(d in out or d not in todo for d in SPECS[n].needs(cfg))]
        if not ready:
            raise ValueError(f"stages {todo} need each other")
        first = min(ready, key=rank.__getitem__)
        out.append(first)
        todo.remove(first)
    return out


def plan(cfg: Any) -> list[str]:
    """Every stage one (target, seed) unit trains, in order.

    The step-1 methods of ``step1.methods`` in the config's order (none with
    ``step1.checkpoint``), then the step-2 methods of ``step2.methods`` with the step-2 stages
    they need (Stage B before Stage C with ``step2.bort2_init=robust``, even when Stage B is not
    asked for: its row is then not reported).
    """
    step1 = [] if cfg.step1.checkpoint else [f"step1/{m}" for m in cfg.step1.methods]
    return step1 + ordered([f"step2/{m}" for m in cfg.step2.methods], cfg)


def input_key(need: str) -> str:
    """The key of ``StageContext.inputs`` under which a needed stage's file is given."""
    return LABELER if SPECS[need].step == "step1" else need
