"""BORT2 pipeline entry point.

Usage::

    python examples/bort2/run.py                          # MiniDigits, target uci_m
    python examples/bort2/run.py preset=smoke             # the whole pipeline in under 2 minutes
    python examples/bort2/run.py target=all seeds=3 jobs=2  # leave-one-domain-out, 3 seeds
    python examples/bort2/run.py preset=full              # the same (the full MiniDigits table)
    python examples/bort2/run.py --config examples/bort2/configs/digit5.yaml data.root=DIR
    python examples/bort2/run.py --config examples/bort2/configs/pacs.yaml data.root=DIR \
        data.check=true                                   # validate DIR, count images, exit
    python examples/bort2/run.py output_dir=runs/x resume=true  # continue a killed run
    torchrun --nproc_per_node=2 examples/bort2/run.py model.sync_bn=true  # DDP on 2 processes

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

# ``python examples/bort2/run.py`` puts this folder first on sys.path, so ``bort2`` imports as is
from bort2.config import VALID_KEYS, Config, ConfigError, load_config, to_yaml
from bort2.runner import load_data, run_units


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


# keys that may change when a run is resumed: they do not change what is computed
RESUMABLE_KEYS = ("resume", "overwrite", "progress", "jobs", "tensorboard", "tsne", "data.check")


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved_yaml: str, cfg: Config) -> list[str]:
    """``key: saved -> now`` for every setting (but :data:`RESUMABLE_KEYS`) that differs."""
    import yaml

    old = _flat(yaml.safe_load(saved_yaml) or {})
    new = _flat(yaml.safe_load(to_yaml(cfg)))
    keys = sorted((set(old) | set(new)) - set(RESUMABLE_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def prepare_output(cfg: Config) -> Path:
    """Create the run folder; refuse to mix with a previous run unless resume/overwrite.

    ``resume=true`` continues a run only with the settings that produced it (the differing keys
    are listed otherwise); finished stages are never reused without ``resume=true``.
    """
    out = Path(cfg.output_dir)
    marker = out / "config.yaml"
    earlier = out.is_dir() and (marker.exists() or any(out.glob("*/seed*/step*/metrics.json")))
    if earlier and not cfg.resume:
        if not cfg.overwrite:
            what = "a run" if marker.exists() else "stages of an earlier run (no config.yaml)"
            raise ConfigError(
                f"{out} already holds {what}. Pass resume=true to continue it, overwrite=true "
                "to delete it, or choose another output_dir=PATH"
            )
        shutil.rmtree(out)
    if marker.exists():
        diff = config_differences(marker.read_text(), cfg)
        if diff:
            raise ConfigError(
                f"resume=true with settings that differ from {marker}: "
                + "; ".join(diff)
                + ". Resume with the saved settings, or pass overwrite=true (without resume) to "
                "start afresh"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(cfg))
    except OSError as exc:
        raise ConfigError(f"cannot write to output_dir={out}: {exc.strerror or exc}") from None
    return out


def check_inputs(cfg: Config) -> list[str]:
    """Validate what can be checked before any output is written: target and checkpoint."""
    from bort2.config import validate_target

    targets = validate_target(cfg)
    if cfg.step1.checkpoint and not Path(cfg.step1.checkpoint).is_file():
        raise ConfigError(f"step1.checkpoint={cfg.step1.checkpoint} does not exist")
    return targets


def check_precision(cfg: Config) -> None:
    """``amp=fp16`` needs CUDA (the GradScaler); bf16 runs anywhere."""
    if cfg.amp != "fp16":
        return
    import torch

    if cfg.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError(
            "amp=fp16 needs a CUDA device (float16 training needs a GradScaler, which this "
            "pipeline runs on CUDA only); use amp=bf16 on CPUs"
        )


def check_distributed(cfg: Config) -> None:
    """``jobs>1`` starts worker processes of its own: not under torchrun, which already did."""
    from bort2.dist import launched_by_torchrun

    if launched_by_torchrun() and cfg.jobs > 1:
        raise ConfigError(
            f"jobs={cfg.jobs} cannot be combined with torchrun: torchrun already runs one "
            "process per device and every process trains every (target, seed) unit; use jobs=1 "
            "under torchrun, or jobs>1 without it"
        )


def main(argv: list[str] | None = None) -> int:
    try:
        config_file, overrides = parse_args(argv)
        cfg = load_config(config_file, overrides)
        targets = check_inputs(cfg)
        if cfg.data.check:  # validate data.root, print images per domain and split, train nothing
            from bort2.data.check import run_check

            return run_check(cfg, targets)
        check_distributed(cfg)
        check_precision(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch
    from bort2 import engine, report
    from bort2.dist import barrier, environment

    env = environment(cfg.device)  # initialises the process group under torchrun
    if env.main:
        try:
            out = prepare_output(cfg)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        out = Path(cfg.output_dir)
    barrier(env)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = engine.resolve_device(cfg.device)
    if env.active and device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    try:  # rank 0 first: it may build and cache MiniDigits, which the others then read
        bench = load_data(cfg) if env.main else None
        barrier(env)
        bench = bench if env.main else load_data(cfg)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    units = [(t, s) for s in range(cfg.seed, cfg.seed + cfg.seeds) for t in targets]
    try:
        results = run_units(cfg, units, out, bench, device)
    except engine.PipelineError as exc:  # one line: what failed, where, and what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not env.main:  # rank 0 writes the results and prints the table
        return 0
    table = report.write_results(results, bench.domains, out)
    report.write_mechanism(out, units, f"step1/{cfg.step1.labeler}")  # "before" needs step 1
    if cfg.tsne and "bort2" in cfg.step2.methods and not cfg.step1.checkpoint:
        make_tsne(cfg, bench, targets[0], cfg.seed, out, device)
    print()
    print(table)
    print(f"results: {out / 'results.md'}  ({time.perf_counter() - t_start:.0f} s)")
    return 0


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
    student = build_student(labeler, "bort2", nc, cfg.step2.sigma_init, cfg.model.sigma_head)
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
