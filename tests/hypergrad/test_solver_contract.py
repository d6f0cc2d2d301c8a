"""The contract every linear solver keeps, run over the one list of solvers (``ALL_SOLVERS`` in
``tests/helpers.py``: one row per solver and per CG preconditioner; lineax's shape).

On a small SPD system split over two tensors (a pytree of several leaves), float64 unless said:

* a zero right-hand side gives ``x = 0``, converged, residual 0, without a warning;
* a warm start that already meets ``tol`` is returned as is, converged, for at most one product
  (the recomputed residual; direct solvers ignore ``x0``);
* ``converged`` means the residual recomputed from ``x`` against a dense float64 solve is within
  ``tol``, and a verified ``info.residual`` is that residual;
* a product that returns NaN raises an error naming the solver;
* settings are keyword-only, in the class and in its functional form ``solve_<name>``;
* ``damping`` solves ``(A + damping I) x = b``;
* settings are frozen, ``replace`` builds a validated copy, and every float setting refuses
  inf and NaN;
* a singular inconsistent system is never converged and always a reported, warned failure;
* float32 leaves are solved in float32;
* ``b`` and ``x0`` may be a bare tensor or a tuple/list/dict (nested) of tensors, ``matvec`` works
  on that structure and ``x`` comes back in it; other inputs (non-tensors, integer tensors, an
  ``x0`` or a product of another structure, shape or dtype, mixed float32/float64) raise a
  ``HypergradError`` naming the argument (and the dtypes);
* and, by tag, non-symmetric systems (solvers without ``symmetric``) and symmetric indefinite
  ones (without ``psd``) are solved.

A new solver is one row in ``ALL_SOLVERS``. The example solver of ``docs/solvers.md``
("Writing a solver") is read from that page, run, and held to the same contract.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import warnings

import pytest
import torch
from helpers import (
    ALL_SOLVERS,
    DIRECT,
    PSD,
    ROOT,
    SYMMETRIC,
    check_report,
    min_norm,
    psd,
    rel,
    solver_tol,
)

import hypergrad as hg
import hypergrad.solvers as solvers
from hypergrad.errors import FrozenSettingError, HypergradWarning

F64 = torch.float64


def _documented_solver() -> dict:
    """Run the code block of "Writing a solver" in docs/solvers.md; its namespace."""
    page = (ROOT / "docs" / "solvers.md").read_text(encoding="utf-8")
    section = page.split("## Writing a solver", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("solvers_md_example")  # a module of its own, as a user's file
    sys.modules[module.__name__] = module
    exec(compile(code, "docs/solvers.md", "exec", dont_inherit=True), module.__dict__)
    return module.__dict__


DOC = _documented_solver()
#: ALL_SOLVERS and the documented example solver
ROWS = ALL_SOLVERS + [
    pytest.param(
        lambda: DOC["Richardson"](omega=0.9, tol=1e-10),
        frozenset({SYMMETRIC, PSD}),
        id="doc-richardson",
    )
]
SHAPES = ((3,), (2, 3))  # two leaves: 9 unknowns
N = 9


def _system(seed=0, dtype=F64):
    """An SPD matrix with eigenvalues in [0.2, 1] and a right-hand side."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(N, N, generator=gen, dtype=F64))
    a = q @ torch.diag(torch.linspace(0.2, 1.0, N, dtype=F64)) @ q.T
    b = torch.randn(N, generator=gen, dtype=F64)
    return (0.5 * (a + a.T)).to(dtype), b.to(dtype)


def _leaves(flat):
    out, i = [], 0
    for shape in SHAPES:
        k = math.prod(shape)
        out.append(flat[i : i + k].reshape(shape))
        i += k
    return tuple(out)


def _flat(tree):
    return torch.cat([t.reshape(-1) for t in tree])


def _matvec(a):
    return lambda v: _leaves(a @ _flat(v))


