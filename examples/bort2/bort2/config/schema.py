"""The configuration schema of the BORT² pipeline: one dataclass field per key, declared with
:func:`opt` beside it.

A field's metadata says everything the pipeline knows about the key: its help line (``--help``),
its constraint (``choices``, a numeric ``range``, or ``check`` naming who checks a free-form
value; :func:`bort2.config.load.validate` walks them), and what it changes: ``read_by`` (the
stages whose results depend on it: checkpoint fingerprints hash exactly the keys a stage reads),
``computed=False`` (no stage's numbers) and ``resumable=True`` (a resume may change it). A new key
is one :func:`opt` line; renamed and added keys are :mod:`bort2.config.migrate`'s.

No torch import: the command line reads this module before anything heavy loads.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from ..stages_index import BORT2_INITS, step1_methods, step2_methods

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

STEP1_METHODS = step1_methods()
STEP2_METHODS = step2_methods()
#: ``step2.hyper.convention``: the authors' Neumann series (no alpha factor), or hypergrad's
HYPER_CONVENTIONS = ("official", "library")
#: ``step2.hyper.labeler_mode``: F_theta's mode during the hyper step
LABELER_MODES = ("train", "eval")
#: ``step2.hinge_reduction`` / ``step2.hyper.outer_reduction``: over sigma's feature dimensions,
#: the authors' code takes the mean, the paper's Eqs. 5 and 7 write a sum
REDUCTIONS = ("mean", "sum")

INF = math.inf


def interval(
    lo: float, hi: float = INF, lo_open: bool = False, hi_open: bool = False
) -> tuple[float, float, bool, bool]:
    """A numeric constraint ``(lo, hi, lo excluded, hi excluded)``; an infinite end is open."""
    return (lo, hi, lo_open or lo == -INF, hi_open or hi == INF)


@dataclass(frozen=True)
class Readers:
    """The stages whose results a key changes: stage names or patterns (``"step2/*"``), less
    ``exclude``. ``ALL - {"step1/source_only"}`` reads as written."""

    include: frozenset[str]
    exclude: frozenset[str] = frozenset()

    def __contains__(self, stage: object) -> bool:
        hit = lambda pats: any(fnmatchcase(str(stage), p) for p in pats)  # noqa: E731
        return hit(self.include) and not hit(self.exclude)

    def __sub__(self, stages: Iterable[str]) -> Readers:
        return Readers(self.include, self.exclude | frozenset(stages))

    @property
    def patterns(self) -> frozenset[str]:
        """Every name or pattern written (a test checks each names a registered stage)."""
        return self.include | self.exclude


#: every stage (the default of the general, data, model and step-1 keys: step 2 starts from
#: step 1's models, so what changes step 1 changes step 2)
ALL = Readers(frozenset({"*"}))
#: every step-2 stage (the default of the ``step2.*`` keys)
STEP2 = Readers(frozenset({"step2/*"}))


def opt(
    default: Any = MISSING,
    help: str = "",  # noqa: A002 - the argparse word
    *,
    factory: Any = None,
    choices: tuple[str, ...] | None = None,
    range: tuple[float, float, bool, bool] | None = None,  # noqa: A002
    check: str | None = None,
    read_by: Readers | Iterable[str] | None = None,
    computed: bool = True,
    resumable: bool = False,
) -> Any:
    """A config field with its help line, its constraint and what it changes (in
    ``field.metadata``).

    ``choices``: the valid strings (for a list field: of every element). ``range``: see
    :func:`interval` (``None`` is accepted when the field's type allows it). ``check``: who
    checks a value neither can describe (e.g. ``"path"``, ``"target"``). Booleans need none.

    What the key changes, from which checkpoint identity is derived
    (:func:`bort2.checkpoint.config_fingerprint` hashes the keys a stage reads):

    * ``read_by``: the stages whose results depend on it (:class:`Readers`, or stage names and
      patterns); None: its section's ``READ_BY`` (:data:`ALL`, :data:`STEP2` for ``step2.*``,
      Stage C for ``step2.hyper.*``).
    * ``computed=False``: it changes no stage's numbers (where the run is, which stages it holds,
      how often it saves); no fingerprint holds it.
    * ``resumable=True``: a resume may change it (``resume=true`` compares every other key with
      the saved ``config.yaml``); implies ``computed=False``.
    """
    meta: dict[str, Any] = {"help": help, "computed": computed and not resumable}
    if resumable:
        meta["resumable"] = True
    if choices is not None:
        meta["choices"] = tuple(choices)
    if range is not None:
        meta["range"] = range
    if check is not None:
        meta["check"] = check
    if read_by is not None:
        meta["read_by"] = read_by if isinstance(read_by, Readers) else Readers(frozenset(read_by))
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    benchmark: str = opt(
        "minidigits",
        "the benchmark: MiniDigits (built locally) or a public release under data.root",
        choices=("minidigits", "digit5", "pacs", "domainnet"),
    )
    root: str | None = opt(
        None, "data root: the MiniDigits cache, or a real benchmark's folder", check="path"
    )
    seed: int = opt(
        0, "MiniDigits generation seed (its split seeds are fixed separately)", range=interval(0)
    )
    image_size: int = opt(32, "image side in pixels", range=interval(8))
    num_workers: int = opt(
        0, "DataLoader worker processes (0: load in the main process)", range=interval(0)
    )
    max_test: int = opt(
        0, "evaluate on at most this many target test images (0 = all)", range=interval(0)
    )
    views: str = opt(
        "official",
        "weak/strong augmentations: the authors' (official) or this project's earlier (legacy)",
        choices=("official", "legacy"),
    )
    check: bool = opt(
        False, "validate data.root, print images per domain and split, exit", resumable=True
    )


@dataclass
class ModelConfig:
    arch: str = opt(
        "digit_cnn",
        "backbone (resnet101: DomainNet)",
        choices=("digit_cnn", "resnet18", "resnet50", "resnet101"),
    )
    width: float = opt(
        0.125,
        "DigitCNN width multiplier (1.0 = the published network)",
        range=interval(0, lo_open=True),
    )
    weights_path: str | None = opt(None, "local ImageNet weights for ResNets", check="path")
    mixstyle_p: float = opt(0.5, "MixStyle: probability of mixing a batch", range=interval(0, 1))
    mixstyle_alpha: float = opt(
        0.1, "MixStyle: Beta(alpha, alpha) of the mixing weight", range=interval(0, lo_open=True)
    )
    sigma_head: str = opt(
        "official",
        "M_psi's stochastic layer: the authors' branch (official), or linear",
        choices=("official", "linear"),
        # step 1 builds no sigma layer, but its fingerprints have always hashed the key
        read_by=ALL - {"step2/naive"},
    )
    sync_bn: bool = opt(False, "under torchrun: BatchNorm statistics of the global batch")


@dataclass
class Step1Config:
    methods: list[str] = opt(
        help="step-1 models to train, in order (one name or a list: [source_only,fixmatch_cm])",
        factory=lambda: ["source_only", "fixmatch_cm"],
        choices=STEP1_METHODS,
        computed=False,  # which stages a run holds, not what one computes
    )
    labeler: str = opt(
        "fixmatch_cm",
        "which step-1 model becomes F_theta in step 2",
        choices=STEP1_METHODS,
        read_by=STEP2,
    )
    checkpoint: str | None = opt(
        None,
        "start step 2 from this step-1 checkpoint instead of training step 1",
        check="path",
        read_by=STEP2,
    )
    iters: int = opt(1500, "step-1 iterations per method", range=interval(1))
    batch_per_domain: int = opt(32, "source images per domain in a batch", range=interval(1))
    target_batch: int = opt(96, "target images in a batch", range=interval(1))
    lr: float = opt(0.05, "SGD learning rate (cosine schedule)", range=interval(0, lo_open=True))
    momentum: float = opt(0.9, "SGD momentum", range=interval(0, 1, hi_open=True))
    weight_decay: float = opt(5e-4, "SGD weight decay", range=interval(0))
    threshold: float = opt(0.95, "FixMatch confidence threshold", range=interval(0, 1))
    lambda_u: float = opt(1.0, "weight of the unlabeled (target) loss", range=interval(0))
    cm_variant: str = opt(
        "official",
        "FixMatch-CM loss: the authors' (official) or mixed",
        choices=("official", "mixed"),
        read_by=ALL - {"step1/source_only"},
    )
    lambda_d: float = opt(0.1, "DANN: weight of the domain loss", range=interval(0))
    lambda_m: float = opt(0.5, "M3SDA: weight of the moment-matching loss", range=interval(0))


@dataclass
class HyperConfig:
    """Stage C's hyper step (the bilevel update of F_theta), as
    :class:`bort2.step2.hyper.BilevelLabelUpdater` reads it."""

    READ_BY = Readers(frozenset({"step2/bort2"}))  # only Stage C takes hyper steps

    every: int = opt(30, "inner iterations between hyper steps", range=interval(1))
    lr: float = opt(5e-5, "F_theta's SGD learning rate", range=interval(0, lo_open=True))
    clip: float = opt(50.0, "hypergradient norm clip", range=interval(0, lo_open=True))
    steps: int = opt(
        3, "Neumann series: Hessian-vector products (steps + 1 terms)", range=interval(0)
    )
    alpha: float = opt(5e-5, "Neumann series: its step alpha", range=interval(0, lo_open=True))
    convention: str = opt(
        "official",
        "the authors' Neumann series, no alpha factor (official), or hypergrad.Neumann (library)",
        choices=HYPER_CONVENTIONS,
    )
    official_sign: bool = opt(False, "true: the authors' +log p in the hyper step's inner CE")
    outer_relu: bool = opt(True, "the authors' outer loss relu(mean log sigma)")
    outer_reduction: str = opt(
        "mean",
        "the outer loss over sigma's dimensions: mean (the authors' code) or sum (the paper's "
        "Eq. 7)",
        choices=REDUCTIONS,
    )
    labeler_mode: str = opt(
        "train",
        "F_theta's mode in the hyper step (train: the authors')",
        choices=LABELER_MODES,
    )
    apply: bool = opt(
        True, "false: a control, hyper steps computed but not applied (F_theta moves by BN only)"
    )


@dataclass
class Step2Config:
    READ_BY = STEP2
    methods: list[str] = opt(
        help="step-2 models to train (one name or a list: [naive,robust,bort2])",
        factory=lambda: ["naive", "robust", "bort2"],
        choices=STEP2_METHODS,
        computed=False,
    )
    iters: int = opt(
        1000,
        "iterations per stage: naive, Stage B (robust) and Stage C (bort2) each",
        range=interval(1),
    )
    batch_size: int = opt(128, "target images in a batch", range=interval(1))
    lr: float | None = opt(
        None,
        "M_psi's SGD learning rate (null: 0.1 x step1.lr, the authors' lr_mult)",
        range=interval(0, lo_open=True),
    )
    momentum: float = opt(0.9, "SGD momentum", range=interval(0, 1, hi_open=True))
    weight_decay: float = opt(5e-4, "SGD weight decay", range=interval(0))
    nesterov: bool = opt(False, "Nesterov momentum")
    warmup: int | None = opt(
        None,
        "Stage C iterations before the first hyper step (null: 0 from Stage B, iters/4 from "
        "step 1)",
        range=interval(0),
    )
    threshold: str = opt(
        "adaptive", "pseudo-label threshold tau", choices=("fixed", "adaptive", "per_class")
    )
    fixed_tau: float = opt(0.95, "tau of step2.threshold=fixed", range=interval(0, 1))
    ema_alpha: float = opt(
        0.999, "the adaptive threshold's EMA decay", range=interval(0, 1, hi_open=True)
    )
    teacher_ema: float = opt(
        0.999,
        "Stage B: labeler <- EMA of M_psi after every step (0 = frozen)",
        range=interval(0, 1, hi_open=True),
        read_by={"step2/robust", "step2/bort2"},
    )
    bort2_init: str = opt(
        "robust",
        "Stage C starts from Stage B's target model (robust), or from step 1",
        choices=tuple(BORT2_INITS),
        read_by={"step2/bort2"},
    )
    hinge_lambda: float = opt(0.1, "weight of the entropy hinge on sigma", range=interval(0))
    hinge_margin: float = opt(4.0, "margin m of the entropy hinge", range=interval(-INF))
    hinge_reduction: str = opt(
        "mean",
        "the entropy hinge (m - log sigma)+ over sigma's dimensions: mean (the authors' code) "
        "or sum (the paper's Eq. 5)",
        choices=REDUCTIONS,
        read_by={"step2/robust", "step2/bort2"},
    )
    sigma_init: float = opt(
        0.1, "initial sigma (model.sigma_head=linear only)", range=interval(0, lo_open=True)
    )
    labels: str = opt(
        "argmax",
        "inner-step labels of robust/bort2 (naive always uses argmax)",
        choices=("argmax", "gumbel"),
        read_by={"step2/robust", "step2/bort2"},
    )
    bort2_labels: str | None = opt(
        None,
        "Stage C's inner-step labels (null: step2.labels; gumbel: the paper's bilevel inner "
        "loop, Sec. 3.3.2)",
        choices=("argmax", "gumbel"),
        read_by={"step2/bort2"},
    )
    temperature: float = opt(1.0, "Gumbel-softmax temperature", range=interval(0, lo_open=True))
    student_view: str = opt(
        "strong", "M_psi's augmentation of the target batch", choices=("weak", "strong")
    )
    outer: str = opt(
        "train",
        "outer loss on the training batch or a held-out target split (val)",
        choices=("train", "val"),
    )
    val_fraction: float = opt(
        0.1, "the held-out share of step2.outer=val", range=interval(0, 1, True, True)
    )
    hyper: HyperConfig = opt(help="Stage C's hyper step", factory=HyperConfig)


@dataclass
class Config:
    preset: str | None = opt(
        None,
        "configs/presets/<name>.yaml on top of the config file (smoke, full, legacy, paper)",
        check="preset file",
        computed=False,  # its resolved values are fingerprinted, not its name
    )
    target: str = opt(
        "uci_m",
        "a domain name, or all: leave-one-domain-out over every domain",
        check="the benchmark's domains",
        computed=False,  # a field of the identity record itself
    )
    seeds: int = opt(1, "how many seeds, from seed", range=interval(1), computed=False)
    seed: int = opt(0, "the first seed", range=interval(0), computed=False)
    output_dir: str = opt("runs/bort2", "the run folder", check="path", resumable=True)
    resume: bool = opt(
        False, "continue the run in output_dir (Ctrl-C prints the command)", resumable=True
    )
    overwrite: bool = opt(
        False, "delete what the pipeline wrote in output_dir, then run", resumable=True
    )
    device: str = opt("auto", "auto: CUDA when there is one", choices=("auto", "cpu", "cuda"))
    threads: int = opt(
        1,
        "torch threads per process (0 = torch's default); 1 is fastest for these small "
        "models and is what the published timings use",
        range=interval(0),
    )
    reproducible: bool = opt(
        False,
        "the same numbers on every x86-64 CPU: baseline CPU kernels, MKL_CBWR=COMPATIBLE, "
        "`threads` fixed, deterministic algorithms (slower; docs/bort2.md)",
    )
    jobs: int = opt(
        1,
        "(target, seed) runs trained in parallel processes, each with `threads`",
        range=interval(1),
        resumable=True,
    )
    amp: str = opt(
        "off",
        "mixed precision: autocast to bf16, or fp16 (with a GradScaler, CUDA only)",
        choices=("off", "bf16", "fp16"),
    )
    checkpoint_every: int = opt(
        100, "iterations between checkpoints", range=interval(1), computed=False
    )
    eval_every: int = opt(250, "iterations between target test evaluations", range=interval(1))
    progress: bool = opt(
        True,
        "progress bars (when stderr is not a terminal: one line per 10% of a stage)",
        resumable=True,
    )
    tensorboard: bool = opt(True, "TensorBoard logs in every stage folder", resumable=True)
    tsne: bool = opt(True, "t-SNE figure of the first target's features", resumable=True)
    data: DataConfig = opt(help="the data", factory=DataConfig)
    model: ModelConfig = opt(help="the networks", factory=ModelConfig)
    step1: Step1Config = opt(help="step 1: the labelers", factory=Step1Config)
    step2: Step2Config = opt(help="step 2: naive, Stage B, Stage C", factory=Step2Config)


def step2_lr(cfg: Config) -> float:
    """M_psi's learning rate: ``step2.lr``, or the authors' 0.1 x ``step1.lr`` when unset."""
    return float(cfg.step2.lr) if cfg.step2.lr is not None else 0.1 * float(cfg.step1.lr)


def first_hyper_step(cfg: Config) -> int:
    """Inner iterations of Stage C before its first hyper step.

    ``step2.warmup`` when set; otherwise 0 when Stage C starts from Stage B (the authors' hyper
    steps run from the stage's start) and a quarter of the stage when it starts from step 1.
    """
    s2 = cfg.step2
    if s2.warmup is not None:
        return int(s2.warmup)
    return 0 if s2.bort2_init == "robust" else s2.iters // 4


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message lists the valid choices."""


# ----------------------------------------------------------------------------- the keys
@dataclass(frozen=True)
class Key:
    """One settable key: its dotted name, field (help and constraint) and type."""

    name: str
    field: Any  # dataclasses.Field
    type: Any
    section_readers: Readers = ALL  # its section's READ_BY

    @property
    def help(self) -> str:
        return str(self.field.metadata.get("help", ""))

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.field.metadata.get("choices")

    @property
    def range(self) -> tuple[float, float, bool, bool] | None:
        return self.field.metadata.get("range")

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    @property
    def base(self) -> Any:
        """The type without ``None``: ``int``, ``float``, ``str``, ``bool`` or ``list``."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        t = args[0] if self.optional and args else self.type
        return typing.get_origin(t) or t

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default is MISSING else f.default

    @property
    def read_by(self) -> Readers:
        """The stages whose results depend on the key (see :func:`opt`)."""
        return self.field.metadata.get("read_by", self.section_readers)

    @property
    def computed(self) -> bool:
        """Whether the key changes some stage's numbers."""
        return bool(self.field.metadata.get("computed", True))

    @property
    def resumable(self) -> bool:
        """Whether a resume may change the key."""
        return bool(self.field.metadata.get("resumable", False))

    def reads(self, stage: str) -> bool:
        """Whether stage ``stage``'s results depend on the key (its fingerprint holds it)."""
        return self.computed and stage in self.read_by

    def get(self, cfg: Any) -> Any:
        for part in self.name.split("."):
            cfg = getattr(cfg, part)
        return cfg


def _walk(cls: type, prefix: str = "", readers: Readers = ALL) -> list[Key]:
    hints = typing.get_type_hints(cls)
    readers = getattr(cls, "READ_BY", readers)
    out: list[Key] = []
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            out.extend(_walk(t, f"{prefix}{f.name}.", readers))  # type: ignore[arg-type]
        else:
            out.append(Key(f"{prefix}{f.name}", f, t, readers))
    return out


#: every settable key, in schema order
KEYS: dict[str, Key] = {k.name: k for k in _walk(Config)}
VALID_KEYS = list(KEYS)
SECTIONS = sorted({k.rpartition(".")[0] for k in KEYS if "." in k})
#: the keys a resume may change (``resumable=True``)
RESUMABLE_KEYS = tuple(k for k, key in KEYS.items() if key.resumable)


def read_keys(stage: str) -> tuple[str, ...]:
    """The keys whose values change stage ``stage``'s results (what its fingerprint hashes)."""
    return tuple(k for k, key in KEYS.items() if key.reads(stage))


def ignored_keys(stage: str) -> tuple[str, ...]:
    """The computed keys that stage ``stage`` never reads (``StageSpec.ignores``)."""
    return tuple(k for k, key in KEYS.items() if key.computed and not key.reads(stage))


def flat_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a.b.c": value}`` (configs, for comparing and fingerprinting)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in KEYS:
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flat_keys`."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parts, last = key.split(".")
        for p in parts:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):  # "a=1" and "a.b=2": let the schema refuse it
                break
        else:
            node[last] = value
    return tree
