"""Configuration schema of the BORT2 pipeline: dataclasses, YAML files and dotted CLI overrides.

Precedence (later wins): the schema defaults, the YAML file given with ``--config`` (default
``configs/minidigits.yaml``), the preset named by ``preset=...`` (``configs/presets/<name>.yaml``),
then ``key=value`` overrides from the command line (``step2.iters=500``).

Every field carries its own constraint and help line in its metadata (:func:`opt`): ``choices``,
a numeric ``range``, or ``check`` naming who checks a free-form value (a path, the target
domain). :func:`validate` walks the fields, so a new field is checked by declaring it; a test
fails when a field lacks a help line or a constraint. Unknown keys are errors that suggest the
closest valid key; renamed keys (:data:`ALIASES`) are still read, with a note.

The hyper step of Stage C has its own section, ``step2.hyper`` (:class:`HyperConfig`), whose
field names are those of :class:`bort2.step2.hyper.HyperSettings`; the flat names it replaced
(``step2.hyper_convention``, ``step2.hyper_lr``, ..., ``step2.zero_hypergradient``) are aliases,
so saved ``config.yaml`` files and old command lines still work.
"""

from __future__ import annotations

import difflib
import math
import typing
import warnings
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from .stages_index import BORT2_INITS, step1_methods, step2_methods

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

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


def opt(
    default: Any = MISSING,
    help: str = "",  # noqa: A002 - the argparse word
    *,
    factory: Any = None,
    choices: tuple[str, ...] | None = None,
    range: tuple[float, float, bool, bool] | None = None,  # noqa: A002
    check: str | None = None,
) -> Any:
    """A config field with its help line and its constraint (in ``field.metadata``).

    ``choices``: the valid strings (for a list field: of every element). ``range``: see
    :func:`interval` (``None`` is accepted when the field's type allows it). ``check``: who
    checks a value neither can describe (e.g. ``"path"``, ``"target"``). Booleans need none.
    """
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if range is not None:
        meta["range"] = range
    if check is not None:
        meta["check"] = check
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
    check: bool = opt(False, "validate data.root, print images per domain and split, exit")


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
    )
    sync_bn: bool = opt(False, "under torchrun: BatchNorm statistics of the global batch")


@dataclass
class Step1Config:
    methods: list[str] = opt(
        help="step-1 models to train, in order (one name or a list: [source_only,fixmatch_cm])",
        factory=lambda: ["source_only", "fixmatch_cm"],
        choices=STEP1_METHODS,
    )
    labeler: str = opt(
        "fixmatch_cm", "which step-1 model becomes F_theta in step 2", choices=STEP1_METHODS
    )
    checkpoint: str | None = opt(
        None,
        "start step 2 from this step-1 checkpoint instead of training step 1",
        check="path",
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
    )
    lambda_d: float = opt(0.1, "DANN: weight of the domain loss", range=interval(0))
    lambda_m: float = opt(0.5, "M3SDA: weight of the moment-matching loss", range=interval(0))