def _solve(solver, a, b, x0=None):
    """``solver.solve`` on the pytree form of ``a x = b``: ``(x flat, info, warning classes)``."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, info = solver.solve(_matvec(a), _leaves(b), x0)
    assert [t.shape for t in x] == [torch.Size(s) for s in SHAPES]
    return _flat(x), info, [w.category for w in rec]


def _settings(solver):
    return [f for f in dataclasses.fields(solver) if f.init]


def _functional(solver):
    """``solve_<name>``, the functional form of ``solver``."""
    name = f"solve_{solver.name}"
    return getattr(solvers, name) if solver.name in solvers.SOLVERS else DOC[name]


def _damped(solver):
    return solver.damping if solver.damping else 0.0


@pytest.mark.parametrize("make, tags", ROWS)
def test_zero_right_hand_side(make, tags):
    a, _ = _system()
    x, info, cats = _solve(make(), a, torch.zeros(N, dtype=F64))
    assert bool((x == 0).all()) and info.converged and info.residual == 0.0
    if DIRECT not in tags:
        assert info.matvecs == 0 and info.extras["b_norm"] == 0.0
    assert not [c for c in cats if issubclass(c, HypergradWarning)], cats


@pytest.mark.parametrize("make, tags", ROWS)
def test_warm_start_within_tol_is_returned_for_one_product(make, tags):
    solver = make()
    a, b = _system()
    a_d = a + _damped(solver) * torch.eye(N, dtype=F64)
    x0 = _leaves(torch.linalg.solve(a_d, b))
    x, info = solver.solve(_matvec(a), _leaves(b), x0)
    assert info.converged and info.failure is None and info.residual <= solver_tol(solver)
    if DIRECT not in tags:
        assert x is x0 and info.iterations == 0 and info.matvecs <= 1, info
        assert info.extras["residual_verified"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("make, tags", ROWS)
def test_converged_means_the_true_residual_is_within_tol(make, tags, seed):
    solver = make()
    a, b = _system(seed)
    a_d = a + _damped(solver) * torch.eye(N, dtype=F64)
    x, info, cats = _solve(solver, a, b)
    assert info.converged, info
    tol = solver_tol(solver)
    true = check_report(info, x, a_d, b, tol, cats)
    assert true <= tol * (1 + 1e-6) + 1e-15
    assert rel(x, torch.linalg.solve(a_d, b)) <= 10 * tol


@pytest.mark.parametrize("make, tags", ROWS)
def test_nan_product_raises_naming_the_solver(make, tags):
    solver = make()
    _, b = _system()
    with pytest.raises(hg.HypergradValueError, match=type(solver).display) as err:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            solver.solve(lambda v: tuple(torch.full_like(t, math.nan) for t in v), _leaves(b))
    assert "NaN/Inf" in str(err.value)


@pytest.mark.parametrize("make, tags", ROWS)
def test_settings_are_keyword_only(make, tags):
    solver = make()
    first = getattr(solver, _settings(solver)[0].name)
    with pytest.raises(TypeError):
        type(solver)(first)
    a, b = _system()
    solve = _functional(solver)
    with pytest.raises(TypeError):
        solve(_matvec(a), _leaves(b), None, first)
    x1, i1 = solve(
        _matvec(a), _leaves(b), **{f.name: getattr(solver, f.name) for f in _settings(solver)}
    )
    x2, i2 = make().solve(_matvec(a), _leaves(b))
    assert torch.equal(_flat(x1), _flat(x2)) and i1.residual == i2.residual


@pytest.mark.parametrize("make, tags", ROWS)
def test_functional_form_validates_like_the_class(make, tags):
    solver = make()
    solve = _functional(solver)
    a, b = _system()
    with pytest.raises(hg.HypergradValueError, match=f"{type(solver).display} damping"):
        solve(_matvec(a), _leaves(b), damping=math.inf)


@pytest.mark.parametrize("make, tags", ROWS)
def test_damping_solves_the_shifted_system(make, tags):
    solver = make().replace(damping=0.5)
    a, b = _system()
    a_d = a + 0.5 * torch.eye(N, dtype=F64)
    x, info, cats = _solve(solver, a, b)
    assert info.converged and info.failure is None, info
    check_report(info, x, a_d, b, solver_tol(solver), cats)
    assert rel(x, torch.linalg.solve(a_d, b)) <= 10 * solver_tol(solver)
    assert rel(x, torch.linalg.solve(a, b)) > 0.1  # the shift matters


@pytest.mark.parametrize("make, tags", ROWS)
def test_settings_are_frozen_and_replace_validates(make, tags):
    solver = make()
    for f in _settings(solver):
        with pytest.raises(FrozenSettingError, match=r"replace\("):
            setattr(solver, f.name, getattr(solver, f.name))
        with pytest.raises(FrozenSettingError):
            delattr(solver, f.name)
    with pytest.raises(FrozenSettingError):  # a misspelt setting is not silently added
        solver.tolerance = 1e-3
    new = solver.replace(damping=0.25)
    assert new.damping == 0.25 and type(new) is type(solver) and new is not solver
    assert solver.damping != 0.25
    with pytest.raises(hg.HypergradValueError):
        solver.replace(damping=math.nan)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("make, tags", ROWS)
def test_every_float_setting_refuses_inf_and_nan(make, tags, value):
    solver = make()
    floats = [f.name for f in _settings(solver) if "float" in str(f.type)]
    assert "damping" in floats
    for name in floats:
        with pytest.raises(hg.HypergradValueError, match=f"{type(solver).display} {name}"):
            type(solver)(**{name: value})


SINGULAR_ROWS = ALL_SOLVERS + [
    pytest.param(
        lambda: hg.Nystrom(rank=4, damping=1e-2), frozenset({SYMMETRIC, DIRECT}), id="nystrom-low"
    )
]


@pytest.mark.parametrize("outside", [1.0, 1e-3])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("make, tags", SINGULAR_ROWS)
def test_singular_inconsistent_systems_are_reported(make, tags, seed, outside):
    """Rank 8 of 12, ``b`` with a component outside the range: no ``x`` solves it (without
    damping): never converged, always a reported and warned failure, ``x`` finite."""
    solver = make()
    n = 12
    a, range_basis, null_basis = psd(10 + seed, rank=8)
    gen = torch.Generator().manual_seed(20 + seed)
    b = range_basis @ torch.randn(8, generator=gen, dtype=F64)
    b_null = null_basis @ torch.randn(n - 8, generator=gen, dtype=F64)
    b = b / b.norm() + outside * b_null / b_null.norm()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, info = solver.solve(lambda v: (a @ v[0],), (b.clone(),))
    x = x[0]
    a_d = a + _damped(solver) * torch.eye(n, dtype=F64)
    true = check_report(info, x, a_d, b, solver_tol(solver), [w.category for w in rec])
    if not solver.damping:  # no x solves it
        floor = float(torch.linalg.norm(a @ min_norm(a, b) - b) / b.norm())
        assert true >= floor * (1 - 1e-9)
        assert not info.converged and info.failure is not None, (info.failure, info)
        assert math.isfinite(true) and float(x.norm()) < 1e8 * float(min_norm(a, b).norm())


@pytest.mark.parametrize("make, tags", ROWS)
def test_float32_leaves_are_solved_in_float32(make, tags):
    solver = make()
    if any(f.name == "tol" for f in _settings(solver)):
        solver = solver.replace(tol=1e-4)
    a, b = _system(dtype=torch.float32)
    a_d = a.double() + _damped(solver) * torch.eye(N, dtype=F64)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, info = solver.solve(_matvec(a), _leaves(b))
    assert all(t.dtype == torch.float32 for t in x)
    assert info.converged, info
    assert info.failure is None and not [w for w in rec if issubclass(w.category, HypergradWarning)]
    x = _flat(x).double()
    true = float(torch.linalg.norm(a_d @ x - b.double()) / torch.linalg.norm(b.double()))
    assert true <= 2 * solver_tol(solver)  # the float32 residual rounds within a few eps
    assert info.residual == pytest.approx(true, rel=1e-2, abs=1e-6)
    assert rel(x, torch.linalg.solve(a_d, b.double())) <= 1e-3


@pytest.mark.parametrize("make, tags", [p for p in ROWS if SYMMETRIC not in p.values[1]])
def test_nonsymmetric_systems_are_solved(make, tags):
    a, b = _system()
    gen = torch.Generator().manual_seed(5)
    a = a + 0.1 * torch.randn(N, N, generator=gen, dtype=F64)  # eigenvalues stay off zero
    solver = make()
    x, info, cats = _solve(solver, a, b)
    assert info.converged, info
    check_report(info, x, a, b, solver_tol(solver), cats)
    assert rel(x, torch.linalg.solve(a, b)) <= 10 * solver_tol(solver)


@pytest.mark.parametrize("make, tags", [p for p in ROWS if PSD not in p.values[1]])
def test_symmetric_indefinite_systems_are_solved(make, tags):
    a, b = _system()
    a = a - 0.65 * torch.eye(N, dtype=F64)  # eigenvalues in [-0.45, 0.35], none within 0.05 of 0
    solver = make()
    if solver.damping:  # Nystrom: shift so that A + damping I has the same spectrum
        a = a - solver.damping * torch.eye(N, dtype=F64)
    a_d = a + _damped(solver) * torch.eye(N, dtype=F64)
    x, info, cats = _solve(solver, a, b)
    assert info.converged, info
    check_report(info, x, a_d, b, solver_tol(solver), cats)
    assert rel(x, torch.linalg.solve(a_d, b)) <= 100 * solver_tol(solver)


def test_the_documented_solver_is_not_registered_and_shows_its_settings():
    import inspect

    assert "richardson" not in solvers.SOLVERS  # the registry lists the library's own
    params = inspect.signature(DOC["solve_richardson"]).parameters
    assert list(params) == ["matvec", "b", "x0", "maxiter", "omega", "tol", "damping"]
    assert DOC["Richardson"].display == "Richardson"


def test_registry_lists_every_library_solver_once():
    assert set(solvers.SOLVERS) == {make().name for make, _ in (p.values for p in ALL_SOLVERS)}
    for name, cls in solvers.SOLVERS.items():
        assert cls.name == name and getattr(hg, cls.__name__) is cls
        assert callable(getattr(solvers, f"solve_{name}"))


# ------------------------------------------------------------------ what solve() accepts

#: The pytree forms of a 9-unknown vector that ``solve`` takes for ``b`` and ``x0``.
FORMS = ("tensor", "tuple", "list", "dict", "nested")


def _to_form(flat, form):
    """``flat`` (9 entries) as a bare tensor, a tuple/list of two leaves, a dict, or a nested
    dict of a list and a tensor."""
    a, b = _leaves(flat)
    return {
        "tensor": flat.reshape(3, 3),
        "tuple": (a, b),
        "list": [a, b],
        "dict": {"w": b, "b": a},
        "nested": {"layer": [a], "head": b},
    }[form]


def _from_form(tree, form):
    if form == "tensor":
        return tree.reshape(-1)
    if form == "dict":
        return torch.cat([tree["b"].reshape(-1), tree["w"].reshape(-1)])
    if form == "nested":
        return torch.cat([tree["layer"][0].reshape(-1), tree["head"].reshape(-1)])
    return _flat(tree)


def _same_structure(x, ref):
    if isinstance(ref, torch.Tensor):
        assert isinstance(x, torch.Tensor) and x.shape == ref.shape and x.dtype == ref.dtype
    elif isinstance(ref, dict):
        assert type(x) is dict and list(x) == list(ref), (type(x), ref.keys())
        for k in ref:
            _same_structure(x[k], ref[k])
    else:
        assert type(x) is type(ref) and len(x) == len(ref), (type(x), type(ref))
        for xi, ri in zip(x, ref):
            _same_structure(xi, ri)


def _form_matvec(a, form):
    return lambda v: _to_form(a @ _from_form(v, form), form)


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("make, tags", ROWS)
def test_b_and_x0_in_any_pytree_form(make, tags, form, warm):
    """A bare tensor, a tuple, a list, a dict or a nested dict for ``b`` (and ``x0``): ``x`` comes
    back in the same structure and solves the system (dense float64 reference)."""
    solver = make()
    a, b = _system()
    a_d = a + _damped(solver) * torch.eye(N, dtype=F64)
    ref = torch.linalg.solve(a_d, b)
    x0 = _to_form(0.5 * ref, form) if warm else None
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, info = solver.solve(_form_matvec(a, form), _to_form(b, form), x0)
    _same_structure(x, _to_form(b, form))
    assert info.converged and info.failure is None, info
    flat = _from_form(x, form)
    check_report(info, flat, a_d, b, solver_tol(solver), [w.category for w in rec])
    assert rel(flat, ref) <= 10 * solver_tol(solver)


@pytest.mark.parametrize("make, tags", ROWS)
def test_a_zero_bare_tensor_gives_a_zero_bare_tensor(make, tags):
    a, _ = _system()
    x, info = make().solve(lambda v: a @ v, torch.zeros(N, dtype=F64))
    assert isinstance(x, torch.Tensor) and x.shape == (N,) and not x.any() and info.converged


def _refused(solver, matvec, b, x0=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return solver.solve(matvec, b, x0)


@pytest.mark.parametrize("make, tags", ROWS)
def test_bad_b_x0_and_matvec_are_refused_naming_the_argument(make, tags):
    solver = make()
    name = type(solver).display
    a, b = _system()
    mv = _matvec(a)
    cases = [
        # (matvec, b, x0, error class, what the message must name)
        (mv, [1.0, 2.0], None, hg.HypergradTypeError, r"b\[0\] must be a tensor"),
        (lambda v: v, (torch.arange(N),), None, hg.HypergradTypeError, r"b\[0\] .*floating"),
        (mv, _leaves(b), {"x": b}, hg.HypergradTypeError, r"x0 must have the structure of b"),
        (mv, _leaves(b), (b[:3],), hg.HypergradTypeError, "x0"),
        (mv, _leaves(b), (b[:3], b[:3]), hg.HypergradValueError, r"x0\[1\] has shape"),
        (mv, _leaves(b), (b[:3], "zeros"), hg.HypergradTypeError, r"x0\[1\]"),
        (lambda v: _flat(v), _leaves(b), None, hg.HypergradTypeError, "matvec must return"),
        (lambda v: v[:1], _leaves(b), None, hg.HypergradValueError, "matvec returned 1"),
        (lambda v: a @ v["w"], {"w": b}, None, hg.HypergradTypeError, "matvec must return"),
        (lambda v: (v[0], v[1].reshape(-1)), _leaves(b), None, hg.HypergradValueError, "shape"),
        ("A", _leaves(b), None, hg.HypergradTypeError, "matvec must be a callable"),
    ]
    for matvec, rhs, x0, error, match in cases:
        with pytest.raises(error, match=match) as err:
            _refused(solver, matvec, rhs, x0)
        assert str(err.value).startswith(name), str(err.value)


@pytest.mark.parametrize("make, tags", ROWS)
def test_mixed_float32_float64_is_refused_naming_the_dtypes(make, tags):
    """A float32 product for float64 ``b`` (or the reverse), or a float32 warm start for float64
    ``b``: a HypergradTypeError naming both dtypes, not a raw torch error, a silent promotion
    (an ``x`` of another dtype than ``b``) or float32 products limiting a float64 solve."""
    solver = make()
    a, b = _system()
    a32, b32 = a.float(), b.float()
    cases = [
        (lambda v: _leaves((a @ _flat(v)).float()), _leaves(b), None),
        (lambda v: _leaves(a @ _flat(v).double()), _leaves(b32), None),
        (lambda v: (a @ v).float(), b, None),
        (_matvec(a), _leaves(b), _leaves(torch.zeros(N))),
        (_matvec(a32), _leaves(b32), _leaves(torch.zeros(N, dtype=F64))),
        (lambda v: a @ v, b, torch.zeros(N)),
    ]
    for matvec, rhs, x0 in cases:
        with pytest.raises(hg.HypergradTypeError, match="float32") as err:
            _refused(solver, matvec, rhs, x0)
        assert "float64" in str(err.value) and str(err.value).startswith(type(solver).display)


def test_the_documented_bare_tensor_example_runs():
    """The code block of "What `solve` takes" in docs/solvers.md, run as written."""
    page = (ROOT / "docs" / "solvers.md").read_text(encoding="utf-8")
    section = page.split("## What `solve` takes", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/solvers.md", "exec", dont_inherit=True), namespace)
    assert isinstance(namespace["x"], torch.Tensor) and namespace["info"].converged
