"""The configuration's schema version and the explicit migrations between versions.

A configuration mapping (a YAML file, a preset, the command line, a run's saved ``config.yaml``)
may say which schema version it is written in with a top-level ``schema_version: N``; without
it, it is read as version 1 (everything written before the version existed). :func:`migrate`
brings it to :data:`SCHEMA_VERSION` by applying, in order, every :class:`Migration` newer than
it: a :class:`Rename` moves a key to its new name (negating the value where the meaning flipped)
with a note; an :class:`Added` key gets the value that reproduces what the pipeline computed
before the key existed, in a saved (complete) configuration only (an overlay leaves it to the
schema's default). ``to_yaml`` writes the current version at the top of every ``config.yaml``.

The same list read backwards (:func:`spell`) gives the spelling of an earlier version:
checkpoint identity records hash the keys a stage reads as version 1 spells them
(:func:`bort2.checkpoint.config_fingerprint`), so every checkpoint written since that record
format still matches its stage, and renaming a key never re-identifies a checkpoint.

A rename is one :class:`Rename` in a new :class:`Migration` (and :data:`SCHEMA_VERSION` + 1);
a new key whose default changes nothing is one ``opt()`` line and no migration; a new key whose
default is what the code did before it existed is also one :class:`Added`, so that the
fingerprints of checkpoints written before it stay as they were.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from .schema import ConfigError, flat_keys, nest

#: the version of the configuration's layout that this code writes
SCHEMA_VERSION = 2
#: the top-level key that holds a mapping's version (absent: version 1)
VERSION_KEY = "schema_version"


class RenamedKeyWarning(FutureWarning):
    """A config key under the name an earlier schema version gave it: read under its new name."""


@dataclass(frozen=True)
class Rename:
    """``old`` is now ``new`` (``negate``: the new key says the opposite)."""

    old: str
    new: str
    negate: bool = False

    def forward(
        self, flat: dict[str, Any], origin: str, note: bool, complete: bool, v: int
    ) -> None:
        if self.old not in flat:
            return
        if self.new in flat:
            raise ConfigError(
                f"{origin} sets both {self.old} and its new name {self.new}; keep {self.new}"
            )
        value = flat.pop(self.old)
        if self.negate and isinstance(value, bool):
            value = not value
        elif self.negate and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() != "true"
        flat[self.new] = value
        if note:
            flip = " (negated: the new key says the opposite)" if self.negate else ""
            warnings.warn(
                f"config key {self.old} in {origin} is now {self.new}{flip} (renamed in config "
                f"schema version {v})",
                RenamedKeyWarning,
                stacklevel=5,
            )

    def backward(self, flat: dict[str, Any]) -> None:
        if self.new in flat:
            value = flat.pop(self.new)
            flat[self.old] = (not value) if self.negate else value


@dataclass(frozen=True)
class Added:
    """``key`` did not exist; ``default`` is what the pipeline computed before it did."""

    key: str
    default: Any

    def forward(
        self, flat: dict[str, Any], origin: str, note: bool, complete: bool, v: int
    ) -> None:
        if complete and self.key not in flat:
            flat[self.key] = self.default

    def backward(self, flat: dict[str, Any]) -> None:
        if self.key in flat and flat[self.key] == self.default:
            del flat[self.key]


@dataclass(frozen=True)
class Migration:
    """From ``version - 1`` to ``version``."""

    version: int
    what: str
    changes: tuple[Rename | Added, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        2,
        "Stage C's hyper step gets its own section, step2.hyper; preset=paper's switches and "
        "reproducible are added at the authors' code's and the plain run's behaviour",
        (
            Rename("step2.hyper_every", "step2.hyper.every"),
            Rename("step2.hyper_lr", "step2.hyper.lr"),
            Rename("step2.hyper_clip", "step2.hyper.clip"),
            Rename("step2.neumann_steps", "step2.hyper.steps"),
            Rename("step2.neumann_alpha", "step2.hyper.alpha"),
            Rename("step2.hyper_convention", "step2.hyper.convention"),
            Rename("step2.official_sign", "step2.hyper.official_sign"),
            Rename("step2.outer_relu", "step2.hyper.outer_relu"),
            Rename("step2.labeler_mode", "step2.hyper.labeler_mode"),
            Rename("step2.zero_hypergradient", "step2.hyper.apply", negate=True),
            Added("step2.hinge_reduction", "mean"),
            Added("step2.bort2_labels", None),
            Added("step2.hyper.outer_reduction", "mean"),
            Added("reproducible", False),
        ),
    ),
)


def renamed() -> dict[str, tuple[str, bool]]:
    """Every earlier name: ``old -> (current name, negated)`` (for ``--help`` and suggestions)."""
    out: dict[str, tuple[str, bool]] = {}
    for m in MIGRATIONS:
        for c in m.changes:
            if isinstance(c, Rename):
                for old, (name, negated) in list(out.items()):  # a key renamed twice
                    if name == c.old:
                        out[old] = (c.new, negated != c.negate)
                out[c.old] = (c.new, c.negate)
    return out


def version_of(tree: dict[str, Any], origin: str) -> int:
    """The schema version a mapping says it is written in (1 when it says none)."""
    version = tree.get(VERSION_KEY, 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"{origin}: {VERSION_KEY} must be a whole number >= 1, got {version!r}")
    if version > SCHEMA_VERSION:
        raise ConfigError(
            f"{origin} is written in config schema version {version}; this version of the "
            f"pipeline reads versions up to {SCHEMA_VERSION}"
        )
    return version


def migrate(
    tree: dict[str, Any], origin: str, *, complete: bool = False, note: bool = True
) -> dict[str, Any]:
    """``tree`` (nested; its ``schema_version`` removed) in the current schema version.

    ``complete``: ``tree`` is a whole saved configuration (``config.yaml``), so an added key it
    lacks takes the value that reproduces what it computed. ``note``: warn
    (:class:`RenamedKeyWarning`) for every renamed key read.
    """
    version = version_of(tree, origin)
    flat = flat_keys({k: v for k, v in tree.items() if k != VERSION_KEY})
    for m in MIGRATIONS:
        if m.version > version:
            for change in m.changes:
                change.forward(flat, origin, note, complete, m.version)
    return nest(flat)


def spell(flat: dict[str, Any], version: int) -> dict[str, Any]:
    """Flat current keys (a selection of them) as schema ``version`` spells them: every newer
    migration undone, newest first (a renamed key under its old name, an added key at its
    migration's default left out)."""
    out = dict(flat)
    for m in reversed(MIGRATIONS):
        if m.version > version:
            for change in reversed(m.changes):
                change.backward(out)
    return out
