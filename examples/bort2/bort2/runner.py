"""Running (target, seed) units of the pipeline, one after another or in worker processes.

The command line (:mod:`bort2.cli`) imports this module and answers ``--help`` and configuration
errors without loading torch, so the modules that import torch (:mod:`bort2.engine`,
:mod:`bort2.report`, :mod:`bort2.dist`) are imported inside the functions that train; everything
else is imported here.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

from .config import Config
from .data.registry import load_from_config
from .errors import UnitFailed
from .progress import make_bar
from .stages_index import SPECS, input_key, plan

#: where the run is (for the one line printed on Ctrl-C): set by :func:`run_unit` and
#: :func:`run_units`, read by :func:`position`
_POSITION: list[str | None] = [None]


def set_position(where: str | None) -> None:
    """Record where the run is now (``None``: nowhere in particular)."""
    _POSITION[0] = where


def position() -> str | None:
    """Where the run is now, as words: ``in stage step2/bort2 (target uci_m, seed 0)``."""
    return _POSITION[0]


#: The benchmark named by the config: :func:`bort2.data.registry.load_from_config` under the name
#: that :mod:`bort2.cli` and ``attribution.py`` import.
load_data = load_from_config


def step2_order(cfg: Config) -> list[str]:
    """The step-2 methods a unit trains, in order (see :func:`bort2.stages_index.plan`: what
    they need comes first, e.g. Stage B before Stage C, even when not asked for)."""
    return [SPECS[n].method for n in plan(cfg) if SPECS[n].step == "step2"]


def run_unit(
    cfg: Config, bench, target: str, seed: int, out: Path, device, earlier: list[dict] | None = None
) -> list[dict]:
    """Every stage of one (target, seed): the step-1 methods, then the step-2 stages.

    Returns this unit's result rows. With ``earlier`` (the rows of units already run in this
    process) the results table is rewritten after every stage, so it is current while it runs.
    """
    from . import engine, report  # torch (see the module docstring)
    from .dist import current

    run_dir = out / target / f"seed{seed}"
    env = current()  # rank and world size under torchrun; every rank runs every stage
    results: list[dict] = []

    def final(need: str) -> Path:
        """The file a stage needs of stage ``need`` (``step1.checkpoint`` for the labeler)."""
        if SPECS[need].step == "step1" and cfg.step1.checkpoint:
            return Path(cfg.step1.checkpoint)
        return run_dir / SPECS[need].dir_name / "final.pt"

    stages = plan(cfg)  # every stage of the unit, each after what it needs
    for name in stages:
        spec = SPECS[name]
        set_position(f"in stage {name} (target {target}, seed {seed})")
        inputs = {input_key(n): final(n) for n in spec.needs(cfg)}
        ctx = engine.StageContext(
            cfg, bench, target, seed, device, run_dir / spec.dir_name, inputs=inputs, dist=env
        )
        row = engine.run_stage(ctx, name)
        if spec.method in getattr(cfg, spec.step).methods:  # not a stage trained as an input only
            results.append(row)
            if earlier is not None and env.main:
                report.write_results(earlier + results, bench.domains, out)
    stage_dirs = {
        SPECS[n].method: run_dir / SPECS[n].dir_name for n in stages if SPECS[n].stochastic
    }
    set_position(f"after the stages of target {target}, seed {seed} (while plotting)")
    if not env.main:
        return results
    report.plot_mechanism(
        stage_dirs,
        out / "figures" / f"mechanism_{target}_s{seed}.png",
        f"step 2 on {bench.name}, target {target}, seed {seed}",
    )
    return results


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _worker_signals() -> None:
    """Worker processes ignore Ctrl-C (no traceback from each worker): the parent stops them
    with SIGTERM, on which they exit through ``SystemExit`` (so their locks are released)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_quietly)


def _worker(cfg: Config, target: str, seed: int, out: Path) -> list[dict]:
    """Entry point of a ``jobs > 1`` worker process: its own threads, data and device."""
    import torch  # see the module docstring

    from . import engine

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = engine.resolve_device(cfg.device)
    if cfg.reproducible:  # the pinned variables are inherited; the torch switches are not
        from . import reproducible

        reproducible.apply(str(device))
    return run_unit(cfg, load_data(cfg), target, seed, out, device)


def run_units(cfg: Config, units: list[tuple[str, int]], out: Path, bench, device) -> list[dict]:
    """Run every (target, seed) unit, inline (``jobs=1``) or in ``jobs`` worker processes.

    Units write to separate folders and every stage is checkpointed, so a killed parallel run
    resumes like a serial one. Results are returned in unit order whatever order they finish in.
    """
    from . import report  # torch (see the module docstring)

    if cfg.jobs == 1 or len(units) == 1:
        results: list[dict] = []
        for target, seed in units:
            results.extend(run_unit(cfg, bench, target, seed, out, device, earlier=results))
        return results
    # Worker bars would overwrite each other; the parent shows one bar over units instead.
    wcfg = replace(cfg, progress=False)
    by_unit: dict[tuple[str, int], list[dict]] = {}
    queued, running = list(units), {}
    failure: tuple[tuple[str, int], BaseException] | None = None
    bar = make_bar(len(units), f"runs ({cfg.jobs} jobs)", cfg.progress)
    # Units are handed to the pool only when a worker is free, so a failed unit (or Ctrl-C)
    # leaves nothing queued inside the pool: the units not yet started are simply not started.
    # On Ctrl-C the workers (which ignore SIGINT) are terminated: each unit keeps its last
    # periodic checkpoint, and resume=true continues from there.
    pool = ProcessPoolExecutor(
        max_workers=min(cfg.jobs, len(units)),
        mp_context=mp.get_context("spawn"),
        initializer=_worker_signals,
    )
    try:
        while queued or running:
            while queued and failure is None and len(running) < cfg.jobs:
                unit = queued.pop(0)
                running[pool.submit(_worker, wcfg, unit[0], unit[1], out)] = unit
            if not running:
                break
            names = ", ".join(f"target {t} seed {s}" for t, s in running.values())
            set_position(f"while training the units {names} in {cfg.jobs} worker processes")
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                unit = running.pop(fut)
                try:
                    by_unit[unit] = fut.result()
                except Exception as exc:  # the first failure stops new units from starting
                    failure = failure or (unit, exc)
                    continue
                bar.update(1)
                bar.write(f"finished target {unit[0]} seed {unit[1]}")
                done = [r for u in units if u in by_unit for r in by_unit[u]]
                report.write_results(done, bench.domains, out)
    except KeyboardInterrupt:
        for proc in mp.active_children():
            proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)  # the workers are gone: no waiting
        bar.close()
        raise
    except BaseException:
        pool.shutdown(wait=True)
        raise
    pool.shutdown(wait=True)
    bar.close()
    if failure is not None:
        (target, seed), exc = failure
        raise UnitFailed(
            f"unit target={target} seed={seed} failed: {type(exc).__name__}: {exc}. "
            f"{len(by_unit)} unit(s) finished (their rows are in {out / 'results.md'}), "
            f"{len(queued)} were not started; fix the cause and rerun with resume=true"
        )
    return [r for u in units for r in by_unit[u]]
