"""Run benchopt's CLI with a timer that waits for asynchronous work (run as a script by
``python -m benchmarks benchopt``; not imported by the package).

benchopt's callback reads the clock when a solver calls it, and excludes the metric evaluation
that follows. JAX dispatches asynchronously: a jitted epoch returns at once while XLA computes,
and the computation then finishes inside the (untimed) metric evaluation. Without a wait the
curves of the benchmark's JAX solvers would credit them with almost no compute time (measured:
``python -m benchmarks benchopt --no-block`` keeps benchopt's timer). Before the clock is read,
this wrapper calls ``jax.block_until_ready`` on the solver's current result; torch on CPU
computes synchronously, so hypergrad's rows are unaffected.
"""

import os
import sys


def patch_callback() -> None:
    import jax
    from benchopt import callback

    original = callback._Callback.__call__

    def call(self):
        res = getattr(self.solver, "get_result", None)
        if res is not None and self.it > 0:
            try:
                jax.block_until_ready(res())
            except Exception:  # noqa: BLE001 - a result that is not a pytree of arrays
                pass
        return original(self)

    callback._Callback.__call__ = call


if __name__ == "__main__":
    if os.environ.get("HG_RACE_BLOCK", "1") == "1":
        patch_callback()
    from benchopt.cli import benchopt

    sys.exit(benchopt(sys.argv[1:]))