@dataclass
class HyperConfig:
    """Stage C's hyper step (the bilevel update of F_theta); the names of
    :class:`bort2.step2.hyper.HyperSettings`."""

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
    methods: list[str] = opt(
        help="step-2 models to train (one name or a list: [naive,robust,bort2])",
        factory=lambda: ["naive", "robust", "bort2"],
        choices=STEP2_METHODS,
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
    )
    bort2_init: str = opt(
        "robust",
        "Stage C starts from Stage B's target model (robust), or from step 1",
        choices=tuple(BORT2_INITS),
    )
    hinge_lambda: float = opt(0.1, "weight of the entropy hinge on sigma", range=interval(0))
    hinge_margin: float = opt(4.0, "margin m of the entropy hinge", range=interval(-INF))
    hinge_reduction: str = opt(
        "mean",
        "the entropy hinge (m - log sigma)+ over sigma's dimensions: mean (the authors' code) "
        "or sum (the paper's Eq. 5)",
        choices=REDUCTIONS,
    )
    sigma_init: float = opt(
        0.1, "initial sigma (model.sigma_head=linear only)", range=interval(0, lo_open=True)
    )
    labels: str = opt(
        "argmax",
        "inner-step labels of robust/bort2 (naive always uses argmax)",
        choices=("argmax", "gumbel"),
    )
    bort2_labels: str | None = opt(
        None,
        "Stage C's inner-step labels (null: step2.labels; gumbel: the paper's bilevel inner "
        "loop, Sec. 3.3.2)",
        choices=("argmax", "gumbel"),
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
    )
    target: str = opt(
        "uci_m",
        "a domain name, or all: leave-one-domain-out over every domain",
        check="the benchmark's domains",
    )
    seeds: int = opt(1, "how many seeds, from seed", range=interval(1))
    seed: int = opt(0, "the first seed", range=interval(0))
    output_dir: str = opt("runs/bort2", "the run folder", check="path")
    resume: bool = opt(False, "continue the run in output_dir (Ctrl-C prints the command)")
    overwrite: bool = opt(False, "delete what the pipeline wrote in output_dir, then run")
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
    )
    amp: str = opt(
        "off",
        "mixed precision: autocast to bf16, or fp16 (with a GradScaler, CUDA only)",
        choices=("off", "bf16", "fp16"),
    )
    checkpoint_every: int = opt(100, "iterations between checkpoints", range=interval(1))
    eval_every: int = opt(250, "iterations between target test evaluations", range=interval(1))
    progress: bool = opt(
        True, "progress bars (when stderr is not a terminal: one line per 10% of a stage)"
    )
    tensorboard: bool = opt(True, "TensorBoard logs in every stage folder")
    tsne: bool = opt(True, "t-SNE figure of the first target's features")
    data: DataConfig = opt(help="the data", factory=DataConfig)
    model: ModelConfig = opt(help="the networks", factory=ModelConfig)
    step1: Step1Config = opt(help="step 1: the labelers", factory=Step1Config)
    step2: Step2Config = opt(help="step 2: naive, Stage B, Stage C", factory=Step2Config)


class _Renamed:
    """Attribute access under a renamed key's old name (``cfg.step2.hyper_lr``), for one
    release: code that reads it keeps working; new code reads ``cfg.step2.hyper.lr``."""

    def __init__(self, name: str, negate: bool = False):
        self.name, self.negate = name, negate

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        value = getattr(obj.hyper, self.name)
        return (not value) if self.negate else value

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.hyper, self.name, (not value) if self.negate else value)


#: old key -> (new key, negated): read from YAML files, presets, saved ``config.yaml`` files and
#: the command line with a note; they go in a later release
ALIASES: dict[str, tuple[str, bool]] = {
    "step2.hyper_every": ("step2.hyper.every", False),
    "step2.hyper_lr": ("step2.hyper.lr", False),
    "step2.hyper_clip": ("step2.hyper.clip", False),
    "step2.neumann_steps": ("step2.hyper.steps", False),
    "step2.neumann_alpha": ("step2.hyper.alpha", False),
    "step2.hyper_convention": ("step2.hyper.convention", False),
    "step2.official_sign": ("step2.hyper.official_sign", False),
    "step2.outer_relu": ("step2.hyper.outer_relu", False),
    "step2.labeler_mode": ("step2.hyper.labeler_mode", False),
    "step2.zero_hypergradient": ("step2.hyper.apply", True),
}
for _old, (_new, _neg) in ALIASES.items():
    setattr(Step2Config, _old.split(".")[1], _Renamed(_new.split(".")[2], _neg))

#: keys added after the fingerprint layout was fixed (``preset=paper``'s switches): while a key
#: is at its default (the authors' code) :func:`legacy_tree` leaves it out, so a checkpoint
#: written before it existed still matches its stage
ADDED_KEYS: tuple[str, ...] = (
    "step2.hinge_reduction",
    "step2.bort2_labels",
    "step2.hyper.outer_reduction",
    "reproducible",
)


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


# ----------------------------------------------------------------------------- the fields
@dataclass(frozen=True)
class Key:
    """One settable key: its dotted name, field (help and constraint) and type."""

    name: str
    field: Any  # dataclasses.Field
    type: Any

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

    def get(self, cfg: Any) -> Any:
        for part in self.name.split("."):
            cfg = getattr(cfg, part)
        return cfg


def _walk(cls: type, prefix: str = "") -> list[Key]:
    hints = typing.get_type_hints(cls)
    out: list[Key] = []
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            out.extend(_walk(t, f"{prefix}{f.name}."))  # type: ignore[arg-type]
        else:
            out.append(Key(f"{prefix}{f.name}", f, t))
    return out


