"""``benchmarks.problems.cached``: the cache folder is named by an environment variable
(``HYPERGRAD_PEERS_CACHE``), so its files are not trusted. They are read with
``torch.load(weights_only=True)``: a planted pickle whose ``__reduce__`` would run code is refused
and the code does not run; the benchmark's own results (tensors, NumPy arrays, numbers, strings,
containers) round-trip."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from benchmarks import problems


class _Payload:
    """Unpickling this calls ``os.system`` (writes a marker file): the attack being refused."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def _plant(path, marker, as_torch: bool) -> None:
    obj = {"g": _Payload(str(marker))}
    if as_torch:
        torch.save(obj, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(obj, f)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("as_torch", [True, False], ids=["torch.save", "pickle.dump"])
def test_planted_pickle_is_refused_and_does_not_run(tmp_path, monkeypatch, as_torch):
    monkeypatch.setenv("HYPERGRAD_PEERS_CACHE", str(tmp_path))
    marker = tmp_path / "marker"
    path = tmp_path / f"planted-{problems.CACHE_VERSION}.pt"
    _plant(path, marker, as_torch)
    built = []
    try:
        problems.cached("planted", lambda: built.append(1) or {"g": np.zeros(2)})
        raised: Exception | None = None
    except Exception as exc:  # checked below, after the marker
        raised = exc
    assert not marker.exists(), "the planted pickle's code ran"
    assert isinstance(raised, problems.UnsafeCacheError), raised
    assert str(path) in str(raised) and "refused without running it" in str(raised)
    assert not built and path.exists()  # neither rebuilt nor silently overwritten


def test_garbage_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERGRAD_PEERS_CACHE", str(tmp_path))
    (tmp_path / f"junk-{problems.CACHE_VERSION}.pt").write_bytes(b"not a cache")
    with pytest.raises(problems.UnsafeCacheError):
        problems.cached("junk", dict)


def test_cache_round_trips_plain_data(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERGRAD_PEERS_CACHE", str(tmp_path))
    value = {
        "g": np.arange(4, dtype=np.float64) / 3,
        "params": {"w": torch.randn(3, 2, dtype=torch.float64)},
        "ref": {"g": np.ones((2, 2), dtype=np.float32), "iters": 7, "residual": np.float64(1e-12)},
        "converged": True,
        "alt": None,
        "pair": (1.5, "x"),
    }
    first = problems.cached("plain", lambda: value)
    again = problems.cached("plain", lambda: pytest.fail("rebuilt although cached"))
    for got in (first, again):
        np.testing.assert_array_equal(got["g"], value["g"])
        assert isinstance(got["g"], np.ndarray) and isinstance(got["ref"]["g"], np.ndarray)
        assert got["ref"]["g"].dtype == np.float32
        torch.testing.assert_close(got["params"]["w"], value["params"]["w"], rtol=0, atol=0)
        assert got["ref"]["iters"] == 7 and got["ref"]["residual"] == 1e-12
        assert got["converged"] is True and got["alt"] is None and got["pair"] == (1.5, "x")
        assert isinstance(got["build_s"], float)
    # the file itself loads with weights_only=True (no NumPy globals needed)
    raw = torch.load(tmp_path / f"plain-{problems.CACHE_VERSION}.pt", weights_only=True)
    assert isinstance(raw["g"]["__ndarray__"], torch.Tensor)
