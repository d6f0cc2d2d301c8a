"""Time-to-suboptimality tables from benchopt's result rows (numpy only: no benchopt, no pandas;
``race.py`` passes ``DataFrame.to_dict("records")``).

A solver's *family* is its benchopt name without ``random_state`` (one row per family); its
seeds are the ``random_state`` values (a solver without one is one seed). For a metric to
minimise, ``best`` is the smallest value any row reached, and a run reaches level ``δ`` at the
first recorded time where ``metric - best <= δ``. A family's entry is the median over its seeds
of that time, a seed that never reaches the level counting as infinitely slow (so the median
is "never" when half or more never reach it).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

LEVELS = (1e-2, 1e-3, 1e-4)
_SEED = re.compile(r",?random_state=([^,\]]+)")


def family(solver_name: str) -> str:
    """``SABA[batch_size=64,random_state=3]`` -> ``SABA[batch_size=64]``."""
    name = _SEED.sub("", solver_name).replace("[,", "[")
    return name[:-2] if name.endswith("[]") else name


def seed(solver_name: str) -> str:
    m = _SEED.search(solver_name)
    return m.group(1) if m else "0"


def first_time(times: np.ndarray, values: np.ndarray, target: float) -> float:
    """First time at which ``values <= target`` (inf if never; NaN values never count)."""
    order = np.argsort(times, kind="stable")
    t, v = np.asarray(times, float)[order], np.asarray(values, float)[order]
    hit = np.flatnonzero(v <= target)
    return float(t[hit[0]]) if hit.size else math.inf


def median_time(times: list[float]) -> float:
    """The median of per-seed times, ``inf`` counting as slowest (inf if half or more are)."""
    if not times:
        return math.inf
    s = sorted(times)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


Runs = dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]


def _runs(records: list[dict[str, Any]], metric: str) -> Runs:
    """``{family: {seed: (times, values)}}`` sorted by time, non-finite values dropped."""
    acc: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in records:
        v = float(r[metric])
        if not math.isfinite(v):
            continue
        name = str(r["solver_name"])
        acc.setdefault(family(name), {}).setdefault(seed(name), []).append((float(r["time"]), v))
    out = {}
    for fam, seeds in acc.items():
        out[fam] = {}
        for s, pts in seeds.items():
            pts.sort(key=lambda p: p[0])
            out[fam][s] = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    return out


def time_to_levels(records: list[dict[str, Any]], metric: str,
                   levels: tuple[float, ...] = LEVELS, best: float | None = None) -> dict[str, Any]:
    """``{"best": b, "metric": m, "rows": [{"solver", "seeds", "times": {δ: median},
    "reached": {δ: k}, "final_gap"}]}`` from rows with ``solver_name``, ``time`` and ``metric``."""
    runs = _runs(records, metric)
    b = min((float(v.min()) for seeds in runs.values() for _, v in seeds.values()),
            default=math.nan) if best is None else best
    rows = []
    for fam in sorted(runs):
        per_seed = runs[fam]
        times, reached = {}, {}
        for lvl in levels:
            ts = [first_time(t, v, b + lvl) for t, v in per_seed.values()]
            times[lvl] = median_time(ts)
            reached[lvl] = sum(math.isfinite(t) for t in ts)
        final = [float(v[-1]) - b for _, v in per_seed.values()]
        rows.append({"solver": fam, "seeds": len(per_seed), "times": times, "reached": reached,
                     "final_gap": float(np.median(final))})
    return {"best": b, "metric": metric, "rows": rows}


def winners(table: dict[str, Any], ours: str = "hg_") -> dict[float, dict[str, Any]]:
    """Per level: the fastest of ours and of the benchmark's (name, median time) and whether
    ours is no later (the issue's target)."""
    out = {}
    for lvl in table["rows"][0]["times"] if table["rows"] else []:
        mine = [(r["times"][lvl], r["solver"]) for r in table["rows"]
                if r["solver"].startswith(ours)]
        peer = [(r["times"][lvl], r["solver"]) for r in table["rows"]
                if not r["solver"].startswith(ours)]
        m, p = min(mine, default=(math.inf, "-")), min(peer, default=(math.inf, "-"))
        out[lvl] = {"ours": m[1], "ours_time": m[0], "peer": p[1], "peer_time": p[0],
                    "target_met": m[0] <= p[0]}
    return out


def fmt_time(t: float) -> str:
    if not math.isfinite(t):
        return "never"
    return f"{t:.3g} s" if t < 100 else f"{t:.0f} s"


def markdown(table: dict[str, Any], title: str) -> str:
    levels = list(table["rows"][0]["times"]) if table["rows"] else list(LEVELS)
    head = "| solver | seeds | " + " | ".join(f"within {lvl:g}" for lvl in levels)
    lines = [f"**{title}** (metric `{table['metric']}`, best value reached "
             f"{table['best']:.6g}; median time over seeds, reached/seeds in brackets)", "",
             head + " | median gap at the end |",
             "|---|---:|" + "---:|" * len(levels) + "---:|"]
    for r in sorted(table["rows"], key=lambda r: [r["times"][lvl] for lvl in reversed(levels)]):
        cells = [f"{fmt_time(r['times'][lvl])} ({r['reached'][lvl]}/{r['seeds']})"
                 for lvl in levels]
        name = f"**{r['solver']}**" if r["solver"].startswith("hg_") else r["solver"]
        lines.append(f"| {name} | {r['seeds']} | " + " | ".join(cells)
                     + f" | {r['final_gap']:.2e} |")
    return "\n".join(lines)


def median_curve(records: list[dict[str, Any]], metric: str, best: float, grid: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """Per family, the median over seeds of the running best gap ``min_{t' <= t} metric - best``
    on ``grid`` (NaN before a seed's first point)."""
    out = {}
    for fam, seeds in _runs(records, metric).items():
        curves = []
        for t, v in seeds.values():
            gap = np.minimum.accumulate(v - best)
            idx = np.searchsorted(t, grid, side="right") - 1
            curves.append(np.where(idx >= 0, gap[np.clip(idx, 0, None)], np.nan))
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: before start
                out[fam] = np.nanmedian(np.vstack(curves), axis=0)
    return out
