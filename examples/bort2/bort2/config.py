"""Configuration schema of the BORT2 pipeline: dataclasses, YAML files and dotted CLI overrides.

Precedence (later wins): the schema defaults, the YAML file given with ``--config`` (default
``configs/minidigits.yaml``), the preset named by ``preset=...`` (``configs/presets/<name>.yaml``),
then ``key=value`` overrides from the command line (``step2.iters=500``). Unknown keys and values
outside their valid choices are errors that list what is valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

STEP1_METHODS = ("source_only", "fixmatch", "fixmatch_cm", "dann", "m3sda")
STEP2_METHODS = ("naive", "robust", "bort2")
CHOICES: dict[str, tuple[str, ...]] = {
    "data.benchmark": ("minidigits", "digit5", "pacs", "domainnet"),
    "model.arch": ("digit_cnn", "resnet18", "resnet50", "resnet101"),  # 101: DomainNet
    "step1.labeler": STEP1_METHODS,
    "step2.threshold": ("fixed", "adaptive", "per_class"),
    "step2.outer": ("train", "val"),
    "step2.labels": ("argmax", "gumbel"),
    "step2.student_view": ("weak", "strong"),
    "step2.bort2_init": ("robust", "step1"),
    "step2.hyper_convention": ("official", "library"),
    "step2.labeler_mode": ("train", "eval"),
    "step1.cm_variant": ("official", "mixed"),
    "model.sigma_head": ("official", "linear"),
    "data.views": ("official", "legacy"),
    "device": ("auto", "cpu", "cuda"),
    "amp": ("off", "bf16", "fp16"),
}


@dataclass
class DataConfig:
    benchmark: str = "minidigits"
    root: str | None = None  # data root (MiniDigits cache or a real benchmark's folder)
    seed: int = 0  # MiniDigits generation seed (its split seeds are fixed separately)
    image_size: int = 32
    num_workers: int = 0
    max_test: int = 0  # evaluate on at most this many target test images (0 = all)
    views: str = "official"  # weak/strong augmentations: the authors' (official) or legacy
    check: bool = False  # validate data.root, print images per domain and split, exit


@dataclass
class ModelConfig:
    arch: str = "digit_cnn"
    width: float = 0.125  # DigitCNN width multiplier (1.0 = the published network)
    weights_path: str | None = None  # local ImageNet weights for ResNets
    mixstyle_p: float = 0.5
    mixstyle_alpha: float = 0.1
    sigma_head: str = "official"  # M_psi's stochastic layer: the authors' branch, or linear
    sync_bn: bool = False  # under torchrun: BatchNorm statistics of the global batch


@dataclass
class Step1Config:
    methods: list[str] = field(default_factory=lambda: ["source_only", "fixmatch_cm"])
    labeler: str = "fixmatch_cm"  # which step-1 model becomes F_theta in step 2
    checkpoint: str | None = None  # start step 2 from this step-1 checkpoint instead
    iters: int = 1500
    batch_per_domain: int = 32
    target_batch: int = 96
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    threshold: float = 0.95
    lambda_u: float = 1.0
    cm_variant: str = "official"  # FixMatch-CM loss: the authors' (official) or mixed
    lambda_d: float = 0.1  # DANN
    lambda_m: float = 0.5  # M3SDA


@dataclass
class Step2Config:
    methods: list[str] = field(default_factory=lambda: ["naive", "robust", "bort2"])
    iters: int = 1000  # per stage: naive, Stage B (robust) and Stage C (bort2) each
    batch_size: int = 128
    lr: float | None = None  # None: 0.1 x step1.lr (the authors' lr_mult=0.1)
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    warmup: int | None = None  # inner iterations before the first hyper step (None: auto)
    threshold: str = "adaptive"
    fixed_tau: float = 0.95
    ema_alpha: float = 0.999  # the adaptive threshold's EMA
    teacher_ema: float = 0.999  # Stage B: labeler <- EMA of M_psi after every step (0 = frozen)
    bort2_init: str = "robust"  # Stage C starts from Stage B's target model, or from step 1
    hinge_lambda: float = 0.1
    hinge_margin: float = 4.0
    sigma_init: float = 0.1  # model.sigma_head=linear only
    labels: str = "argmax"  # inner-step labels of robust/bort2 (naive always uses argmax)
    temperature: float = 1.0
    student_view: str = "strong"
    hyper_every: int = 30
    hyper_lr: float = 5e-5
    hyper_clip: float = 50.0
    neumann_steps: int = 3
    neumann_alpha: float = 5e-5
    hyper_convention: str = "official"  # the authors' Neumann series (no alpha factor), or library
    official_sign: bool = False  # true: the authors' +log p in the hyper step's inner CE
    outer_relu: bool = True  # the authors' outer loss relu(mean log sigma)
    labeler_mode: str = "train"  # F_theta's mode in the hyper step (train: the authors')
    zero_hypergradient: bool = False  # control: hyper steps computed, not applied (BN only)
    outer: str = "train"  # outer loss on the training batch or a held-out target split
    val_fraction: float = 0.1


@dataclass
class Config:
    preset: str | None = None
    target: str = "uci_m"  # a domain name, or "all" for leave-one-domain-out over every domain
    seeds: int = 1
    seed: int = 0
    output_dir: str = "runs/bort2"
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    threads: int = 1  # torch threads; 1 is fastest for these small CPU models (0 = default)
    jobs: int = 1  # (target, seed) runs trained in parallel processes, each with `threads`
    amp: str = "off"  # mixed precision: autocast to bf16 or fp16 (fp16: with a GradScaler on CUDA)
    checkpoint_every: int = 100
    eval_every: int = 250
    progress: bool = True
    tensorboard: bool = True
    tsne: bool = True
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    step1: Step1Config = field(default_factory=Step1Config)
    step2: Step2Config = field(default_factory=Step2Config)


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


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(_keys(type(default), name + "."))
        else:
            out.append(name)
    return out


VALID_KEYS = _keys(Config)


def _merge(base: Any, other: Any, origin: str) -> Any:
    try:
        return OmegaConf.merge(base, other)
    except (ConfigKeyError, ConfigAttributeError) as exc:
        key = getattr(exc, "full_key", None) or str(exc)
        raise ConfigError(
            f"unknown config key {key!r} in {origin}; valid keys: {', '.join(VALID_KEYS)}"
        ) from None
    except ValidationError as exc:
        raise ConfigError(
            f"bad value in {origin}: {exc.msg if hasattr(exc, 'msg') else exc}"
        ) from None


def validate(cfg: Config) -> None:
    """Check every choice-valued key and list-valued method names."""
    for key, valid in CHOICES.items():
        section, _, name = key.rpartition(".")
        obj = getattr(cfg, section) if section else cfg
        value = getattr(obj, name)
        if value not in valid:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")
    for key, valid, values in (
        ("step1.methods", STEP1_METHODS, cfg.step1.methods),
        ("step2.methods", STEP2_METHODS, cfg.step2.methods),
    ):
        bad = [v for v in values if v not in valid]
        if bad:
            raise ConfigError(f"{key} contains {bad}; valid methods: {', '.join(valid)}")
    if (
        cfg.step2.methods
        and cfg.step1.checkpoint is None
        and cfg.step1.labeler not in cfg.step1.methods
    ):
        raise ConfigError(
            f"step1.labeler={cfg.step1.labeler!r} must be one of step1.methods "
            f"{list(cfg.step1.methods)} (or give step1.checkpoint=PATH)"
        )
    for key, (lo, hi, lo_open, hi_open) in RANGES.items():
        section, _, name = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if value is None and key in OPTIONAL:
            continue
        bad = not math.isfinite(value) or value < lo or value > hi
        bad = bad or (lo_open and value == lo) or (hi_open and value == hi)
        if bad:
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            raise ConfigError(
                f"{key} must be a finite number in {left}{lo:g}, {hi:g}{right}, got {value}"
            )


def _range(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False):
    return (lo, hi, lo_open, hi_open or hi == math.inf)


#: every numeric key and its valid interval (lo, hi, lo excluded, hi excluded)
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "seeds": _range(1),
    "seed": _range(0),
    "jobs": _range(1),
    "threads": _range(0),
    "checkpoint_every": _range(1),
    "eval_every": _range(1),
    "data.seed": _range(0),
    "data.image_size": _range(8),
    "data.num_workers": _range(0),
    "data.max_test": _range(0),
    "model.width": _range(0, lo_open=True),
    "model.mixstyle_p": _range(0, 1),
    "model.mixstyle_alpha": _range(0, lo_open=True),
    "step1.iters": _range(1),
    "step1.batch_per_domain": _range(1),
    "step1.target_batch": _range(1),
    "step1.lr": _range(0, lo_open=True),
    "step1.momentum": _range(0, 1, hi_open=True),
    "step1.weight_decay": _range(0),
    "step1.threshold": _range(0, 1),
    "step1.lambda_u": _range(0),
    "step1.lambda_d": _range(0),
    "step1.lambda_m": _range(0),
    "step2.iters": _range(1),
    "step2.batch_size": _range(1),
    "step2.lr": _range(0, lo_open=True),
    "step2.momentum": _range(0, 1, hi_open=True),
    "step2.weight_decay": _range(0),
    "step2.warmup": _range(0),
    "step2.fixed_tau": _range(0, 1),
    "step2.ema_alpha": _range(0, 1, hi_open=True),
    "step2.teacher_ema": _range(0, 1, hi_open=True),
    "step2.hinge_lambda": _range(0),
    "step2.hinge_margin": _range(-math.inf),
    "step2.sigma_init": _range(0, lo_open=True),
    "step2.temperature": _range(0, lo_open=True),
    "step2.hyper_every": _range(1),
    "step2.hyper_lr": _range(0, lo_open=True),
    "step2.hyper_clip": _range(0, lo_open=True),
    "step2.neumann_steps": _range(0),
    "step2.neumann_alpha": _range(0, lo_open=True),
    "step2.val_fraction": _range(0, 1, lo_open=True, hi_open=True),
}
OPTIONAL = ("step2.lr", "step2.warmup")


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
    cfg = _merge(schema, OmegaConf.load(path), str(path))
    cli = OmegaConf.from_dotlist(overrides)
    preset = cli.get("preset", None) or cfg.preset
    if preset:
        ppath = CONFIG_DIR / "presets" / f"{preset}.yaml"
        if not ppath.is_file():
            valid = sorted(p.stem for p in (CONFIG_DIR / "presets").glob("*.yaml"))
            raise ConfigError(f"unknown preset {preset!r}; valid presets: {', '.join(valid)}")
        cfg = _merge(cfg, OmegaConf.load(ppath), str(ppath))
    cfg = _merge(cfg, cli, "the command line")
    obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(obj)
    return obj


def to_yaml(cfg: Config) -> str:
    """The resolved configuration as YAML (saved next to every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
