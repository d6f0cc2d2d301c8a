"""How a decorated call is split (:func:`bind_hparams`) and checked: the other arguments that
would silently get no gradient (:func:`refuse_differentiable_constants`), and the tensors the
condition reaches by closure, found in its autograd graph (:func:`closure_leaves`), which the
decorators differentiate like the hyperparameters."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._C._functorch import maybe_current_level

from ..errors import HypergradError, HypergradTypeError
from ..tree import PyTree, Tensors


def bind_hparams(
    fit: Callable[..., PyTree], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """Split a call of ``fit`` into its hyperparameters (first parameter) and the rest.

    Shared by ``@hg.implicit``, ``@hg.custom_root`` and ``@hg.custom_fixed_point``. The
    hyperparameters may be passed positionally or by keyword (by the name of ``fit``'s first
    parameter, or as ``hparams=``). Returns them and ``h -> fit(...)`` with them replaced by ``h``.
    """
    try:
        params = list(inspect.signature(fit).parameters.values())
    except (TypeError, ValueError):  # builtins and the like: fall back to positional
        params = []
    first = params[0] if params else None
    named = first is not None and first.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    # `first is not None` is implied by `named`; it is repeated for the type checker.
    if named and first is not None and not args and first.name in kwargs:
        rest = dict(kwargs)
        hparams = rest.pop(first.name)
        return hparams, lambda h: fit(*args, **{first.name: h}, **rest)
    if not args and "hparams" in kwargs:
        rest = dict(kwargs)
        hparams = rest.pop("hparams")
        if named and first is not None and first.kind is inspect.Parameter.KEYWORD_ONLY:
            return hparams, lambda h: fit(**{first.name: h}, **rest)
        return hparams, lambda h: fit(h, **rest)
    if not args:
        raise HypergradTypeError(
            f"{getattr(fit, '__name__', 'fit')} needs its hyperparameters: pass them as the first "
            "positional argument or by the name of its first parameter"
        )
    return args[0], lambda h: fit(h, *args[1:], **kwargs)


def closure_leaves(outputs: Sequence[torch.Tensor], known: Sequence[torch.Tensor]) -> Tensors:
    """The leaf tensors that require grad, that ``outputs`` depend on, other than ``known``.

    One walk of the autograd graph of ``outputs`` (evaluated on ``known``, fresh leaves): what it
    finds reached the function by closure (a module's parameters, a tensor of the enclosing
    scope) instead of through its arguments. A tensor computed from such leaves (``2 * W``
    closed over) leads to its leaves, ``W``. In the order first met, each once.
    """
    known_ids = {id(t) for t in known}
    found: dict[int, torch.Tensor] = {}
    for o in outputs:
        if o.grad_fn is None and o.requires_grad and id(o) not in known_ids:
            found.setdefault(id(o), o)
    seen: dict[int, Any] = {}  # the nodes themselves are kept, so that no id is reused
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if id(var) not in known_ids:
                found.setdefault(id(var), var)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return tuple(found.values())


def outside_transforms() -> bool:
    """True outside every ``torch.func`` transform (``grad``, ``vjp``, ``vmap``...), where the
    decorators look for tensors captured by closure; inside one, ``torch.func`` itself treats
    closed-over tensors as constants."""
    return maybe_current_level() is None


def tensors_requiring_grad(value: Any, path: str) -> Iterator[str]:
    """The paths of the tensors in ``value`` (tuples, lists, dicts of them) that require grad."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield path
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from tensors_requiring_grad(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensors_requiring_grad(v, f"{path}[{k!r}]")


def refuse_differentiable_constants(
    fit: Callable[..., PyTree],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    hparams: Any,
    what: str,
) -> None:
    """Raise when an argument of ``fit`` other than its hyperparameters holds a tensor that
    requires grad: the decorators (``what``: ``@hg.implicit``, ``@hg.custom_root``, ...) treat
    those as constants, so it would silently get no gradient."""
    try:
        names = list(inspect.signature(fit).parameters)
    except (TypeError, ValueError):
        names = []
    given: list[tuple[str, Any]] = []
    for i, a in enumerate(args):
        if a is not hparams:
            given.append((names[i] if i < len(names) else f"args[{i}]", a))
    given += [(k, v) for k, v in kwargs.items() if v is not hparams]
    bad = [p for name, value in given for p in tensors_requiring_grad(value, name)]
    if bad:
        raise HypergradError(
            f"argument {', '.join(bad)} of {what} {getattr(fit, '__qualname__', 'fit')} "
            "requires grad, but only the hyperparameters (the first argument) are differentiated:"
            " it would silently get no gradient. Pass it detached (.detach(); e.g. a warm start, "
            "whose derivative is zero at a solution), or make it part of the hyperparameters"
        )
