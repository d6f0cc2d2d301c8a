"""Every bad input to ``hypergrad.labels`` and ``hypergrad.tree`` raises a HypergradError subclass
that is also the matching builtin (``except ValueError`` / ``except TypeError`` keep working)."""

import ast
import inspect

import pytest
import torch
from torch import nn

import hypergrad as hg
from hypergrad import labels, tree
from hypergrad.labels import AdaptiveThreshold, GumbelLabeler, gumbel_softmax_labels
from hypergrad.labels import soft_cross_entropy as sce
from hypergrad.tree import tree_add, tree_flatten, tree_unflatten, tree_unravel


def _per_class():
    return AdaptiveThreshold(per_class=True, num_classes=3)


def _spec():
    return tree_flatten({"w": torch.ones(2), "b": (torch.zeros(1),)})[1]


class _Bad1D(nn.Module):
    def forward(self, x):
        return x.sum(1)


class _IntLogits(nn.Module):
    def forward(self, x):
        return torch.ones(x.shape[0], 3, dtype=torch.long)


L = torch.zeros(4, 3)  # logits
T = torch.full((4, 3), 1 / 3)  # soft targets

# (site, trigger, builtin, message fragment): one entry per raise statement in labels.py/tree.py
CASES = [
    # labels._check_positive_finite (temperature, via the property and the function)
    (
        "temperature type",
        lambda: GumbelLabeler(nn.Linear(2, 3), temperature="1"),
        TypeError,
        "temperature must be a real number",
    ),
    (
        "temperature value",
        lambda: GumbelLabeler(nn.Linear(2, 3), temperature=0.0),
        ValueError,
        "temperature must be a finite number > 0",
    ),
    (
        "temperature nan",
        lambda: gumbel_softmax_labels(L, temperature=float("nan")),
        ValueError,
        "temperature",
    ),
    # gumbel_softmax_labels
    (
        "gumbel logits type",
        lambda: gumbel_softmax_labels([[0.0, 1.0]]),
        TypeError,
        "logits must be a tensor",
    ),
    (
        "gumbel logits 1-D",
        lambda: gumbel_softmax_labels(torch.zeros(3)),
        ValueError,
        "logits must be a 2-D floating-point",
    ),
    (
        "gumbel logits int",
        lambda: gumbel_softmax_labels(torch.zeros(2, 3, dtype=torch.long)),
        ValueError,
        "logits must be a 2-D floating-point",
    ),
    # GumbelLabeler
    ("labeler net type", lambda: GumbelLabeler(lambda x: x), TypeError, "net must be an nn.Module"),
    (
        "labeler 1-D logits",
        lambda: GumbelLabeler(_Bad1D())(torch.zeros(4, 3)),
        ValueError,
        "2-D logits",
    ),
    (
        "labeler int logits",
        lambda: GumbelLabeler(_IntLogits())(torch.zeros(4, 3)),
        ValueError,
        "floating-point logits",
    ),
    # AdaptiveThreshold.__init__
    ("alpha type", lambda: AdaptiveThreshold(alpha="0.9"), TypeError, "alpha must be a real"),
    (
        "alpha range",
        lambda: AdaptiveThreshold(alpha=1.0),
        ValueError,
        r"alpha must lie in \[0, 1\)",
    ),
    (
        "max_init type",
        lambda: AdaptiveThreshold(max_init=None),
        TypeError,
        "max_init must be a real",
    ),
    (
        "max_init inf",
        lambda: AdaptiveThreshold(max_init=float("inf")),
        ValueError,
        "max_init must be finite",
    ),
    (
        "num_classes missing",
        lambda: AdaptiveThreshold(per_class=True),
        ValueError,
        "num_classes is required",
    ),
    (
        "num_classes type",
        lambda: AdaptiveThreshold(per_class=True, num_classes=3.0),
        TypeError,
        "num_classes must be an int",
    ),
    (
        "num_classes < 1",
        lambda: AdaptiveThreshold(per_class=True, num_classes=0),
        ValueError,
        "num_classes must be >= 1",
    ),
    (
        "num_classes global",
        lambda: AdaptiveThreshold(num_classes=-2),
        ValueError,
        "num_classes must be a positive int or None",
    ),
    # AdaptiveThreshold._check_inputs
    (
        "confidence type",
        lambda: AdaptiveThreshold()([0.5, 0.7]),
        TypeError,
        "confidence must be a tensor",
    ),
    (
        "confidence 2-D",
        lambda: AdaptiveThreshold()(torch.rand(5, 2)),
        ValueError,
        "confidence must be 1-D",
    ),
    (
        "confidence int",
        lambda: AdaptiveThreshold()(torch.ones(5, dtype=torch.long)),
        ValueError,
        "confidence must be floating point",
    ),
    ("pred missing", lambda: _per_class()(torch.rand(5)), ValueError, "pred .* is required"),
    (
        "pred type",
        lambda: _per_class()(torch.rand(3), [0, 1, 2]),
        TypeError,
        "pred must be a tensor",
    ),
    (
        "pred shape",
        lambda: _per_class()(torch.rand(5), torch.zeros(4, dtype=torch.long)),
        ValueError,
        "pred must have the shape of confidence",
    ),
    (
        "pred float",
        lambda: _per_class()(torch.rand(3), torch.zeros(3)),
        ValueError,
        "pred must be an integer tensor",
    ),
    (
        "pred range",
        lambda: _per_class()(torch.rand(5), torch.full((5,), 3)),
        ValueError,
        r"pred values must lie in \[0, 3\)",
    ),
    # soft_cross_entropy
    ("reduction", lambda: sce(L, T, reduction="avg"), ValueError, "reduction must be one of"),
    ("sce logits", lambda: sce(torch.zeros(3), T), ValueError, "logits must be a 2-D tensor"),
    (
        "sce targets",
        lambda: sce(L, torch.zeros(4, 2)),
        ValueError,
        "targets must have the shape of logits",
    ),
    ("sce mask", lambda: sce(L, T, mask=torch.ones(3)), ValueError, r"mask must have shape \(N,\)"),
    # tree
    (
        "tree leaf type",
        lambda: tree_flatten({"w": torch.ones(2), "b": [1.0]}, "params"),
        TypeError,
        r"params\['b'\]\[0\] must be a tensor",
    ),
    (
        "tree too many leaves",
        lambda: tree_unflatten(_spec(), [torch.ones(1)] * 3),
        ValueError,
        "too many leaves .* has 2 leaves, got 3",
    ),
    (
        "tree too few leaves",
        lambda: tree_unflatten(_spec(), [torch.ones(1)]),
        ValueError,
        "too few leaves .* has 2 leaves, got 1",
    ),
    (
        "tree leaf count mismatch",
        lambda: tree_add((torch.ones(2),), (torch.ones(2), torch.ones(1))),
        ValueError,
        r"tree_add: .* different numbers of leaves \(1, 2\)",
    ),
    (
        "tree_unravel size",
        lambda: tree_unravel(torch.ones(5), (torch.ones(2), torch.ones(2))),
        ValueError,
        "tree_unravel: the vector has 5 elements but the pytree has 4",
    ),
]


@pytest.mark.parametrize("trigger,builtin,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_hypergrad_error_and_builtin(trigger, builtin, match):
    with pytest.raises(hg.HypergradError, match=match) as exc:
        trigger()
    assert isinstance(exc.value, builtin)
    expected = hg.HypergradTypeError if builtin is TypeError else hg.HypergradValueError
    assert isinstance(exc.value, expected)
    # generic handlers keep working
    with pytest.raises(builtin):
        trigger()


def _raised_names(module):
    """Name of the exception class of every ``raise X(...)`` statement in ``module``."""
    names = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            names.append(exc.id if isinstance(exc, ast.Name) else ast.unparse(exc))
    return names


@pytest.mark.parametrize("module", [labels, tree], ids=["labels", "tree"])
def test_module_raises_only_hypergrad_errors(module):
    names = _raised_names(module)
    assert names and set(names) <= {"HypergradTypeError", "HypergradValueError"}


def test_every_raise_site_has_a_case():
    # a new raise statement in labels.py or tree.py needs a case above (two sites have two cases:
    # temperature NaN besides 0, integer logits besides 1-D logits)
    n_sites = len(_raised_names(labels)) + len(_raised_names(tree))
    assert len(CASES) == n_sites + 2
