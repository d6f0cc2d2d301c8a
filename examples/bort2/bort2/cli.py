"""The ``bort2`` command line: ``python examples/bort2/run.py ...`` and the ``bort2`` console
script (``pip install -e examples/bort2``) both call :func:`main`.

Usage::

    bort2                                   # MiniDigits, target uci_m (5.5 min on 2 CPU cores)
    bort2 preset=smoke                      # the whole pipeline in under 2 minutes
    bort2 reproducible=true                 # the same five numbers on every x86-64 CPU
    bort2 target=all seeds=3 jobs=2         # leave-one-domain-out, 3 seeds, 2 processes
    bort2 --config examples/bort2/configs/digit5.yaml data.root=DIR
    bort2 output_dir=runs/x resume=true     # continue a killed run (Ctrl-C prints this command)
    bort2 --config examples/bort2/configs/pacs.yaml data.root=DIR data.check=true  # check DIR
    torchrun --nproc_per_node=2 examples/bort2/run.py model.sync_bn=true  # DDP, 2 processes
    bort2 --help                            # every key: default, valid values, one line each

Every ``key=value`` is a dotted config override (:mod:`bort2.config`). What can be checked before
anything is written (keys, values, target, paths, device, data root) is checked first, so a
corrected command is never refused as an existing run; :mod:`bort2.rundir` owns the run folder.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings
from pathlib import Path

from . import runner
from .config import Config, ConfigError, help_text, load_config
from .rundir import RESUMABLE_KEYS, config_differences, prepare_output  # noqa: F401
from .runner import load_data, run_units

#: ``python examples/bort2/run.py``: the script a printed command names when not the console one
RUN_PY = Path(__file__).resolve().parent.parent / "run.py"

DESCRIPTION = """\
BORT² multi-source domain adaptation on hypergrad.

Arguments are dotted key=value overrides (listed below with their defaults), applied after the
YAML file of --config (default configs/minidigits.yaml) and the preset named by preset=.
Often used: preset=smoke|full|legacy, target=all, seeds=N, jobs=N (parallel processes),
threads=N (torch threads per process; default 1, which the published timings use; 0 = torch's
default), reproducible=true (the same numbers on every x86-64 CPU, slower), device=cpu|cuda,
output_dir=DIR, resume=true, progress=false.
A list key takes one name or a list: step2.methods=bort2, step2.methods=[robust,bort2].
"""


def parse_args(argv: list[str] | None = None) -> tuple[Path | None, list[str]]:
    """``(--config file, key=value overrides)``; ``--help`` prints every key and exits."""
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (key=default  type valid  what it does):\n" + help_text(),
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. step2.iters=500")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "bort2" if name == "bort2" else "run.py"


def load_with_notes(config_file: Path | None, overrides: list[str]) -> Config:
    """:func:`~bort2.config.load_config`, printing each renamed-key note as one ``note:`` line."""
    from .config import RenamedKeyWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RenamedKeyWarning)
        cfg = load_config(config_file, overrides)
    for w in caught:
        if issubclass(w.category, RenamedKeyWarning):
            if os.environ.get("RANK", "0") == "0":
                print(f"note: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return cfg


def check_inputs(cfg: Config) -> list[str]:
    """Validate what can be checked before any output is written: target, checkpoint, ResNet
    weights, device and data root (so that a corrected command is not refused as a run)."""
    from .config import validate_target

    targets = validate_target(cfg)
    if cfg.step1.checkpoint and not Path(cfg.step1.checkpoint).is_file():
        raise ConfigError(f"step1.checkpoint={cfg.step1.checkpoint} does not exist")
    weights = cfg.model.weights_path
    if weights and cfg.model.arch != "digit_cnn":
        if not Path(weights).is_file():
            raise ConfigError(f"model.weights_path={weights} does not exist")
        check_weights(weights, cfg.model.arch)
    check_device(cfg)
    check_data_root(cfg)
    return targets


def check_weights(path: str, arch: str) -> None:
    """``model.weights_path`` must load into ``model.arch`` (a text file, random bytes or
    another network's weights are refused here, in one line, before anything is written)."""
    from .models.resnet import check_weights_file

    try:
        check_weights_file(path, arch)
    except (ValueError, OSError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.weights_path={path}: {text}") from None


def check_device(cfg: Config) -> None:
    """``device=cuda`` needs a CUDA device that torch can use."""
    if cfg.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda is not None
        why = "torch finds no CUDA device" if built else "this torch is built without CUDA"
        raise ConfigError(
            f"device=cuda, but CUDA is not available here ({why}; torch {torch.__version__}); "
            "use device=cpu, or device=auto to take CUDA when there is one"
        )


def check_data_root(cfg: Config) -> None:
    """The real benchmarks need ``data.root``; it must exist (its layout is checked when the
    data are loaded, still before the run folder is written)."""
    if cfg.data.benchmark == "minidigits" or cfg.data.check:
        return  # MiniDigits builds its cache; data.check reports its own findings
    if cfg.data.root is None:
        raise ConfigError(
            f"data.benchmark={cfg.data.benchmark} needs data.root=DIR, the folder of its public "
            "release (expected layouts: docs/datasets.md)"
        )
    if not Path(cfg.data.root).expanduser().is_dir():
        raise ConfigError(
            f"data.root={cfg.data.root} does not exist or is not a folder "
            f"(data.benchmark={cfg.data.benchmark}; expected layouts: docs/datasets.md)"
        )


def data_error(cfg: Config, exc: BaseException) -> str:
    """A loader's error as one line (its first line: the expected tree follows it)."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, KeyError) and text[:1] in "'\"":
        text = text[1:-1]
    line = text.splitlines()[0].strip()
    if cfg.data.benchmark != "minidigits" and "docs/datasets.md" not in line:
        line += f" (data.root={cfg.data.root}; expected layouts: docs/datasets.md)"
    return line


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
    from .dist import launched_by_torchrun

    if launched_by_torchrun() and cfg.jobs > 1:
        raise ConfigError(
            f"jobs={cfg.jobs} cannot be combined with torchrun: torchrun already runs one "
            "process per device and every process trains every (target, seed) unit; use jobs=1 "
            "under torchrun, or jobs>1 without it"
        )


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same arguments with ``resume=true``."""
    from .dist import launched_by_torchrun

    argv0 = sys.argv[0] if sys.argv else ""
    torchrun = launched_by_torchrun()
    if os.path.basename(argv0) == "bort2" and not torchrun:  # the console script
        return shlex.join(["bort2", *_resumed(argv)])
    script = argv0 if argv0.endswith("run.py") else str(RUN_PY)
    try:
        rel = os.path.relpath(script)
        script = rel if not rel.startswith("..") else os.path.abspath(script)
    except ValueError:  # another drive (Windows)
        script = os.path.abspath(script)
    if not script.startswith(("/", ".")) and os.sep not in script:
        script = os.path.join(".", script)
    args = _resumed(argv)
    launcher = ["python"]
    if torchrun:
        launcher = ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '1')}"]
    return shlex.join([*launcher, script, *args])


