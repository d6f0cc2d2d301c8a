"""BORT2 pipeline entry point: ``python examples/bort2/run.py [--config FILE] [key=value ...]``.

The same command as the ``bort2`` console script (``pip install -e examples/bort2``); the code
is :mod:`bort2.cli`, and ``--help`` lists every key with its default and valid values.
"""

# ``python examples/bort2/run.py`` puts this folder first on sys.path, so ``bort2`` imports as is
from bort2.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
