"""Gaussians in natural parameters, in torch: the algebra PVI is made of.

The torch twin of :mod:`fedppl.families.gaussian` (same names, same conventions): a Gaussian
``N(mu, Sigma)`` is stored as ``nat1 = Lambda @ mu`` and ``prec = Lambda``, so products, quotients
and damping are additions. :class:`DiagGaussian` keeps an elementwise precision,
:class:`FullGaussian` a ``(D, D)`` one; both may carry leading batch axes (PVI stacks the client
factors on axis 0) and work in whatever floating dtype their tensors have (float64 or float32).

A factor need not be normalisable. Where the NumPyro core's Cholesky returns NaN for a matrix that
is not positive definite, this one does too (``torch.linalg.cholesky_ex`` and a NaN fill), so a
check such as :func:`is_pd` never raises.

Example::

    >>> import torch
    >>> prior = FullGaussian.from_moments(torch.zeros(2, dtype=torch.float64),
    ...                                   torch.eye(2, dtype=torch.float64))
    >>> lik = FullGaussian(torch.tensor([1.0, 0.0], dtype=torch.float64),
    ...                    torch.eye(2, dtype=torch.float64))
    >>> mean, cov = to_moments(product(prior, lik))   # mean [0.5, 0], cov I/2
    >>> [round(v, 12) for v in mean.tolist() + torch.diagonal(cov).tolist()]
    [0.5, 0.0, 0.5, 0.5]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pyro.distributions as dist
import torch
from torch import Tensor

__all__ = [
    "DiagGaussian", "FullGaussian", "Gaussian", "product", "quotient", "damp", "scale",
    "zeros_like", "to_moments", "mean_and_scale_tril", "kl", "kl_from_moments", "log_prob",
    "sample", "is_pd", "repair", "symmetric", "is_finite", "to_distribution", "project_diag",
    "to_full", "num_bytes", "Conditional", "embed", "head", "join", "split", "project_moments",
    "conditional_entropy", "cholesky", "index", "stack", "where",
]


class DiagGaussian(NamedTuple):
    """Diagonal Gaussian (or factor): ``nat1 = prec * mean``, ``prec`` elementwise precision."""

    nat1: Tensor
    prec: Tensor

    @classmethod
    def from_moments(cls, mean: Tensor, var: Tensor) -> DiagGaussian:
        mean, var = torch.broadcast_tensors(torch.as_tensor(mean), torch.as_tensor(var))
        return cls(mean / var, 1.0 / var)

    @property
    def dim(self) -> int:
        return self.nat1.shape[-1]


class FullGaussian(NamedTuple):
    """Full-rank Gaussian (or factor): ``nat1 = prec @ mean``, ``prec`` a ``(D, D)`` precision."""

    nat1: Tensor
    prec: Tensor

    @classmethod
    def from_moments(cls, mean: Tensor, cov: Tensor) -> FullGaussian:
        mean, cov = torch.as_tensor(mean), torch.as_tensor(cov)
        chol = cholesky(cov)
        prec = torch.cholesky_solve(_eye_like(chol), chol)
        return cls(_matvec(prec, mean), _sym(prec))

    @property
    def dim(self) -> int:
        return self.nat1.shape[-1]


Gaussian = DiagGaussian | FullGaussian


# -- algebra ---------------------------------------------------------------------------------------


def product(*gs: Gaussian) -> Gaussian:
    """Product of Gaussian factors (sum of natural parameters)."""
    out = gs[0]
    for g in gs[1:]:
        _same_family(out, g)
        out = type(out)(out.nat1 + g.nat1, out.prec + g.prec)
    return out


def quotient(a: Gaussian, b: Gaussian) -> Gaussian:
    """``a / b`` (difference of natural parameters): the cavity is ``quotient(q, t_k)``."""
    _same_family(a, b)
    return type(a)(a.nat1 - b.nat1, a.prec - b.prec)


def scale(g: Gaussian, power: Tensor | float) -> Gaussian:
    """``g ** power``; a tensor ``power`` with leading axes scales a batch of them."""
    if isinstance(power, Tensor) and power.ndim:
        p1 = power.reshape(power.shape + (1,) * (g.nat1.ndim - power.ndim))
        p2 = power.reshape(power.shape + (1,) * (g.prec.ndim - power.ndim))
        return type(g)(p1 * g.nat1, p2 * g.prec)
    return type(g)(power * g.nat1, power * g.prec)


def damp(old: Gaussian, new: Gaussian, rho: Tensor | float) -> Gaussian:
    """Damped update ``old ** (1 - rho) * new ** rho``; ``rho = 1`` takes ``new`` as it is.
    A tensor ``rho`` with leading axes gives one damped Gaussian per entry."""
    _same_family(old, new)
    return product(scale(old, 1.0 - rho), scale(new, rho))


def symmetric(g: Gaussian) -> Gaussian:
    """``g`` with its precision made exactly symmetric (a diagonal one as it is).

    torch's reductions may add the entries ``(i, j)`` and ``(j, i)`` of a batch of symmetric
    matrices in different orders, so a sum over clients can come out asymmetric by an ulp. PVI's
    synchronous update multiplies that asymmetric part by ``1 - K rho`` every round (the local
    solvers see only the symmetric part, the cavity subtracts the whole), so the server and the
    clients keep their precisions symmetric with this."""
    if isinstance(g, DiagGaussian):
        return g
    return FullGaussian(g.nat1, _sym(g.prec))


def zeros_like(g: Gaussian) -> Gaussian:
    """The flat (uniform) factor of the same family, shape and dtype."""
    return type(g)(torch.zeros_like(g.nat1), torch.zeros_like(g.prec))


# -- conversions -----------------------------------------------------------------------------------


def to_moments(g: Gaussian) -> tuple[Tensor, Tensor]:
    """Mean and covariance (a variance vector for :class:`DiagGaussian`); NaN where the precision
    is not positive definite."""
    if isinstance(g, DiagGaussian):
        return g.nat1 / g.prec, 1.0 / g.prec
    chol = cholesky(g.prec)
    mean = torch.cholesky_solve(g.nat1.unsqueeze(-1), chol).squeeze(-1)
    return mean, _sym(torch.cholesky_solve(_eye_like(chol), chol))


def mean_and_scale_tril(g: Gaussian) -> tuple[Tensor, Tensor]:
    """Mean and the lower Cholesky factor of the covariance (a std vector for diagonal)."""
    mean, cov = to_moments(g)
    if isinstance(g, DiagGaussian):
        return mean, cov.sqrt()
    return mean, cholesky(cov)


def to_full(g: Gaussian) -> FullGaussian:
    """The same Gaussian as a :class:`FullGaussian`."""
    if isinstance(g, FullGaussian):
        return g
    return FullGaussian(g.nat1, torch.diag_embed(g.prec))


def project_diag(g: FullGaussian) -> DiagGaussian:
    """Keep the mean and the diagonal of the precision (the mean-field optimum of KL(q || g))."""
    mean, _ = to_moments(g)
    prec = torch.diagonal(g.prec, dim1=-2, dim2=-1)
    return DiagGaussian(prec * mean, prec)


def to_distribution(g: Gaussian) -> dist.Distribution:
    """A Pyro distribution over the flat vector: ``Normal(...).to_event(1)`` or MVN."""
    mean, sc = mean_and_scale_tril(g)
    if isinstance(g, DiagGaussian):
        return dist.Normal(mean, sc).to_event(1)
    return dist.MultivariateNormal(mean, scale_tril=sc)


# -- densities, divergences, samples -------------------------------------------------------------


def kl(q: Gaussian, p: Gaussian) -> Tensor:
    """KL(q || p) for two normalisable Gaussians of the same family (NaN if ``p`` is not), from the
    differences of the natural parameters (exactly 0 for ``q == p``; see the NumPyro core's
    :func:`fedppl.families.gaussian.kl` for the derivation)."""
    _same_family(q, p)
    q, p = _broadcast(q, p)
    d_prec, d_nat1 = p.prec - q.prec, p.nat1 - q.nat1
    if isinstance(q, DiagGaussian):
        resid = d_prec * (q.nat1 / q.prec) - d_nat1
        return 0.5 * torch.sum(_excess(d_prec / q.prec) + resid**2 / p.prec, dim=-1)
    chol_q, chol_p = cholesky(q.prec), cholesky(p.prec)
    mq = torch.cholesky_solve(q.nat1.unsqueeze(-1), chol_q).squeeze(-1)
    resid = _matvec(d_prec, mq) - d_nat1
    white = torch.linalg.solve_triangular(chol_p, resid.unsqueeze(-1), upper=False).squeeze(-1)
    half = torch.linalg.solve_triangular(chol_q, _sym(d_prec), upper=False)
    rel = torch.linalg.solve_triangular(chol_q, half.transpose(-1, -2), upper=False)
    mu = _eigvalsh(_sym(rel))
    return 0.5 * (torch.sum(_excess(mu), dim=-1) + torch.sum(white**2, dim=-1))


def kl_from_moments(mean: Tensor, scale: Tensor, p: Gaussian, p_mean: Tensor) -> Tensor:
    """KL(N(mean, scale scale^T) || p) for a q given by its mean and scale (a std vector when
    ``p`` is diagonal, else a lower-triangular factor); cheap to differentiate in the scale."""
    diff = mean - p_mean
    if isinstance(p, DiagGaussian):
        var = scale**2
        return 0.5 * torch.sum(p.prec * var + p.prec * diff**2 - 1.0 - torch.log(p.prec * var),
                               dim=-1)
    trace = torch.sum((p.prec @ scale) * scale, dim=(-2, -1))
    maha = (_matvec(p.prec, diff) * diff).sum(-1)
    logdet_q = 2.0 * torch.sum(torch.log(torch.abs(torch.diagonal(scale, dim1=-2, dim2=-1))),
                               dim=-1)
    return 0.5 * (trace + maha - p.dim - logdet_q - _logdet_pd(p.prec))


def log_prob(g: Gaussian, x: Tensor) -> Tensor:
    """Normalised log density at ``x`` (shape ``(..., D)``)."""
    mean, _ = to_moments(g)
    diff = x - mean
    if isinstance(g, DiagGaussian):
        return 0.5 * torch.sum(torch.log(g.prec / (2 * math.pi)) - g.prec * diff**2, dim=-1)
    maha = (_matvec(g.prec, diff) * diff).sum(-1)
    return 0.5 * (_logdet_pd(g.prec) - g.dim * math.log(2 * math.pi) - maha)


def sample(generator: torch.Generator | None, g: Gaussian, num_samples: int) -> Tensor:
    """``num_samples`` draws, shape ``(..., num_samples, D)`` for a batch of Gaussians."""
    mean, sc = mean_and_scale_tril(g)
    shape = (*mean.shape[:-1], num_samples, g.dim)
    eps = torch.randn(shape, generator=generator, dtype=mean.dtype, device=mean.device)
    if isinstance(g, DiagGaussian):
        return mean.unsqueeze(-2) + eps * sc.unsqueeze(-2)
    return mean.unsqueeze(-2) + eps @ sc.transpose(-1, -2)


# -- checks and repair -----------------------------------------------------------------------------


def is_pd(g: Gaussian) -> Tensor:
    """Whether the precision is (numerically) positive definite; batched over leading axes."""
    if isinstance(g, DiagGaussian):
        return torch.all(g.prec > 0, dim=-1)
    return torch.all(torch.isfinite(cholesky(g.prec)), dim=-1).all(dim=-1)


def is_finite(g: Gaussian) -> Tensor:
    """Whether every natural parameter is finite; batched over leading axes."""
    ok = torch.isfinite(g.nat1).all(dim=-1)
    prec = torch.isfinite(g.prec)
    return ok & (prec.all(dim=-1) if isinstance(g, DiagGaussian) else prec.all(-1).all(-1))


def repair(g: Gaussian, min_prec: float = 1e-6) -> tuple[Gaussian, Tensor]:
    """Clip the precision's eigenvalues at a floor (``min_prec``, and for a full precision at least
    ``10 D eps`` of its largest eigenvalue), keeping the mean where it is defined; returns the
    repaired Gaussian and whether anything changed (batched)."""
    if isinstance(g, DiagGaussian):
        bad = g.prec < min_prec
        mean = torch.where(bad, 0.0, g.nat1 / torch.where(bad, 1.0, g.prec))
        prec = torch.where(bad, torch.full_like(g.prec, min_prec), g.prec)
        return DiagGaussian(torch.where(bad, prec * mean, g.nat1), prec), bad.any(dim=-1)
    safe_in = torch.where(torch.isfinite(g.prec), g.prec, 0.0)
    evals, evecs = torch.linalg.eigh(_sym(safe_in))
    eps = torch.finfo(evals.dtype).eps
    floor = torch.clamp(10 * g.dim * eps * evals.abs().amax(dim=-1, keepdim=True), min=min_prec)
    bad = evals < floor
    safe = torch.where(bad, 1.0, evals)
    coords = torch.einsum("...ji,...j->...i", evecs, g.nat1)
    mean_coords = torch.where(bad, 0.0, coords / safe)
    new_evals = torch.where(bad, floor.expand_as(evals), evals)
    prec = (evecs * new_evals.unsqueeze(-2)) @ evecs.transpose(-1, -2)
    nat1 = torch.einsum("...ik,...k->...i", evecs, new_evals * mean_coords)
    changed = bad.any(dim=-1)
    keep = changed.unsqueeze(-1)
    return (FullGaussian(torch.where(keep, nat1, g.nat1),
                         torch.where(keep.unsqueeze(-1), _sym(prec), g.prec)), changed)


def num_bytes(g: Gaussian) -> int:
    """Bytes it takes to send this factor (a symmetric precision: its lower triangle only)."""
    item = g.nat1.element_size()
    if isinstance(g, FullGaussian):
        d = g.dim
        return int(g.nat1.numel() // d * (d + d * (d + 1) // 2) * item)
    return int((g.nat1.numel() + g.prec.numel()) * item)


# -- batches ---------------------------------------------------------------------------------------


def index(g, idx):
    """The Gaussian (or :class:`Conditional`) at ``idx`` of the leading axis."""
    return type(g)(*(x[idx] for x in g))


def stack(gs: list, dim: int = 0):
    """Gaussians (or :class:`Conditional` s) of one family stacked on a new leading axis."""
    return type(gs[0])(*(torch.stack(xs, dim) for xs in zip(*gs, strict=True)))


def where(cond: Tensor, a, b):
    """``a`` where ``cond`` (one boolean per leading batch entry), else ``b``."""
    def pick(x, y):
        return torch.where(cond.reshape(cond.shape + (1,) * (x.ndim - cond.ndim)), x, y)

    return type(a)(*(pick(x, y) for x, y in zip(a, b, strict=True)))


# -- a client's joint over global and local coordinates -----------------------------------------


class Conditional(NamedTuple):
    """``q(z | theta) ~ exp(-z'Cz/2 - z'B theta + h'z)`` (``prec`` C, ``cross`` B, ``nat1`` h)."""

    nat1: Tensor  # (..., d)
    prec: Tensor  # (..., d, d)
    cross: Tensor  # (..., d, D)


def embed(g: Gaussian, d: int) -> Gaussian:
    """``g`` as a factor over ``D + d`` coordinates, flat in the last ``d``."""
    nat1 = torch.nn.functional.pad(g.nat1, (0, d))
    if isinstance(g, DiagGaussian):
        return DiagGaussian(nat1, torch.nn.functional.pad(g.prec, (0, d)))
    return FullGaussian(nat1, torch.nn.functional.pad(g.prec, (0, d, 0, d)))


def head(g: Gaussian, D: int) -> Gaussian:
    """The natural parameters' block over the first ``D`` coordinates."""
    if isinstance(g, DiagGaussian):
        return DiagGaussian(g.nat1[..., :D], g.prec[..., :D])
    return FullGaussian(g.nat1[..., :D], g.prec[..., :D, :D])


def join(g: Gaussian, c: Conditional, diag: bool) -> Gaussian:
    """The joint ``q(theta) q(z | theta)`` over ``(theta, z)``."""
    if diag:
        return DiagGaussian(torch.cat([g.nat1, c.nat1], -1),
                            torch.cat([g.prec, torch.diagonal(c.prec, dim1=-2, dim2=-1)], -1))
    g = to_full(g)
    chol = cholesky(c.prec)
    cinv_b = torch.cholesky_solve(c.cross, chol)
    cinv_h = torch.cholesky_solve(c.nat1.unsqueeze(-1), chol).squeeze(-1)
    bt = c.cross.transpose(-1, -2)
    top = torch.cat([g.prec + bt @ cinv_b, bt], -1)
    bottom = torch.cat([c.cross, c.prec], -1)
    nat1 = torch.cat([g.nat1 + _matvec(bt, cinv_h), c.nat1], -1)
    return FullGaussian(nat1, _sym(torch.cat([top, bottom], -2)))


def split(g: Gaussian, num_global: int) -> tuple[Gaussian, Conditional]:
    """The marginal over the first ``num_global`` coordinates and the conditional of the rest."""
    D = num_global
    if isinstance(g, DiagGaussian):
        d = g.dim - D
        prec_z = g.prec[..., D:]
        cond = Conditional(g.nat1[..., D:], torch.diag_embed(prec_z),
                           torch.zeros((*g.prec.shape[:-1], d, D), dtype=g.prec.dtype))
        return DiagGaussian(g.nat1[..., :D], g.prec[..., :D]), cond
    cond = Conditional(g.nat1[..., D:], g.prec[..., D:, D:], g.prec[..., D:, :D])
    chol = cholesky(cond.prec)
    cinv_b = torch.cholesky_solve(cond.cross, chol)
    cinv_h = torch.cholesky_solve(cond.nat1.unsqueeze(-1), chol).squeeze(-1)
    bt = cond.cross.transpose(-1, -2)
    marginal = FullGaussian(g.nat1[..., :D] - _matvec(bt, cinv_h),
                            _sym(g.prec[..., :D, :D] - bt @ cinv_b))
    return marginal, cond


def project_moments(g: Gaussian, diag: bool) -> Gaussian:
    """``g`` itself, or (``diag``) the diagonal Gaussian with its mean and marginal variances."""
    if not diag or isinstance(g, DiagGaussian):
        return g
    mean, cov = to_moments(g)
    return DiagGaussian.from_moments(mean, torch.diagonal(cov, dim1=-2, dim2=-1))


def conditional_entropy(c: Conditional) -> Tensor:
    """Entropy of ``q(z | theta)``: ``(d log(2 pi e) - log|C|) / 2``."""
    d = c.nat1.shape[-1]
    return 0.5 * (d * math.log(2 * math.pi * math.e) - _logdet_pd(c.prec))


# -- helpers ---------------------------------------------------------------------------------------


def cholesky(a: Tensor) -> Tensor:
    """Lower Cholesky factor of the symmetrised ``a``; NaN (not an error) where ``a`` is not
    positive definite or not finite, as JAX's."""
    a = _sym(a)
    finite = torch.isfinite(a).all(dim=-1).all(dim=-1)
    chol, info = torch.linalg.cholesky_ex(torch.where(finite[..., None, None], a,
                                                      _eye_like(a)))
    bad = (info != 0) | ~finite
    return torch.where(bad[..., None, None], torch.full_like(chol, math.nan), chol)


def _eigvalsh(a: Tensor) -> Tensor:
    finite = torch.isfinite(a).all(dim=-1).all(dim=-1)
    vals = torch.linalg.eigvalsh(torch.where(finite[..., None, None], a, _eye_like(a)))
    return torch.where(finite[..., None], vals, math.nan)


def _eye_like(a: Tensor) -> Tensor:
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand(a.shape)


def _sym(a: Tensor) -> Tensor:
    return 0.5 * (a + a.transpose(-1, -2))


def _matvec(a: Tensor, x: Tensor) -> Tensor:
    return torch.einsum("...ij,...j->...i", a, x)


def _excess(x: Tensor) -> Tensor:
    """``x - log1p(x)`` to a few eps relative (a series near 0), NaN where ``x <= -1``."""
    ok = x > -1
    x = torch.where(ok, x, 0.0)
    u = x / (2 + x)
    u2 = u * u
    tail = u * u2 * (1 / 3 + u2 * (1 / 5 + u2 * (1 / 7 + u2 * (1 / 9 + u2 * (
        1 / 11 + u2 * (1 / 13 + u2 / 15))))))
    small = x * x / (2 + x) - 2 * tail
    value = torch.where(x.abs() < 0.1, small, x - torch.log1p(x))
    return torch.where(ok, value, math.nan)


def _broadcast(a: Gaussian, b: Gaussian) -> tuple[Gaussian, Gaussian]:
    lead = torch.Size(np.broadcast_shapes(tuple(a.nat1.shape[:-1]), tuple(b.nat1.shape[:-1])))
    if a.nat1.shape[:-1] == lead and b.nat1.shape[:-1] == lead:
        return a, b

    def expand(g: Gaussian) -> Gaussian:
        n = g.nat1.ndim - 1
        return type(g)(*(x.expand(lead + x.shape[n:]) for x in g))

    return expand(a), expand(b)


def _logdet_pd(a: Tensor) -> Tensor:
    chol = cholesky(a)
    return 2.0 * torch.sum(torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)), dim=-1)


def _same_family(a: Gaussian, b: Gaussian) -> None:
    if type(a) is not type(b):
        raise TypeError(f"cannot combine a {type(a).__name__} with a {type(b).__name__}")