def _resumed(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith(("resume=", "overwrite="))] + ["resume=true"]


def interrupted(argv: list[str], written: bool) -> str:
    """The one line printed on Ctrl-C: where the run stopped and how to continue it."""
    if not written:
        return (
            "interrupted before anything was written to output_dir; rerun the same command "
            "to start the run"
        )
    where = runner.position() or "before training started"
    return (
        f"interrupted {where}; the last checkpoint of every stage is kept. Continue with: "
        f"{resume_command(argv)}"
    )


def main(argv: list[str] | None = None) -> int:
    entry = argv is None  # the process's own command line: reproducible=true may restart it
    argv = list(sys.argv[1:] if argv is None else argv)
    progress = {"written": False}
    try:
        return _main(argv, progress, entry=entry)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print(f"\n{interrupted(argv, progress['written'])}", file=sys.stderr)
        return 130


def _main(argv: list[str], progress: dict, entry: bool = False) -> int:
    runner.set_position(None)
    try:
        config_file, overrides = parse_args(argv)
        cfg = load_with_notes(config_file, overrides)
        if cfg.reproducible:  # before anything imports torch: it reads these variables once
            from . import reproducible

            reproducible.pin(cfg.threads, entry=entry)
        targets = check_inputs(cfg)
        if cfg.data.check:  # validate data.root, print images per domain and split, train nothing
            from .data.check import run_check

            return run_check(cfg, targets)
        check_distributed(cfg)
        check_precision(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    from . import engine, report, reproducible
    from .dist import barrier, environment

    env = environment(cfg.device)  # initialises the process group under torchrun
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = engine.resolve_device(cfg.device)
    if env.active and device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    try:
        arithmetic = reproducible.apply(str(device)) if cfg.reproducible else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The data are loaded (and their layout checked) before the run folder is written, so a
    # wrong data.root leaves nothing behind. Rank 0 first: it may build and cache MiniDigits,
    # which the others then read.
    try:
        bench = load_data(cfg) if env.main else None
        barrier(env)
        bench = bench if env.main else load_data(cfg)
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        print(f"error: {data_error(cfg, exc)}", file=sys.stderr)
        return 2
    if env.main:
        try:
            out = prepare_output(cfg)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        out = Path(cfg.output_dir)
    progress["written"] = True
    barrier(env)
    t_start = time.perf_counter()
    units = [(t, s) for s in range(cfg.seed, cfg.seed + cfg.seeds) for t in targets]
    try:
        results = run_units(cfg, units, out, bench, device)
    except engine.PipelineError as exc:  # one line: what failed, where, and what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not env.main:  # rank 0 writes the results and prints the table
        return 0
    runner.set_position("while writing the results table and figures (every stage finished)")
    table = report.write_results(results, bench.domains, out)
    reproducible.add_to_results(out, arithmetic or reproducible.record(False, str(device)))
    report.write_mechanism(out, units, f"step1/{cfg.step1.labeler}")  # "before" needs step 1
    if cfg.tsne and "bort2" in cfg.step2.methods and not cfg.step1.checkpoint:
        make_tsne(cfg, bench, targets[0], cfg.seed, out, device)
    runner.set_position(None)
    print()
    print(table)
    print(f"results: {out / 'results.md'}  ({time.perf_counter() - t_start:.0f} s)")
    return 0


def make_tsne(cfg: Config, bench, target: str, seed: int, out: Path, device) -> None:
    """t-SNE of target test features: the step-1 labeler vs the BORT² target model."""
    import torch

    from . import engine, report
    from .step2 import build_student

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