#: every settable key, in schema order
KEYS: dict[str, Key] = {k.name: k for k in _walk(Config)}
VALID_KEYS = list(KEYS)
_SECTIONS = sorted({k.rpartition(".")[0] for k in KEYS if "." in k})


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _interval(r: tuple[float, float, bool, bool]) -> str:
    lo, hi, lo_open, hi_open = r
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def _parts(key: str) -> tuple[str, str, str]:
    k = KEYS[key]
    kind = {bool: "bool", int: "int", float: "float", str: "str", list: "list"}.get(k.base, "?")
    valid = ""
    if k.choices is not None:
        valid = "{" + ",".join(k.choices) + "}"
    elif k.range is not None:
        valid = _interval(k.range)
    tail = f"{kind}{' or null' if k.optional else ''}{' ' + valid if valid else ''}"
    return f"{key}={_show(k.default)}", tail, k.help


def describe(key: str, widths: tuple[int, int] = (0, 0)) -> str:
    """One line for ``--help``: ``key=default``, the type and valid values, what the key does."""
    head, tail, text = _parts(key)
    return f"{head:<{widths[0]}}  {tail:<{widths[1]}}  {text}"


def help_text() -> str:
    """Every key with its default, valid values and help line, by section (``--help``)."""
    parts = [_parts(key) for key in KEYS]
    widths = (max(len(p[0]) for p in parts), min(28, max(len(p[1]) for p in parts)))
    lines: list[str] = []
    section = None
    for key in KEYS:
        sec = key.rpartition(".")[0]
        if sec != section:
            section = sec
            lines.append(f"{sec}:" if sec else "general:")
        lines.append("  " + describe(key, widths))
    lines.append("renamed keys (still read, with a note):")
    lines += [
        f"  {old} -> {new}{' (negated)' if neg else ''}" for old, (new, neg) in ALIASES.items()
    ]
    return "\n".join(lines)


def suggest(key: str) -> str:
    """``"; did you mean step1.iters?"`` for the closest valid key, else the keys of its
    section (``model.depth``: every ``model.*`` key)."""
    names = list(KEYS) + list(ALIASES)
    sec, _, last = key.rpartition(".")
    close: list[str] = []
    if sec in _SECTIONS or sec == "":  # a misspelled name in a known section
        inside = [k.rpartition(".")[2] for k in names if k.rpartition(".")[0] == sec]
        hit = difflib.get_close_matches(last, inside, n=1, cutoff=0.7)
        close = [f"{sec}.{hit[0]}" if sec else hit[0]] if hit else []
    else:  # a misspelled section
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.85)
    if close:
        return f"; did you mean {ALIASES.get(close[0], (close[0], False))[0]}?"
    while sec and sec not in _SECTIONS:
        sec = sec.rpartition(".")[0]
    inside = [k for k in KEYS if k.rpartition(".")[0] == sec]
    if not sec:
        inside += [f"{s}.*" for s in _SECTIONS]
    return f"; valid keys{' of ' + sec if sec else ''}: {', '.join(inside)}"


# ----------------------------------------------------------------------------- validation
def validate(cfg: Config) -> None:
    """Check every field against the constraint declared next to it, then the cross-key rules."""
    for k in KEYS.values():
        value = k.get(cfg)
        if value is None:
            if k.optional:
                continue
            raise ConfigError(f"{k.name} must be set (null is not valid)")
        if k.choices is not None:
            if isinstance(value, list):
                bad = [v for v in value if v not in k.choices]
                if bad:
                    raise ConfigError(
                        f"{k.name} contains {bad}; valid methods: {', '.join(k.choices)}"
                    )
            elif value not in k.choices:
                raise ConfigError(
                    f"{k.name}={value!r} is not valid; choose one of {', '.join(k.choices)}"
                )
        if k.range is not None:
            lo, hi, lo_open, hi_open = k.range
            bad = not math.isfinite(value) or value < lo or value > hi
            bad = bad or (lo_open and value == lo) or (hi_open and value == hi)
            if bad:
                raise ConfigError(
                    f"{k.name} must be a finite number in {_interval(k.range)}, got {value}"
                )
    if (
        cfg.step2.methods
        and cfg.step1.checkpoint is None
        and cfg.step1.labeler not in cfg.step1.methods
    ):
        raise ConfigError(
            f"step1.labeler={cfg.step1.labeler!r} must be one of step1.methods "
            f"{list(cfg.step1.methods)} (or give step1.checkpoint=PATH)"
        )


