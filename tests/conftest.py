"""Shared pytest configuration for every test folder: ``hypergrad/`` (the library), ``bort2/``
(the pipeline), ``examples/`` (the example scripts) and ``benchmarks/`` (the benchmark package).

The repository root (for ``benchmarks``) and ``examples/`` (the example scripts are imported as
modules, as ``python examples/x.py`` would find them) are on the import path through pytest's
``pythonpath`` setting in ``pyproject.toml``; ``bort2`` is an installed package
(``pip install -e examples/bort2``). Shared references live in ``helpers.py``.
"""

import os
import shutil

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Run a test with one torch thread (exact, machine-independent float reductions)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """A MiniDigits cache folder for the pipeline tests: links a valid default cache if there is
    one, otherwise the first run builds it there (about 20 s)."""
    from bort2.data.minidigits import cache_path, read_cache

    root = tmp_path_factory.mktemp("hypergrad_data")
    src = cache_path(None, seed=0)
    if src.is_file() and read_cache(src, 0) is not None:
        dst = cache_path(root, seed=0)
        try:
            os.symlink(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    return root
