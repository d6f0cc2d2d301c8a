"""The race on benchopt's ``benchmark_bilevel``: ``python -m benchmarks benchopt --bench-dir PATH``.

``race.py`` installs the solver files (``hypergrad_*.py``, over ``hg_solver.py``), our dataset
(``hg_regsel.py``) and the torch problems (``torch_problems.py``) into a checkout, writes
Fashion-MNIST as its ``mnist.pkl`` (``fashion.py``), runs benchopt (``launch.py``) and turns the
result parquet into tables (``tables.py``). The benchopt-facing files are imported only inside
the checkout; ``torch_problems``, ``tables`` and ``fashion`` need neither benchopt nor JAX.
"""
