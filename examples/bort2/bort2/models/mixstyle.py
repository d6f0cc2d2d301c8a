"""MixStyle feature-statistics mixing (Zhou et al., ICLR 2021) and a seedable Beta sampler.

MixStyle normalises every instance's feature map with its own per-channel mean and standard
deviation and re-styles it with a convex combination of its statistics and those of a partner
instance from the same batch::

    mu, sig = mean_hw(x), sqrt(var_hw(x) + eps)          # detached, var is the unbiased one
    out = (x - mu) / sig * (lam * sig + (1 - lam) * sig[perm]) + lam * mu + (1 - lam) * mu[perm]

with ``lam ~ Beta(alpha, alpha)`` drawn per instance. It is applied to a whole batch with
probability ``p`` in training mode and is the identity in evaluation mode.

Domain labels for ``mix="crossdomain"`` are given through :meth:`MixStyle.set_domains` (or
:func:`set_mixstyle_domains` for every MixStyle module of a model); they stay in effect until
cleared with ``set_domains(None)``. Without domain labels, cross-domain mixing falls back to a
random permutation.

:func:`mixstyle_disabled` turns every MixStyle module of a model into the identity inside a
``with`` block (e.g. for FixMatch-CM's pseudo-labelling forward pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None, device) -> torch.Tensor:
    """Uniform [0, 1) numbers drawn on the generator's device, returned on ``device``."""
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def _randperm(n: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """A random permutation drawn on the generator's device, returned on ``device``."""
    gen_device = generator.device if generator is not None else device
    return torch.randperm(n, generator=generator, device=gen_device).to(device)


def sample_beta(
    alpha: float,
    shape: tuple[int, ...],
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draw ``Beta(alpha, alpha)`` samples, reproducibly when a generator is given.

    ``torch.distributions.Beta`` cannot take a :class:`torch.Generator`; with a generator this
    uses Joehnk's rejection method in log space (``X = U^(1/a)``, ``Y = V^(1/a)``, accept when
    ``X + Y <= 1``, return ``X / (X + Y)``), whose acceptance rate is
    ``Gamma(a+1)^2 / Gamma(2a+1)`` (0.99 for a=0.1, 0.5 for a=1). Without a generator it uses
    ``torch.distributions.Beta`` (global RNG).

    Args:
        alpha: Both concentration parameters, > 0.
        shape: Output shape.
        generator: Optional generator for reproducible draws.
        device: Output device (default CPU).

    Returns:
        A float32 tensor of the given shape with values in [0, 1].
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    device = torch.device("cpu") if device is None else torch.device(device)
    if generator is None:
        conc = torch.tensor(float(alpha), device=device)
        return torch.distributions.Beta(conc, conc).sample(shape)
    n = 1
    for s in shape:
        n *= int(s)
    out = torch.empty(n, device=device)
    todo = torch.arange(n, device=device)
    while todo.numel() > 0:
        u = _uniform((2, todo.numel()), generator, device).clamp_min(1e-12)
        log_x = u[0].log() / alpha
        log_y = u[1].log() / alpha
        log_s = torch.logaddexp(log_x, log_y)
        ok = log_s <= 0
        out[todo[ok]] = (log_x[ok] - log_s[ok]).exp()
        todo = todo[~ok]
    return out.view(shape)


class MixStyle(nn.Module):
    """Mix per-instance channel statistics with those of a partner instance.

    Args:
        p: Probability of applying MixStyle to a training batch.
        alpha: Beta(alpha, alpha) concentration of the mixing weight ``lam``.
        eps: Added to the variance before the square root.
        mix: ``"random"`` (partner from a random permutation) or ``"crossdomain"`` (partner
            drawn uniformly among instances of another domain, per :meth:`set_domains`).
        generator: Optional :class:`torch.Generator` for the Bernoulli(p) draw, the partners and
            ``lam``; without it the global RNG is used.

    Attributes:
        disabled: When True the module is the identity and draws nothing (see
            :func:`mixstyle_disabled`).
    """

    disabled: bool = False

    def __init__(
        self,
        p: float = 0.5,
        alpha: float = 0.1,
        eps: float = 1e-6,
        mix: str = "random",
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        if mix not in ("random", "crossdomain"):
            raise ValueError(f"mix must be 'random' or 'crossdomain', got {mix!r}")
        self.p = float(p)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.mix = mix
        self.generator = generator
        self.domains: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"p={self.p}, alpha={self.alpha}, eps={self.eps}, mix={self.mix!r}"

    def set_domains(self, domains: torch.Tensor | None) -> None:
        """Set (or clear with ``None``) the domain label of every instance of the next batches."""
        self.domains = None if domains is None else domains.detach().long()

    def _partners(self, n: int, device) -> torch.Tensor:
        if self.mix == "random" or self.domains is None:
            return _randperm(n, self.generator, device)
        d = self.domains.to(device)
        if d.numel() != n:
            raise ValueError(f"MixStyle has {d.numel()} domain labels for a batch of {n}")
        other = d[:, None] != d[None, :]
        scores = _uniform((n, n), self.generator, device).masked_fill(~other, -1.0)
        partner = scores.argmax(dim=1)
        fallback = _randperm(n, self.generator, device)
        return torch.where(other.any(dim=1), partner, fallback)

    def forward(
        self,
        x: torch.Tensor,
        lam: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply MixStyle to ``x`` of shape (N, C, H, W).

        Args:
            x: Feature maps.
            lam: Optional per-instance mixing weights (N,). When ``lam`` or ``perm`` is given,
                mixing is applied unconditionally (no Bernoulli(p) draw) with these values.
            perm: Optional partner indices (N,).

        Returns:
            The mixed feature maps (training mode) or ``x`` itself (evaluation mode or
            :attr:`disabled`).
        """
        if not self.training or self.disabled:
            return x
        n = x.shape[0]
        if lam is None and perm is None:
            if self.p <= 0 or n < 2:
                return x
            if float(_uniform((1,), self.generator, "cpu")) >= self.p:
                return x
        if perm is None:
            perm = self._partners(n, x.device)
        if lam is None:
            lam = sample_beta(self.alpha, (n,), self.generator, x.device)
        lam = lam.to(device=x.device, dtype=x.dtype).view(n, 1, 1, 1)
        mu = x.mean(dim=(2, 3), keepdim=True).detach()
        sig = (x.var(dim=(2, 3), keepdim=True) + self.eps).sqrt().detach()
        x_normed = (x - mu) / sig
        mu_mix = lam * mu + (1 - lam) * mu[perm]
        sig_mix = lam * sig + (1 - lam) * sig[perm]
        return x_normed * sig_mix + mu_mix


def set_mixstyle_domains(model: nn.Module, domains: torch.Tensor | None) -> int:
    """Call :meth:`MixStyle.set_domains` on every MixStyle module of ``model``.

    Returns:
        The number of MixStyle modules found.
    """
    count = 0
    for m in model.modules():
        if isinstance(m, MixStyle):
            m.set_domains(domains)
            count += 1
    return count


@contextmanager
def mixstyle_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Make every MixStyle module of ``model`` the identity inside the ``with`` block.

    The modules draw no random numbers while disabled, whatever their ``p`` and the training
    mode; their previous state is restored on exit, also when the block raises. Blocks nest.

    Args:
        model: Any module (a MixStyle module itself included).

    Yields:
        ``model``.
    """
    modules = [m for m in model.modules() if isinstance(m, MixStyle)]
    previous = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield model
    finally:
        for m, state in zip(modules, previous):
            m.disabled = state


def has_mixstyle(model: nn.Module) -> bool:
    """Whether ``model`` contains at least one MixStyle module with ``p > 0``."""
    return any(isinstance(m, MixStyle) and m.p > 0 for m in model.modules())


def make_mixstyle(spec: MixStyle | bool | dict | None) -> nn.Module:
    """Build the module for a model's ``mixstyle`` argument.

    Args:
        spec: ``None``/``False`` (identity), ``True`` (``MixStyle()`` with p=0.5, alpha=0.1),
            a dict of :class:`MixStyle` keyword arguments, or a ready module.

    Returns:
        A :class:`MixStyle` or :class:`torch.nn.Identity`.
    """
    if spec is None or spec is False:
        return nn.Identity()
    if spec is True:
        return MixStyle()
    if isinstance(spec, dict):
        return MixStyle(**spec)
    if isinstance(spec, nn.Module):
        return spec
    raise TypeError(f"mixstyle must be None, bool, dict or MixStyle, got {type(spec).__name__}")
