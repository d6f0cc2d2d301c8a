"""Measured per-iteration cost and peak memory of the BORT² stages on the real benchmarks' shapes.

Runs bort2's own stage code (the default labeler's step-1 stage, FixMatch-CM; Stage B and Stage C,
:func:`stage_names`) on synthetic in-memory data of each benchmark's shapes (domains, class
count, image side, the batch sizes of ``configs/<benchmark>.yaml``), random initialisation, on
the CPU. Each (case, stage, threads) runs in a fresh subprocess, so its peak resident memory
(``ru_maxrss``) is that of one training process. Times are wall-clock medians per iteration
after warm-up iterations, with the process's CPU time (all its threads) per iteration beside
them: on a shared machine the wall time includes waiting for cores. Stage C is timed with a
hyper step every ``--measure-every`` iterations; its per-iteration cost at the config's
``step2.hyper.every`` is amortised as ``t_plain + (t_hyper_iter - t_plain) / hyper_every``.
Not included: decoding image files (the data are in memory) and evaluation passes.

Usage::

    python examples/bort2/scripts/cost.py                      # all cases, 1 and 2 threads
    python examples/bort2/scripts/cost.py --cases pacs --threads 1 --iters 3
    python examples/bort2/scripts/cost.py --cases domainnet:resnet101 --json out.json
    python examples/bort2/scripts/cost.py --flops --threads 2 --json flops.json  # FLOPs, ops
    python examples/bort2/scripts/cost.py --estimate timing.json flops.json   # full-run table

A case is ``<benchmark>`` (its config's network and image side), ``<benchmark>:<arch>`` (another
network with that benchmark's batch sizes) or ``<benchmark>:<arch>:<px>`` (another image side,
e.g. a small one to see the per-iteration overhead that does not grow with the image).
``--batch-scale`` multiplies every batch size (for slow machines); the reported times are then
divided by it (linear scaling, reported as such).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CASES = ("digit5", "pacs", "domainnet:resnet50")


def stage_names() -> dict[str, str]:
    """The stages measured, from the registry: A, the default labeler's step-1 stage
    (``step1.labeler``, FixMatch-CM); B, Stage B; C, Stage C."""
    from bort2.config import KEYS
    from bort2.stages_index import STAGE_B, STAGE_C

    return {"A": f"step1/{KEYS['step1.labeler'].default}", "B": STAGE_B, "C": STAGE_C}


def _overrides(case: str, batch_scale: float, threads: int) -> tuple[str, list[str]]:
    bench, _, rest = case.partition(":")
    arch, _, px = rest.partition(":")
    over = [
        "device=cpu",
        f"threads={threads}",
        "progress=false",
        "tensorboard=false",
        "data.num_workers=0",
    ]
    if arch:
        over.append(f"model.arch={arch}")
    if px:
        over.append(f"data.image_size={px}")
    if batch_scale != 1.0:
        from bort2.config import CONFIG_DIR, load_config

        cfg = load_config(CONFIG_DIR / f"{bench}.yaml")
        for key, value in (
            ("step1.batch_per_domain", cfg.step1.batch_per_domain),
            ("step1.target_batch", cfg.step1.target_batch),
            ("step2.batch_size", cfg.step2.batch_size),
        ):
            over.append(f"{key}={max(1, round(value * batch_scale))}")
    return bench, over


def _synthetic_bench(cfg, seed: int = 0):
    """In-memory uint8 images of the benchmark's domains, classes and side; enough rows for two
    batches of every domain."""
    import torch
    from bort2.data.base import ArrayDomain, Benchmark
    from bort2.data.registry import benchmark_domains

    num_classes = {"digit5": 10, "pacs": 7, "domainnet": 345, "minidigits": 10}
    nc = num_classes[cfg.data.benchmark]
    s = cfg.data.image_size
    rows = 2 * max(cfg.step1.batch_per_domain, cfg.step1.target_batch, cfg.step2.batch_size)
    g = torch.Generator().manual_seed(seed)
    splits = {}
    for d in benchmark_domains(cfg.data.benchmark):
        images = torch.randint(0, 256, (rows, 3, s, s), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, nc, (rows,), generator=g)
        splits[d] = {"train": ArrayDomain(images, labels), "test": ArrayDomain(images, labels)}
    return Benchmark(cfg.data.benchmark, nc, s, splits)


def _op_counter_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        """Counts the ATen operator calls (each one is at least one kernel launch on a GPU)."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    return OpCounter


def _OpCounter():  # noqa: N802  (a class built lazily, after torch is imported)
    return _op_counter_class()()


