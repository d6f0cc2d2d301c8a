"""Root pytest configuration: names available to the docstring examples (doctests)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace["torch"] = torch
    doctest_namespace["nn"] = torch.nn
    torch.manual_seed(0)