def validate_target(cfg: Config) -> list[str]:
    """The target domains a run will use; a clear error for a name the benchmark lacks.

    Checked from the benchmark's fixed domain list, before any data are loaded.
    """
    from .data.registry import benchmark_domains

    domains = benchmark_domains(cfg.data.benchmark)
    if cfg.target == "all":
        return list(domains)
    if cfg.target not in domains:
        raise ConfigError(
            f"target={cfg.target!r} is not a domain of {cfg.data.benchmark}; choose one of "
            f"{', '.join(domains)} or all"
        )
    return [cfg.target]


# ----------------------------------------------------------------------------- loading
class RenamedKeyWarning(FutureWarning):
    """A config key under its old name (:data:`ALIASES`): read, and to be renamed."""


def flat_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a.b.c": value}`` (configs, for comparing and fingerprinting)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in KEYS:
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
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


def upgrade(tree: dict[str, Any], origin: str, note: bool = True) -> dict[str, Any]:
    """A config mapping with renamed keys under their new names (negated where the meaning
    flipped) and a list key given as one name (``step2.methods=bort2``) or a comma-separated
    string made a list. A note names each old key when ``note``."""
    flat = flat_keys(tree)
    for old, (new, negate) in ALIASES.items():
        if old not in flat:
            continue
        if new in flat:
            raise ConfigError(f"{origin} sets both {old} and its new name {new}; keep {new}")
        value = flat.pop(old)
        if negate and isinstance(value, bool):
            value = not value
        elif negate and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() != "true"
        flat[new] = value
        if note:
            flip = " (negated: the new key says the opposite)" if negate else ""
            warnings.warn(
                f"config key {old} in {origin} is now {new}{flip}; the old name is read for "
                "now and will be removed",
                RenamedKeyWarning,
                stacklevel=3,
            )
    for key, value in flat.items():
        k = KEYS.get(key)
        if k is not None and k.base is list and isinstance(value, str):
            flat[key] = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
    return _nest(flat)


def _merge(base: Any, other: Any, origin: str) -> Any:
    try:
        if not isinstance(other, dict):
            other = OmegaConf.to_container(other) if other is not None else {}
        if not isinstance(other, dict):
            raise ConfigError(f"{origin} is not a mapping of config keys")
        tree = upgrade(other, origin)
        _no_interpolation(tree, origin)
        unknown = [k for k in flat_keys(tree) if k not in KEYS]
        if unknown:
            raise ConfigKeyError(unknown[0])
        return OmegaConf.merge(base, OmegaConf.create(tree))
    except (ConfigKeyError, ConfigAttributeError) as exc:
        key = getattr(exc, "full_key", None) or str(exc).strip("'")
        raise ConfigError(
            f"unknown config key {key!r} in {origin}{suggest(key)} "
            "(`run.py --help` lists every key)"
        ) from None
    except ValidationError as exc:
        key = getattr(exc, "full_key", None)
        text = exc.msg if hasattr(exc, "msg") else str(exc)
        if key in KEYS:
            text = f"{key}: {text}; expected {_parts(key)[1]}"
        raise ConfigError(f"bad value in {origin}: {text}") from None


def yaml_problem(exc: BaseException, located: bool = True) -> str:
    """What a YAML parser's error says, as one line: where (``line L, column C``, when
    ``located``) and what.

    A tag that would build a Python object (``!!python/object/apply:...``) is named as such:
    nothing is ever constructed from a config file (the loader is a safe one).
    """
    import yaml

    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark and located else ""
    problem = (getattr(exc, "problem", None) or "").strip()
    if isinstance(exc, yaml.constructor.ConstructorError) and "for the tag" in problem:
        tag = problem.split("for the tag", 1)[1].strip().strip("'\"")
        tag = tag.replace("tag:yaml.org,2002:", "!!")
        return (
            f"{where}the tag {tag} is not allowed: configuration values are plain YAML "
            "(numbers, strings, lists, mappings of keys); tags that would build Python objects "
            "are refused, and nothing was executed"
        )
    if not problem:
        problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    context = (getattr(exc, "context", None) or "").strip()
    cmark = getattr(exc, "context_mark", None)
    if context and located and cmark is not None and cmark is not mark:
        context += f" that starts at line {cmark.line + 1}, column {cmark.column + 1}"
    return where + problem + (f" ({context})" if context else "")


