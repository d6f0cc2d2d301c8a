"""The shared kit: machine and versions, the one timer, the one memory probe, JSON files."""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
median = statistics.median


def set_threads(n: int) -> None:
    """``n`` threads for torch and XLA; ``n = 1`` also pins the process to one CPU (XLA in jax 0.10
    ignores its single-thread flag; docs/benchmarks.md, "Measurements")."""
    if n == 1:
        os.environ.setdefault(
            "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(n)


def machine() -> dict[str, Any]:
    cpu, mem = platform.processor() or "unknown", None
    try:
        cpu = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
        cpu = cpu.split(":", 1)[1].strip()
        mem = round(int(open("/proc/meminfo").readline().split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    out = dict(cpu=cpu, cores=os.cpu_count(), mem_gib=mem, gpu=gpu)
    out.update(python=platform.python_version(), platform=platform.platform())
    out.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {**out, "cpus_allowed": allowed, "loadavg": os.getloadavg()}


def err_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}"


def save(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (with the machine and the time) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "created": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    jsonable = lambda o: o.tolist() if isinstance(o, torch.Tensor) else str(o)
    path.write_text(json.dumps(payload, indent=1, default=jsonable))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timeit(fns: dict, reps: int, warmup: int = 1, min_time: float = 0.0, max_reps: int = 0) -> dict:
    """Wall (``times_s``) and CPU (``cpu_s``) times of the callables, ``warmup`` untimed rounds then
    ``reps`` rounds in alternating order (one faster than ``min_time`` gets up to ``max_reps``),
    seed 0 before each call; a callable that raises gets ``errors`` and is not called again."""
    out: dict[Any, dict[str, list]] = {k: {"times_s": [], "cpu_s": [], "errors": []} for k in fns}
    want = dict.fromkeys(fns, reps)
    for r in range(-warmup, max(reps, max_reps or reps)):
        if r == 1:  # the first timed repetition decides how many each callable gets
            for k, rec in out.items():
                t1 = max(min(rec["times_s"] or [1.0]), 1e-6)
                want[k] = int(min(max(reps, math.ceil(min_time / t1)), max_reps or reps))
        keys = list(fns) if (r + warmup) % 2 == 0 else list(fns)[::-1]
        for k in [k for k in keys if r < want[k] and not out[k]["errors"]]:
            torch.manual_seed(0)
            _sync()
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                fns[k]()
                _sync()
            except Exception as e:  # noqa: BLE001 - a failing callable is a result
                out[k]["errors"].append(err_text(e))
                continue
            if r >= 0:
                out[k]["times_s"].append(time.perf_counter() - t0)
                out[k]["cpu_s"].append(time.process_time() - c0)
    return out


def _status_kb(field: str) -> int:
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(field))


def _start_peak() -> tuple[str, float, Callable[[], float]]:
    """(how, the baseline in bytes, a function giving the peak in MiB above it since this call)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        how = "CUDA max_memory_allocated minus allocated baseline"
        read, base = torch.cuda.max_memory_allocated, torch.cuda.memory_allocated()
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            how = "VmHWM after clear_refs reset minus VmRSS baseline"
            read, base = lambda: _status_kb("VmHWM") * 1024, _status_kb("VmRSS") * 1024
        except (OSError, StopIteration):
            how = "ru_maxrss minus baseline (clear_refs unavailable)"
            read = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            base = read()

    def peak() -> float:
        _sync()
        return (read() - base) / 2**20

    return how, base, peak


def probe(target: str, configs: list[dict], calls=1, warmup=True, threads=1) -> list[dict]:
    """Peak memory (``VmHWM`` growth, or CUDA's peak) of the callables ``function(**config)`` built
    by ``target = "module:function"``, in one fresh process; after an optional warm-up, the largest
    peak of ``calls`` calls (the kernel occasionally under-counts one under memory pressure)."""
    spec = json.dumps({"target": target, "configs": configs, "calls": calls, "warmup": warmup})
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", BENCH_THREADS=str(threads))
    cmd = [sys.executable, "-m", "benchmarks.kit", spec]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        why = "timed out after 3600s"
    except (IndexError, json.JSONDecodeError):
        why = ((p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"])[0][:300]
    return [{"peak_mib": None, "memory_error": why}] * len(configs)


def allocation(mib: float):
    """A callable allocating ``mib`` MiB (the probe's self-test)."""
    return lambda: torch.ones(int(mib * 2**18))


def _probe_child(spec: dict) -> None:
    warnings.filterwarnings("ignore")
    set_threads(int(os.environ.get("BENCH_THREADS", "1")))
    module, name = spec["target"].split(":")
    build = getattr(importlib.import_module(module), name)
    out = []
    for cfg in spec["configs"]:
        try:
            fn = build(**cfg)
            if spec["warmup"]:
                fn()
            peaks = []
            for _ in range(spec["calls"]):
                how, base, peak = _start_peak()
                t0 = time.perf_counter()
                fn()
                peaks.append(peak())
            out.append({"peak_mib": max(peaks), "peak_mib_calls": peaks, "how": how})
            out[-1].update(baseline_mib=base / 2**20, time_s=time.perf_counter() - t0)
            del fn
        except Exception as e:  # noqa: BLE001
            out.append({"peak_mib": None, "memory_error": err_text(e)})
    print(json.dumps(out))


if __name__ == "__main__":
    _probe_child(json.loads(sys.argv[1]))
