"""Loading the BORT² configuration: YAML files and dotted CLI overrides, validation, ``--help``.

Precedence (later wins): the schema defaults (:mod:`bort2.config.schema`), the YAML file given
with ``--config`` (default ``configs/minidigits.yaml``), the preset named by ``preset=...``
(``configs/presets/<name>.yaml``), then ``key=value`` overrides from the command line
(``step2.iters=500``). Each mapping is first brought to the current schema version
(:func:`bort2.config.migrate.migrate`: renamed keys are read under their new names, with a
note).

:func:`validate` walks the fields' declared constraints, so a new field is checked by declaring
it; a test fails when a field lacks a help line or a constraint. Unknown keys are errors that
suggest the closest valid key.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from .migrate import SCHEMA_VERSION, VERSION_KEY, migrate, renamed
from .schema import CONFIG_DIR, KEYS, SECTIONS, Config, ConfigError, flat_keys, nest


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
    lines.append("renamed keys (read under their new names, with a note):")
    lines += [
        f"  {old} -> {new}{' (negated)' if neg else ''}" for old, (new, neg) in renamed().items()
    ]
    return "\n".join(lines)


def suggest(key: str) -> str:
    """``"; did you mean step1.iters?"`` for the closest valid key, else the keys of its
    section (``model.depth``: every ``model.*`` key)."""
    old_names = renamed()
    names = list(KEYS) + list(old_names)
    sec, _, last = key.rpartition(".")
    close: list[str] = []
    if sec in SECTIONS or sec == "":  # a misspelled name in a known section
        inside = [k.rpartition(".")[2] for k in names if k.rpartition(".")[0] == sec]
        hit = difflib.get_close_matches(last, inside, n=1, cutoff=0.7)
        close = [f"{sec}.{hit[0]}" if sec else hit[0]] if hit else []
    else:  # a misspelled section
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.85)
    if close:
        return f"; did you mean {old_names.get(close[0], (close[0], False))[0]}?"
    while sec and sec not in SECTIONS:
        sec = sec.rpartition(".")[0]
    inside = [k for k in KEYS if k.rpartition(".")[0] == sec]
    if not sec:
        inside += [f"{s}.*" for s in SECTIONS]
    return f"; valid keys{' of ' + sec if sec else ''}: {', '.join(inside)}"


# ----------------------------------------------------------------------------- validation
def check_fields(obj: Any, section: str = "") -> None:
    """Check every field of ``obj`` against the constraint declared next to it; ``obj`` is the
    whole configuration, or its section ``section`` (``"step2.hyper"``: a
    :class:`~bort2.config.schema.HyperConfig` built in code)."""
    prefix = f"{section}." if section else ""
    for k in KEYS.values():
        if not k.name.startswith(prefix):
            continue
        value = obj
        for part in k.name[len(prefix) :].split("."):
            value = getattr(value, part)
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


def validate(cfg: Config) -> None:
    """Check every field against the constraint declared next to it, then the cross-key rules."""
    check_fields(cfg)
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
    from ..data.registry import benchmark_domains

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
def normalize(tree: dict[str, Any], origin: str, **kw: Any) -> dict[str, Any]:
    """A config mapping in the current schema version (:func:`bort2.config.migrate.migrate`,
    ``kw`` passed on), with a list key given as one name (``step2.methods=bort2``) or a
    comma-separated string made a list."""
    tree = migrate(tree, origin, **kw)
    flat = flat_keys(tree)
    for key, value in flat.items():
        k = KEYS.get(key)
        if k is not None and k.base is list and isinstance(value, str):
            flat[key] = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
    return nest(flat)


def _merge(base: Any, other: Any, origin: str) -> Any:
    try:
        if not isinstance(other, dict):
            other = OmegaConf.to_container(other) if other is not None else {}
        if not isinstance(other, dict):
            raise ConfigError(f"{origin} is not a mapping of config keys")
        tree = normalize(other, origin)
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
    """The resolved configuration as YAML (saved next to every run), every key, under the
    current schema version (``schema_version``, first)."""
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    return OmegaConf.to_yaml({VERSION_KEY: SCHEMA_VERSION, **tree})