def _rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def run_one(
    case: str,
    stage: str,
    threads: int,
    warmup: int,
    iters: int,
    every: int,
    scale: float,
    flops: bool = False,
):
    """One measurement in this process; returns a dict (printed as JSON by the child).

    With ``flops`` it counts instead of timing: the floating-point operations of one iteration
    (``torch.utils.flop_counter``: matrix products and convolutions, forward and backward) and
    the ATen operator calls, and for Stage C the extra of one iteration with a hyper step.
    """
    import torch
    from bort2 import engine
    from bort2.checkpoint import atomic_save
    from bort2.config import CONFIG_DIR, load_config
    from bort2.stages_index import LABELER, SPECS, STAGE_B, input_key
    from bort2.step2 import build_student

    torch.set_num_threads(threads)
    rss_start = _rss_mib()
    bench_name, over = _overrides(case, scale, threads)
    hyper_every_cfg = load_config(CONFIG_DIR / f"{bench_name}.yaml", over).step2.hyper.every
    if stage == "C":
        over += [f"step2.hyper.every={every}", "step2.warmup=0"]
    cfg = load_config(CONFIG_DIR / f"{bench_name}.yaml", over)
    torch.manual_seed(0)
    bench = _synthetic_bench(cfg)
    target = cfg.target
    dev = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = {}
        if stage in ("B", "C"):
            labeler = engine.build_model(cfg, bench.num_classes, mixstyle=False)
            atomic_save({"model": labeler.state_dict()}, tmp / "step1.pt")
            student = build_student(
                labeler,
                SPECS[STAGE_B].plain_student,
                bench.num_classes,
                cfg.step2.sigma_init,
                cfg.model.sigma_head,
            )
            atomic_save(
                {"model": student.state_dict(), "classifier": student.classifier_state()},
                tmp / "stage_b.pt",
            )
            inputs = {LABELER: tmp / "step1.pt", input_key(STAGE_B): tmp / "stage_b.pt"}
            del labeler, student
        ctx = engine.StageContext(cfg, bench, target, 0, dev, tmp / "stage", inputs=inputs)
        st = engine.STAGES[stage_names()[stage]](ctx)
        st.setup()
        rss_setup = _rss_mib()
        if flops:
            from torch.utils.flop_counter import FlopCounterMode

            counted, ops = {}, {}
            for it in range(every if stage == "C" else 1):
                with FlopCounterMode(display=False) as fc, _OpCounter() as oc:
                    st.step(it, log=False)
                counted[it], ops[it] = fc.get_total_flops(), oc.count
            res = {
                "case": case,
                "stage": stage,
                "arch": cfg.model.arch,
                "gflop_per_iter": counted[0] / 1e9,
                "ops_per_iter": ops[0],
                "trained_params": sum(p.numel() for g in st.opt.param_groups for p in g["params"]),
            }
            if stage == "C":
                res["gflop_hyper_extra"] = (counted[every - 1] - counted[0]) / 1e9
                res["ops_hyper_extra"] = ops[every - 1] - ops[0]
            return res
        times, cpu, hyper = [], [], []
        for it in range(warmup + iters):
            t0, c0 = time.perf_counter(), time.process_time()
            st.step(it, log=False)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if it >= warmup:
                times.append(dt)
                cpu.append(dc)
                hyper.append(stage == "C" and (it + 1) % every == 0)
    s1, s2 = cfg.step1, cfg.step2
    n_src = len(bench.domains) - 1
    if stage == "A":
        batch = f"{n_src} x {s1.batch_per_domain} + {s1.target_batch}"
    else:
        batch = f"{s2.batch_size}"
    out = {
        "case": case,
        "benchmark": bench_name,
        "arch": cfg.model.arch,
        "image_size": cfg.data.image_size,
        "stage": stage,
        "threads": threads,
        "batch": batch,
        "batch_scale": scale,
        "iters_measured": iters,
        "warmup": warmup,
        "times_s": times,
        "cpu_s": cpu,
        "rss_start_mib": rss_start,
        "rss_after_setup_mib": rss_setup,
        "peak_rss_mib": _rss_mib(),
        "torch": torch.__version__,
    }
    for key, series in (("", times), ("cpu_", cpu)):
        if stage == "C":
            plain = statistics.median([t for t, h in zip(series, hyper) if not h])
            with_hyper = [t for t, h in zip(series, hyper) if h]
            t_hyper = statistics.median(with_hyper) if with_hyper else float("nan")
            out[f"{key}plain_s"] = plain / scale
            out[f"{key}hyper_step_s"] = (t_hyper - plain) / scale
            out[f"{key}per_iter_s"] = (plain + (t_hyper - plain) / hyper_every_cfg) / scale
        else:
            out[f"{key}per_iter_s"] = statistics.median(series) / scale
    out["hyper_every"] = hyper_every_cfg
    return out


