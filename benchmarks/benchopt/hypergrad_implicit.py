"""hypergrad's solve-then-differentiate path as a benchopt solver of benchmark_bilevel: full-batch
inner L-BFGS (``hg.inner.LBFGS``), ``hg.implicit_grad`` with CG, an outer L-BFGS or gradient
step per callback (``benchmark_utils/hypergrad_solver.py``)."""

from benchmark_utils.hypergrad_solver import HypergradImplicit


class Solver(HypergradImplicit):
    name = "hg_implicit"
