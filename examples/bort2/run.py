"""BORT2 pipeline entry point.

Usage::

    python examples/bort2/run.py                          # MiniDigits, target uci_m
    python examples/bort2/run.py preset=smoke             # the whole pipeline in under 2 minutes
    python examples/bort2/run.py target=all seeds=3       # leave-one-domain-out table, 3 seeds
    python examples/bort2/run.py --config examples/bort2/configs/digit5.yaml data.root=DIR
    python examples/bort2/run.py output_dir=runs/x resume=true  # continue a killed run

Every ``key=value`` is a dotted config override (``python examples/bort2/run.py --help`` lists
them). Results go to ``output_dir``: ``results.md`` / ``results.json`` (the table), ``figures/``
(mechanism plots, t-SNE), and one folder per stage with checkpoints and TensorBoard logs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bort2.config import VALID_KEYS, Config, ConfigError, load_config, to_yaml  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[Path | None, list[str]]:
    parser = argparse.ArgumentParser(
        description="BORT² multi-source domain adaptation on hypergrad.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (key=value):\n  " + "\n  ".join(VALID_KEYS),
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. step2.iters=500")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def prepare_output(cfg: Config) -> Path:
    """Create the run folder; refuse to mix with a previous run unless resume/overwrite."""
    out = Path(cfg.output_dir)
    marker = out / "config.yaml"
    if marker.exists() and not cfg.resume:
        if not cfg.overwrite:
            raise ConfigError(
                f"{out} already holds a run. Pass resume=true to continue it, overwrite=true to "
                "delete it, or choose another output_dir=PATH"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if marker.exists():
        old = marker.read_text()
        new = to_yaml(cfg)
        skip = ("resume:", "progress:", "overwrite:", "jobs:")
        if [ln for ln in old.splitlines() if not ln.startswith(skip)] != [
            ln for ln in new.splitlines() if not ln.startswith(skip)
        ]:
            print(
                f"warning: resuming {out} with a configuration that differs from the saved one",
                file=sys.stderr,
            )
    (out / "config.yaml").write_text(to_yaml(cfg))
    return out


def load_data(cfg: Config):
    from bort2.data.registry import load_benchmark

    kw: dict = {}
    if cfg.data.benchmark == "minidigits":
        kw = {"seed": cfg.data.seed, "progress": cfg.progress}
    else:
        kw = {"image_size": cfg.data.image_size}
    return load_benchmark(cfg.data.benchmark, cfg.data.root, **kw)


def main(argv: list[str] | None = None) -> int:
    try:
        config_file, overrides = parse_args(argv)
        cfg = load_config(config_file, overrides)
        out = prepare_output(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch
    from bort2 import engine, report

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = engine.resolve_device(cfg.device)
    try:
        bench = load_data(cfg)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    targets = bench.domains if cfg.target == "all" else [cfg.target]
    bad = [t for t in targets if t not in bench.domains]
    if bad:
        print(
            f"error: target={cfg.target!r} is not a domain of {bench.name}; choose one of "
            f"{', '.join(bench.domains)} or all",
            file=sys.stderr,
        )
        return 2
    t_start = time.perf_counter()
    units = [(t, s) for s in range(cfg.seed, cfg.seed + cfg.seeds) for t in targets]
    results = run_units(cfg, units, out, bench, device)
    table = report.write_results(results, bench.domains, out)
    if cfg.tsne and "bort2" in cfg.step2.methods and not cfg.step1.checkpoint:
        make_tsne(cfg, bench, targets[0], cfg.seed, out, device)
    print()
    print(table)
    print(f"results: {out / 'results.md'}  ({time.perf_counter() - t_start:.0f} s)")
    return 0


def run_unit(cfg: Config, bench, target: str, seed: int, out: Path, device) -> list[dict]:
    """Every stage of one (target, seed): the step-1 methods, then each step-2 variant."""
    from bort2 import engine, report

    run_dir = out / target / f"seed{seed}"

    def ctx(name: str) -> engine.StageContext:
        return engine.StageContext(cfg, bench, target, seed, device, run_dir / name)

    results: list[dict] = []
    if cfg.step1.checkpoint:
        labeler_path = Path(cfg.step1.checkpoint)
    else:
        for method in cfg.step1.methods:
            results.append(engine.train_step1(ctx(f"step1_{method}"), method))
            if cfg.jobs == 1:
                report.write_results(results, bench.domains, out)
        labeler_path = run_dir / f"step1_{cfg.step1.labeler}" / "final.pt"
    for variant in cfg.step2.methods:
        results.append(
            engine.train_step2(ctx(f"step2_{variant}"), variant, labeler_path, cfg.step1.labeler)
        )
        if cfg.jobs == 1:
            report.write_results(results, bench.domains, out)
    stage_dirs = {v: run_dir / f"step2_{v}" for v in cfg.step2.methods if v != "naive"}
    report.plot_mechanism(
        stage_dirs,
        out / "figures" / f"mechanism_{target}_s{seed}.png",
        f"step 2 on {bench.name}, target {target}, seed {seed}",
    )
    return results


def _worker(cfg: Config, target: str, seed: int, out: Path) -> list[dict]:
    """Entry point of a ``jobs > 1`` worker process: its own threads, data and device."""
    import torch
    from bort2 import engine

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    return run_unit(cfg, load_data(cfg), target, seed, out, engine.resolve_device(cfg.device))


def run_units(cfg: Config, units: list[tuple[str, int]], out: Path, bench, device) -> list[dict]:
    """Run every (target, seed) unit, inline (``jobs=1``) or in ``jobs`` worker processes.

    Units write to separate folders and every stage is checkpointed, so a killed parallel run
    resumes like a serial one. Results are returned in unit order whatever order they finish in.
    """
    from bort2 import report

    if cfg.jobs == 1 or len(units) == 1:
        results: list[dict] = []
        for target, seed in units:
            results.extend(run_unit(cfg, bench, target, seed, out, device))
        return results
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from dataclasses import replace

    from tqdm.auto import tqdm

    # Worker bars would overwrite each other; the parent shows one bar over units instead.
    wcfg = replace(cfg, progress=False)
    by_unit: dict[tuple[str, int], list[dict]] = {}
    with ProcessPoolExecutor(
        max_workers=min(cfg.jobs, len(units)), mp_context=mp.get_context("spawn")
    ) as pool:
        futures = {pool.submit(_worker, wcfg, t, s, out): (t, s) for t, s in units}
        bar = tqdm(total=len(units), desc=f"runs ({cfg.jobs} jobs)", disable=not cfg.progress)
        for fut in as_completed(futures):
            unit = futures[fut]
            by_unit[unit] = fut.result()
            bar.update(1)
            bar.write(f"finished target {unit[0]} seed {unit[1]}")
            done = [r for u in units if u in by_unit for r in by_unit[u]]
            report.write_results(done, bench.domains, out)
        bar.close()
    return [r for u in units for r in by_unit[u]]


def make_tsne(cfg: Config, bench, target: str, seed: int, out: Path, device) -> None:
    """t-SNE of target test features: the step-1 labeler vs the BORT² target model."""
    import torch
    from bort2 import engine, report
    from bort2.step2 import build_student

    run_dir = out / target / f"seed{seed}"
    nc = bench.num_classes
    test = bench.split(target, "test")
    labeler = engine.load_labeler(
        cfg, run_dir / f"step1_{cfg.step1.labeler}" / "final.pt", nc, cfg.step1.labeler
    )
    student = build_student(labeler, "bort2", nc, cfg.step2.sigma_init)
    student.load_state_dict(engine.load_checkpoint(run_dir / "step2_bort2" / "final.pt")["model"])
    feats = {}
    for name, model in (
        (report.DISPLAY[f"step1/{cfg.step1.labeler}"], labeler),
        ("BORT²", student),
    ):
        pred = engine.predict_dataset(
            model.to(device), test, device, max_n=1500, with_features=True
        )
        feats[name] = (pred["features"].numpy(), pred["labels"].numpy())
    with torch.no_grad():
        report.plot_tsne(feats, out / "figures" / f"tsne_{target}_s{seed}.png", seed)


if __name__ == "__main__":
    raise SystemExit(main())