def _load_yaml(path: Path, what: str) -> Any:
    """``OmegaConf.load(path)`` with every way a file can fail to be a config file turned into
    one :class:`ConfigError` naming the file, the line when known, and what is wrong."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not a text file (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start} is not UTF-8); give a YAML file of config keys"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except OmegaConfBaseException as exc:
        problem = _omegaconf_problem(exc)
        raise ConfigError(f"{what} {path} is not a config file: {problem}") from None


def _omegaconf_problem(exc: BaseException) -> str:
    msg = str(getattr(exc, "msg", None) or exc).strip()
    line = msg.splitlines()[0] if msg else type(exc).__name__
    key = getattr(exc, "full_key", None)
    return f"{key}: {line}" if key else line


def _no_interpolation(tree: Any, origin: str) -> None:
    """Config values are plain values: an OmegaConf interpolation (``${...}``) is refused with
    one line instead of failing later as a traceback."""
    if not isinstance(tree, dict):
        return
    for key, value in flat_keys(tree).items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, str) and "${" in v:
                raise ConfigError(
                    f"bad value in {origin}: {key}={v}: interpolations (${{...}}) are not "
                    "supported; give the value itself"
                )


def _dotlist(overrides: list[str]) -> Any:
    """The ``key=value`` overrides as a config (values are parsed as YAML, one line each)."""
    import yaml

    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as exc:
            key, _, value = item.partition("=")
            raise ConfigError(
                f"override {item!r}: the value {value!r} of {key} is not valid YAML "
                f"({yaml_problem(exc, located=False)})"
            ) from None
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item!r}: {_omegaconf_problem(exc)}") from None
    return OmegaConf.from_dotlist(overrides)


def load_config(
    config_file: str | Path | None = None, overrides: list[str] | None = None
) -> Config:
    """Build the run configuration.

    Args:
        config_file: YAML file (default: ``configs/minidigits.yaml``).
        overrides: dotted ``key=value`` strings, e.g. ``["step2.iters=100", "preset=smoke"]``.

    Returns:
        A validated :class:`Config`.
    """
    overrides = list(overrides or [])
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. step2.iters=500)")
    schema = OmegaConf.structured(Config)
    path = Path(config_file) if config_file else CONFIG_DIR / "minidigits.yaml"
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder, not a YAML file")
    cfg = _merge(schema, _load_yaml(path, "config file"), str(path))
    cli = _dotlist(overrides)
    preset = cli.get("preset", None) or cfg.preset
    if preset:
        ppath = CONFIG_DIR / "presets" / f"{preset}.yaml"
        if not ppath.is_file():
            valid = sorted(p.stem for p in (CONFIG_DIR / "presets").glob("*.yaml"))
            raise ConfigError(f"unknown preset {preset!r}; valid presets: {', '.join(valid)}")
        cfg = _merge(cfg, _load_yaml(ppath, "preset file"), str(ppath))
    cfg = _merge(cfg, cli, "the command line")
    try:
        obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad configuration: {_omegaconf_problem(exc)}") from None
    validate(obj)
    return obj


def to_yaml(cfg: Config) -> str:
    """The resolved configuration as YAML (saved next to every run).

    A key of :data:`ADDED_KEYS` at its default is left out, as in :func:`legacy_tree`: a
    ``config.yaml`` written before the key existed then still equals this run's (``resume=true``
    compares the two), and a changed value is still written and compared.
    """
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    for key in ADDED_KEYS:
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        if node[last] == KEYS[key].default:
            del node[last]
    return OmegaConf.to_yaml(tree)


def legacy_tree(cfg: Config) -> dict[str, Any]:
    """``dataclasses.asdict(cfg)`` with the renamed keys under their old names (negated where
    the meaning flipped) and the keys of :data:`ADDED_KEYS` left out while at their defaults:
    what checkpoint fingerprints hash, so that checkpoints written before the renames and the
    additions still match their stage."""
    import dataclasses

    flat = flat_keys(dataclasses.asdict(cfg))
    for old, (new, negate) in ALIASES.items():
        value = flat.pop(new)
        flat[old] = (not value) if negate else value
    for key in ADDED_KEYS:  # at its default, a key added later leaves old fingerprints as they were
        if key in flat and flat[key] == KEYS[key].default:
            del flat[key]
    return _nest(flat)
