"""Configuration schema of the BORT2 pipeline: dataclasses, YAML files and dotted CLI overrides.

Precedence (later wins): the schema defaults, the YAML file given with ``--config`` (default
``configs/minidigits.yaml``), the preset named by ``preset=...`` (``configs/presets/<name>.yaml``),
then ``key=value`` overrides from the command line (``step2.iters=500``). Unknown keys and values
outside their valid choices are errors that list what is valid.
"""

from __future__ import annotations

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
    "model.arch": ("digit_cnn", "resnet18", "resnet50"),
    "step1.labeler": STEP1_METHODS,
    "step2.threshold": ("fixed", "adaptive", "per_class"),
    "step2.outer": ("train", "val"),
    "step2.labels": ("gumbel", "argmax"),
    "step2.student_view": ("weak", "strong"),
    "device": ("auto", "cpu", "cuda"),
}


@dataclass
class DataConfig:
    benchmark: str = "minidigits"
    root: str | None = None  # data root (MiniDigits cache or a real benchmark's folder)
    seed: int = 0  # MiniDigits generation seed (its split seeds are fixed separately)
    image_size: int = 32
    num_workers: int = 0
    max_test: int = 0  # evaluate on at most this many target test images (0 = all)


@dataclass
class ModelConfig:
    arch: str = "digit_cnn"
    width: float = 0.125  # DigitCNN width multiplier (1.0 = the published network)
    weights_path: str | None = None  # local ImageNet weights for ResNets
    mixstyle_p: float = 0.5
    mixstyle_alpha: float = 0.1


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
    lambda_d: float = 0.1  # DANN
    lambda_m: float = 0.5  # M3SDA


@dataclass
class Step2Config:
    methods: list[str] = field(default_factory=lambda: ["naive", "robust", "bort2"])
    iters: int = 800
    batch_size: int = 128
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup: int = 200  # inner iterations before the first hyper step
    threshold: str = "adaptive"
    fixed_tau: float = 0.95
    ema_alpha: float = 0.999
    hinge_lambda: float = 0.1
    hinge_margin: float = 4.0
    sigma_init: float = 0.1
    labels: str = "gumbel"  # label sampling of robust/bort2 (naive always uses argmax)
    temperature: float = 1.0
    student_view: str = "strong"
    hyper_every: int = 30
    hyper_lr: float = 5e-5
    hyper_clip: float = 50.0
    neumann_steps: int = 3
    neumann_alpha: float = 5e-5
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
    checkpoint_every: int = 100
    eval_every: int = 250
    progress: bool = True
    tensorboard: bool = True
    tsne: bool = True
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    step1: Step1Config = field(default_factory=Step1Config)
    step2: Step2Config = field(default_factory=Step2Config)


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
    positive = {
        "seeds": cfg.seeds,
        "jobs": cfg.jobs,
        "step1.batch_per_domain": cfg.step1.batch_per_domain,
        "step2.batch_size": cfg.step2.batch_size,
        "step2.hyper_every": cfg.step2.hyper_every,
        "checkpoint_every": cfg.checkpoint_every,
        "eval_every": cfg.eval_every,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if not 0.0 < cfg.step2.val_fraction < 1.0:
        raise ConfigError(f"step2.val_fraction must be in (0, 1), got {cfg.step2.val_fraction}")
    if not 0.0 <= cfg.step2.ema_alpha < 1.0:
        raise ConfigError(f"step2.ema_alpha must be in [0, 1), got {cfg.step2.ema_alpha}")


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