# ----------------------------------------------------------------------------- estimates
#: ASSUMPTIONS of the GPU estimates (none of them is measured here; no GPU was available):
#: sustained throughput of one NVIDIA A100 80GB, from NVIDIA DeepLearningExamples'
#: PyTorch/Classification/ConvNets/resnet50v1.5/README.md (DGX A100, 1 GPU: 938 img/s TF32,
#: 2470 img/s mixed precision) x 24.3 GFLOP per trained ResNet-50 image (forward + backward at
#: 224 px, counted with torch.utils.flop_counter): amp=off (TF32 convolutions) and amp=bf16
GPU_FLOPS = {"off": 938 * 24.3e9, "bf16": 2470 * 24.3e9}
#: host-side cost of one eager ATen operator on a GPU (dispatch + kernel launch), per call
OP_OVERHEAD_S = 10e-6
#: NCCL all-reduce bus bandwidth between 8 GPUs of one NVLink node (bytes/s)
ALLREDUCE_BPS = 200e9


def _stage_iters(bench: str) -> dict[str, int]:
    from bort2.config import CONFIG_DIR, load_config

    cfg = load_config(CONFIG_DIR / f"{bench}.yaml")
    return {"A": cfg.step1.iters, "B": cfg.step2.iters, "C": cfg.step2.iters}


def _world(bench: str, gpus: int) -> int:
    """The most processes <= ``gpus`` that split every per-domain batch of the config evenly."""
    from bort2.config import CONFIG_DIR, load_config

    cfg = load_config(CONFIG_DIR / f"{bench}.yaml")
    sizes = (cfg.step1.batch_per_domain, cfg.step1.target_batch, cfg.step2.batch_size)
    return max(w for w in range(1, gpus + 1) if all(k % w == 0 for k in sizes))


def gpu_iter_s(f: dict, world: int, amp: str = "off", hyper_every: int = 30) -> float:
    """Estimated seconds per iteration on ``world`` GPUs (one stage; ``f``: a --flops row).

    compute (FLOPs / world / GPU_FLOPS) + every rank's operator overhead (ops x OP_OVERHEAD_S;
    a rank runs all operators of the iteration, whatever its share of the rows) + the gradient
    all-reduce (ring: 2 (w-1)/w x 4 bytes x trained parameters / ALLREDUCE_BPS); for Stage C the
    hyper step's extra FLOPs, operators and (with ``distributed="exact"``) about five all-reduces
    of M_psi-sized vectors, amortised over ``hyper_every`` iterations.
    """
    ring = 2 * (world - 1) / world * 4 * f["trained_params"] / ALLREDUCE_BPS
    t = f["gflop_per_iter"] * 1e9 / world / GPU_FLOPS[amp] + f["ops_per_iter"] * OP_OVERHEAD_S
    t += ring
    if "gflop_hyper_extra" in f:
        hyper = f["gflop_hyper_extra"] * 1e9 / world / GPU_FLOPS[amp]
        hyper += f["ops_hyper_extra"] * OP_OVERHEAD_S + 5 * ring
        t += hyper / hyper_every
    return t


def estimate(timing: list[dict], flops: list[dict]) -> str:
    """A markdown table: full-run time (Stages A + B + C of configs/<benchmark>.yaml) from the
    measured CPU seconds per iteration, and estimated on 1 and 8 GPUs from the counted FLOPs and
    operators (see the ASSUMPTIONS above)."""
    fl = {(r["case"], r["stage"]): r for r in flops}
    cases = list(dict.fromkeys(r["case"] for r in flops))
    lines = [
        "| benchmark (network) | iterations A / B / C | this CPU, 1 thread | this CPU, 2 threads"
        " | 1 GPU, amp=off | 1 GPU, amp=bf16 | 8 GPUs, amp=off |",
        "|" + "---|" * 7,
    ]

    def fmt(sec: float | None) -> str:
        if sec is None:
            return "not measured"
        if sec < 3600:
            return f"{sec / 60:.0f} min"
        if sec < 86400 * 2:
            return f"{sec / 3600:.1f} h"
        return f"{sec / 86400:.0f} days"

    for case in cases:
        bench = case.split(":")[0]
        iters = _stage_iters(bench)
        cpu = {}
        for threads in (1, 2):
            rows = {r["stage"]: r for r in timing if r["case"] == case and r["threads"] == threads}
            ok = all(s in rows for s in iters)
            cpu[threads] = sum(iters[s] * rows[s]["per_iter_s"] for s in iters) if ok else None
        w8 = _world(bench, 8)
        gpu = {
            (w, amp): sum(iters[s] * gpu_iter_s(fl[(case, s)], w, amp) for s in iters)
            for w, amp in ((1, "off"), (1, "bf16"), (w8, "off"))
        }
        eight = fmt(gpu[(w8, "off")])
        if w8 != 8:
            eight += f" (on {w8} GPUs: the batches do not split 8 ways)"
        name = f"{bench} ({fl[(case, 'A')]['arch']})"
        lines.append(
            f"| {name} | {iters['A']:,} / {iters['B']:,} / {iters['C']:,} | {fmt(cpu[1])} | "
            f"{fmt(cpu[2])} | {fmt(gpu[(1, 'off')])} | {fmt(gpu[(1, 'bf16')])} | {eight} |"
        )
    return "\n".join(lines)


