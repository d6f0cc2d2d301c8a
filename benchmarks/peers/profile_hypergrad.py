"""Where hypergrad's time goes, next to a peer, on one benchmark configuration.

    python benchmarks/peers/profile_hypergrad.py --problem mlp_fashion --K 20 \
        --peers torchopt:cg jaxopt:cg [--reps 5]

For every configuration: median CPU time, then a cProfile of ``--reps`` calls (top functions by
own time, and the share of time inside autograd's backward engine = the Hessian-vector and
mixed products) and the torch profiler's top operators. Written to
``benchmarks/results/peers/profile_<problem>_K<K>.md`` (and printed).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--problem", default="mlp_fashion")
    ap.add_argument("--K", type=int, default=20)
    ap.add_argument("--solver", default="cg", help="hypergrad solver")
    ap.add_argument("--peers", nargs="*", default=["torchopt:cg"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--unrolled",
        type=int,
        default=None,
        metavar="T",
        help="profile the unrolled problem with T steps instead (peers: lib:unrolled)",
    )
    args = ap.parse_args(argv)
    import run_all

    run_all.set_threads(args.threads)
    warnings.filterwarnings("ignore")
    import adapters as ad
    import problems as pr
    import torch

    confs = [("hypergrad", args.solver)] + [tuple(p.split(":")) for p in args.peers]
    if args.unrolled:
        cache: dict = {}
        args.problem, args.K = run_all.UNROLLED_KEY, args.unrolled
        fns = {c: run_all.build_config(args.problem, c[0], c[1], args.K, cache)[0] for c in confs}
        P = cache[("P", args.K)][0]
    else:
        P = pr.get(args.problem)
        fns = {c: ad.make(c[0], c[1], P, args.K) for c in confs}
    for f in fns.values():
        f()
    cpu = {c: [] for c in confs}
    for r in range(args.reps):
        for c in confs if r % 2 == 0 else confs[::-1]:
            t0 = time.process_time()
            fns[c]()
            cpu[c].append(time.process_time() - t0)
    out = [
        f"# Profile: {args.problem}, {'T' if args.unrolled else 'K'} = {args.K}\n",
        f"{P.title}; one thread; median CPU time over {args.reps} calls.\n",
    ]
    for c in confs:
        out.append(f"* {c[0]} {c[1]}: {statistics.median(cpu[c]) * 1e3:.1f} ms CPU")
    out.append("")
    for c in confs:
        if c[0] == "jaxopt":
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            fns[c]()
        prof.disable()
        st = pstats.Stats(prof)
        total = st.total_tt
        engine = sum(
            v[2] for k, v in st.stats.items() if k[2] == "run_backward" or "run_backward" in str(k)
        )
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        out.append(f"## {c[0]} {c[1]}: cProfile\n")
        out.append(
            f"total {total / args.reps * 1e3:.1f} ms per call; inside autograd's backward "
            f"engine (products and gradients) {engine / total:.0%}\n"
        )
        out.append("```\n" + "\n".join(s.getvalue().strip().splitlines()[-18:]) + "\n```\n")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            fns[c]()
        table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        out.append(f"## {c[0]} {c[1]}: torch profiler (one call, top operators by self CPU)\n")
        out.append("```\n" + table + "\n```\n")
    text = "\n".join(out)
    dest = ROOT / "benchmarks" / "results" / "peers" / f"profile_{args.problem}_K{args.K}.md"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