def _machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def _table(rows: list[dict]) -> str:
    head = (
        "| benchmark | network | px | stage | batch | threads | wall s / it | CPU s / it | "
        "hyper step wall (CPU) s | peak RSS (MiB) |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        hyper = ""
        if r["stage"] == "C":
            hyper = f"{r['hyper_step_s']:.2f} ({r['cpu_hyper_step_s']:.2f})"
        lines.append(
            f"| {r['benchmark']} | {r['arch']} | {r['image_size']} | {r['stage']} | {r['batch']} | "
            f"{r['threads']} | {r['per_iter_s']:.3f} | {r['cpu_per_iter_s']:.3f} | {hyper} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default=",".join(DEFAULT_CASES))
    p.add_argument("--stages", default="A,B,C", help="A = step 1, B = Stage B, C = Stage C")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="measured iterations (Stage C: x2)")
    p.add_argument("--measure-every", type=int, default=3, help="Stage C: hyper step period")
    p.add_argument("--batch-scale", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    p.add_argument("--flops", action="store_true", help="count FLOPs per iteration instead")
    p.add_argument(
        "--estimate",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print full-run estimates from --json files of a timing and a --flops run",
    )
    p.add_argument("--one", nargs=3, metavar=("CASE", "STAGE", "THREADS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.estimate:
        timing, flops = [], []
        for path in a.estimate:
            for r in json.loads(path.read_text())["rows"]:
                (flops if "gflop_per_iter" in r else timing).append(r)
        print(estimate(timing, flops))
        return 0
    if a.one:
        case, stage, threads = a.one
        iters = a.iters * 2 if stage == "C" else a.iters
        warmup = max(a.warmup, a.measure_every) if stage == "C" else a.warmup
        res = run_one(
            case, stage, int(threads), warmup, iters, a.measure_every, a.batch_scale, a.flops
        )
        print("RESULT " + json.dumps(res))
        return 0
    rows = []
    for case in a.cases.split(","):
        for stage in a.stages.split(","):
            for threads in a.threads.split(","):
                env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
                cmd = [sys.executable, __file__, "--one", case, stage, threads]
                cmd += ["--warmup", str(a.warmup), "--iters", str(a.iters)]
                cmd += ["--measure-every", str(a.measure_every)]
                cmd += ["--batch-scale", str(a.batch_scale)] + (["--flops"] if a.flops else [])
                t0 = time.perf_counter()
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=a.timeout
                )
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode != 0 or not line:
                    print(f"{case} {stage} threads={threads} failed:\n{proc.stderr[-3000:]}")
                    return 1
                res = json.loads(line[-1][len("RESULT ") :])
                if a.flops:
                    rows.append(res)
                    extra = res.get("gflop_hyper_extra")
                    print(
                        f"{case:22s} {stage}: {res['gflop_per_iter']:.1f} GFLOP and "
                        f"{res['ops_per_iter']} ATen ops per iteration"
                        + (
                            f", hyper step +{extra:.1f} GFLOP, +{res['ops_hyper_extra']} ops"
                            if extra is not None
                            else ""
                        ),
                        flush=True,
                    )
                    continue
                res["wall_s"] = time.perf_counter() - t0
                res["loadavg"] = os.getloadavg()
                rows.append(res)
                print(
                    f"{case:22s} {stage} threads={threads}: {res['per_iter_s']:.3f} s/it "
                    f"(CPU {res['cpu_per_iter_s']:.3f} s), "
                    f"peak RSS {res['peak_rss_mib']:.0f} MiB ({res['wall_s']:.0f} s, "
                    f"load {res['loadavg'][0]:.1f})",
                    flush=True,
                )
                if a.json:
                    a.json.write_text(json.dumps({"machine": _machine(), "rows": rows}, indent=1))
    if a.flops:
        if a.json:
            a.json.write_text(json.dumps({"rows": rows}, indent=1))
        return 0
    print()
    print(f"machine: {_machine()}")
    print(_table(rows))
    return 0


if __name__ == "__main__":  # bort2 is installed: pip install -e examples/bort2
    raise SystemExit(main())
