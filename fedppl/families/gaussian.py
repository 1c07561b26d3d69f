"""Gaussians in natural parameters: the algebra PVI is made of.

A Gaussian N(mu, Sigma) is stored as ``nat1 = Lambda @ mu`` and ``prec = Lambda = Sigma^-1``
(the canonical natural parameters are ``(Lambda mu, -Lambda / 2)``; we keep the precision itself,
which is linear in them, so products, quotients and damping stay plain additions).

Two families share one interface:

* :class:`DiagGaussian`: ``prec`` has the shape of ``nat1`` (independent coordinates);
* :class:`FullGaussian`: ``prec`` is a ``(D, D)`` matrix.

Both may carry leading batch axes (PVI stacks the client factors on axis 0) and both are pytrees,
so they pass through ``jit``, ``vmap`` and ``lax.scan`` unchanged. A *factor* (a PVI ``t_k``) need
not be normalisable: its precision may be indefinite. Only distributions (q, the cavity, the prior)
must be positive definite; :func:`is_pd` checks this and :func:`repair` restores it.

Example::

    >>> import jax.numpy as jnp
    >>> from fedppl.families import gaussian as g
    >>> prior = g.FullGaussian.from_moments(jnp.zeros(2), jnp.eye(2))
    >>> lik = g.FullGaussian(jnp.array([1.0, 0.0]), jnp.eye(2))
    >>> mean, cov = g.to_moments(g.product(prior, lik))   # mean [0.5, 0], cov I/2
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpyro.distributions as dist
from jax import Array

__all__ = [
    "DiagGaussian",
    "FullGaussian",
    "Gaussian",
    "product",
    "quotient",
    "damp",
    "scale",
    "zeros_like",
    "strong",
    "to_moments",
    "mean_and_scale_tril",
    "kl",
    "kl_from_moments",
    "log_prob",
    "sample",
    "is_pd",
    "repair",
    "jitter_floor",
    "jittered_cholesky",
    "is_finite",
    "to_distribution",
    "project_diag",
    "to_full",
    "num_bytes",
    "Conditional",
    "embed",
    "head",
    "join",
    "split",
    "project_moments",
    "conditional_entropy",
]


class DiagGaussian(NamedTuple):
    """Diagonal Gaussian (or factor): ``nat1 = prec * mean``, ``prec`` elementwise precision."""

    nat1: Array
    prec: Array

    @classmethod
    def from_moments(cls, mean: Array, var: Array) -> DiagGaussian:
        mean, var = jnp.broadcast_arrays(jnp.asarray(mean), jnp.asarray(var))
        return cls(mean / var, 1.0 / var)

    @property
    def dim(self) -> int:
        return self.nat1.shape[-1]


class FullGaussian(NamedTuple):
    """Full-rank Gaussian (or factor): ``nat1 = prec @ mean``, ``prec`` a ``(D, D)`` precision."""

    nat1: Array
    prec: Array

    @classmethod
    def from_moments(cls, mean: Array, cov: Array) -> FullGaussian:
        mean = jnp.asarray(mean)
        chol = jnp.linalg.cholesky(_sym(jnp.asarray(cov)))
        eye = jnp.broadcast_to(jnp.eye(mean.shape[-1], dtype=chol.dtype), chol.shape)
        prec = jsl.cho_solve((chol, True), eye)
        return cls(_matvec(prec, mean), _sym(prec))

    @property
    def dim(self) -> int:
        return self.nat1.shape[-1]


#: Either Gaussian in natural parameters (the type of a guide family, factor or ``q``).
Gaussian = DiagGaussian | FullGaussian


# -- algebra: products, quotients and damping are linear in the natural parameters -----------------


def product(*gs: Gaussian) -> Gaussian:
    """Product of Gaussian factors (sum of natural parameters)."""
    out = gs[0]
    for g in gs[1:]:
        _same_family(out, g)
        out = jax.tree_util.tree_map(jnp.add, out, g)
    return out


def quotient(a: Gaussian, b: Gaussian) -> Gaussian:
    """``a / b`` (difference of natural parameters): the cavity is ``quotient(q, t_k)``."""
    _same_family(a, b)
    return jax.tree_util.tree_map(jnp.subtract, a, b)


def scale(g: Gaussian, power: Array | float) -> Gaussian:
    """``g ** power``: natural parameters times ``power`` (a power of a factor)."""
    return jax.tree_util.tree_map(lambda x: power * x, g)


def damp(old: Gaussian, new: Gaussian, rho: Array | float) -> Gaussian:
    """Damped update ``old ** (1 - rho) * new ** rho``; ``rho = 1`` takes ``new`` as it is."""
    _same_family(old, new)
    return jax.tree_util.tree_map(lambda o, n: (1.0 - rho) * o + rho * n, old, new)


def zeros_like(g: Gaussian) -> Gaussian:
    """The flat (uniform) factor of the same family, shape and (strong) dtype."""
    return jax.tree_util.tree_map(lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)), g)


def strong(g: Gaussian) -> Gaussian:
    """The same Gaussian with JAX's weak types removed, so that jitted rounds see one input type
    from the first round on (priors built from Python floats are weakly typed)."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=jnp.result_type(x)), g)


# -- conversions ---------------------------------------------------------------------------------


def to_moments(g: Gaussian) -> tuple[Array, Array]:
    """Mean and covariance (a variance vector for :class:`DiagGaussian`).

    Uses a Cholesky factorisation of the precision; a precision that is not positive definite
    yields NaN, so check :func:`is_pd` (or :func:`repair`) first where that can happen.
    """
    if isinstance(g, DiagGaussian):
        return g.nat1 / g.prec, 1.0 / g.prec
    chol = jnp.linalg.cholesky(_sym(g.prec))
    mean = jsl.cho_solve((chol, True), g.nat1[..., None])[..., 0]
    eye = jnp.broadcast_to(jnp.eye(g.dim, dtype=chol.dtype), chol.shape)
    return mean, _sym(jsl.cho_solve((chol, True), eye))


def mean_and_scale_tril(g: Gaussian) -> tuple[Array, Array]:
    """Mean and the lower Cholesky factor of the covariance (a std vector for diagonal)."""
    mean, cov = to_moments(g)
    if isinstance(g, DiagGaussian):
        return mean, jnp.sqrt(cov)
    return mean, jnp.linalg.cholesky(cov)


def to_full(g: Gaussian) -> FullGaussian:
    """The same Gaussian as a :class:`FullGaussian` (a diagonal precision made a matrix)."""
    if isinstance(g, FullGaussian):
        return g
    return FullGaussian(g.nat1, g.prec[..., :, None] * jnp.eye(g.dim, dtype=g.prec.dtype))


def project_diag(g: FullGaussian) -> DiagGaussian:
    """Mean-field projection used by the conjugate update: keep the mean and the diagonal of the
    precision (the optimum of KL(q || g) over diagonal q for Gaussian g)."""
    mean, _ = to_moments(g)
    prec = jnp.diagonal(g.prec, axis1=-2, axis2=-1)
    return DiagGaussian(prec * mean, prec)


def to_distribution(g: Gaussian) -> dist.Distribution:
    """A NumPyro distribution over the (flat) vector: ``Normal(...).to_event(1)`` or MVN."""
    mean, sc = mean_and_scale_tril(g)
    if isinstance(g, DiagGaussian):
        return dist.Normal(mean, sc).to_event(1)
    return dist.MultivariateNormal(mean, scale_tril=sc)


# -- densities, divergences, samples ---------------------------------------------------------------


def kl(q: Gaussian, p: Gaussian) -> Array:
    """KL(q || p) for two normalisable Gaussians of the same family (NaN if ``p`` is not).

    Computed from the differences of the natural parameters, ``sum_i (mu_i - log1p(mu_i)) / 2``
    over the eigenvalues ``mu`` of ``L^-1 (Lambda_p - Lambda_q) L^-T`` (``L L' = Lambda_q``) plus
    the Mahalanobis term of the mean difference ``Lambda_p^-1 (Delta Lambda m_q - Delta eta)``.
    The textbook form ``tr - d + log det`` subtracts numbers of size ``d``, so in float32 it
    leaves an error of ``d * eps`` (~1e-6, either sign) however close ``q`` and ``p`` are; this
    form is exactly 0 for ``q == p`` and otherwise keeps a relative error of a few ``eps`` times
    the condition number of ``Lambda_q`` (what a convergence test on ``KL(q_new || q_old)``
    needs, and what keeps the ``kl_change`` of a float32 run non-negative).
    """
    _same_family(q, p)
    q, p = _broadcast(q, p)
    d_prec = p.prec - q.prec
    d_nat1 = p.nat1 - q.nat1
    if isinstance(q, DiagGaussian):
        mq = q.nat1 / q.prec
        resid = d_prec * mq - d_nat1  # = Lambda_p (m_q - m_p)
        return 0.5 * jnp.sum(_excess(d_prec / q.prec) + resid**2 / p.prec, axis=-1)
    chol_q = jnp.linalg.cholesky(_sym(q.prec))
    chol_p = jnp.linalg.cholesky(_sym(p.prec))
    mq = jsl.cho_solve((chol_q, True), q.nat1[..., None])[..., 0]
    resid = _matvec(d_prec, mq) - d_nat1
    white = jsl.solve_triangular(chol_p, resid[..., None], lower=True)[..., 0]
    half = jsl.solve_triangular(chol_q, _sym(d_prec), lower=True)  # L^-1 Delta
    rel = jsl.solve_triangular(chol_q, jnp.swapaxes(half, -1, -2), lower=True)  # L^-1 Delta L^-T
    mu = jnp.linalg.eigvalsh(_sym(rel))
    return 0.5 * (jnp.sum(_excess(mu), axis=-1) + jnp.sum(white**2, axis=-1))


def kl_from_moments(mean: Array, scale: Array, p: Gaussian, p_mean: Array) -> Array:
    """KL(N(mean, scale scale^T) || p) for a q given by its mean and scale (a std vector when
    ``p`` is diagonal, else a lower-triangular factor), with ``p_mean`` the mean of ``p``.

    Needs no solve with q's scale, so it is cheap to differentiate with respect to it."""
    diff = mean - p_mean
    if isinstance(p, DiagGaussian):
        var = scale**2
        return 0.5 * jnp.sum(p.prec * var + p.prec * diff**2 - 1.0 - jnp.log(p.prec * var), axis=-1)
    trace = jnp.sum((p.prec @ scale) * scale, axis=(-2, -1))
    maha = jnp.einsum("...i,...ij,...j->...", diff, p.prec, diff)
    logdet_q = 2.0 * jnp.sum(jnp.log(jnp.abs(jnp.diagonal(scale, axis1=-2, axis2=-1))), axis=-1)
    return 0.5 * (trace + maha - p.dim - logdet_q - _logdet_pd(p.prec))


def log_prob(g: Gaussian, x: Array) -> Array:
    """Normalised log density at ``x`` (shape ``(..., D)``)."""
    mean, _ = to_moments(g)
    diff = x - mean
    if isinstance(g, DiagGaussian):
        return 0.5 * jnp.sum(jnp.log(g.prec / (2 * jnp.pi)) - g.prec * diff**2, axis=-1)
    maha = jnp.einsum("...i,...ij,...j->...", diff, g.prec, diff)
    return 0.5 * (_logdet_pd(g.prec) - g.dim * jnp.log(2 * jnp.pi) - maha)


def sample(key: Array, g: Gaussian, num_samples: int) -> Array:
    """``num_samples`` draws of shape ``(num_samples, D)`` (the Gaussian must be unbatched)."""
    mean, sc = mean_and_scale_tril(g)
    eps = jax.random.normal(key, (num_samples, g.dim), dtype=mean.dtype)
    if isinstance(g, DiagGaussian):
        return mean + eps * sc
    return mean + eps @ sc.T


# -- checks and repair -----------------------------------------------------------------------------


def is_pd(g: Gaussian) -> Array:
    """Whether the precision is (numerically) positive definite; batched over leading axes."""
    if isinstance(g, DiagGaussian):
        return jnp.all(g.prec > 0, axis=-1)
    chol = jnp.linalg.cholesky(_sym(g.prec))
    return jnp.all(jnp.isfinite(chol), axis=(-2, -1))


def is_finite(g: Gaussian) -> Array:
    """Whether every natural parameter is finite; batched over leading axes."""
    if isinstance(g, DiagGaussian):
        return jnp.all(jnp.isfinite(g.nat1) & jnp.isfinite(g.prec), axis=-1)
    return jnp.all(jnp.isfinite(g.nat1), axis=-1) & jnp.all(jnp.isfinite(g.prec), axis=(-2, -1))


def repair(g: Gaussian, min_prec: float = 1e-6) -> tuple[Gaussian, Array]:
    """Clip the precision's eigenvalues at a floor, keeping the mean where it is defined.

    The floor is ``min_prec`` for a diagonal precision. For a full one it is also at least
    ``10 * D * eps`` times the largest eigenvalue (``eps`` of the precision's dtype): eigenvalues
    below that are rounding noise of the eigendecomposition (and of the quotient that made the
    precision), and a matrix with them does not survive a Cholesky factorisation in that dtype.
    In float64 this relative floor is ``2e-15 D`` of the scale and ``min_prec`` decides; in
    float32 it is ``1.2e-6 D`` of it (for D = 10, a condition number of about 1e5).

    Returns the repaired Gaussian and a flag telling whether anything was changed; callers warn.
    The mean is preserved by recomputing ``nat1`` from the least-squares mean of the old precision.
    """
    if isinstance(g, DiagGaussian):
        bad = g.prec < min_prec
        mean = jnp.where(bad, 0.0, g.nat1 / jnp.where(bad, 1.0, g.prec))
        prec = jnp.where(bad, min_prec, g.prec)
        return DiagGaussian(jnp.where(bad, prec * mean, g.nat1), prec), jnp.any(bad, axis=-1)
    evals, evecs = jnp.linalg.eigh(_sym(g.prec))
    floor = jnp.maximum(min_prec, _rel_floor(evals, g.dim))
    bad = evals < floor
    safe = jnp.where(bad, 1.0, evals)
    # mean restricted to the well-defined eigen-directions, zero elsewhere
    coords = jnp.einsum("...ji,...j->...i", evecs, g.nat1)
    mean_coords = jnp.where(bad, 0.0, coords / safe)
    new_evals = jnp.where(bad, floor, evals)
    prec = jnp.einsum("...ik,...k,...jk->...ij", evecs, new_evals, evecs)
    nat1 = jnp.einsum("...ik,...k->...i", evecs, new_evals * mean_coords)
    changed = jnp.any(bad, axis=-1)
    keep = changed[..., None]
    return (
        FullGaussian(jnp.where(keep, nat1, g.nat1), jnp.where(keep[..., None], _sym(prec), g.prec)),
        changed,
    )


def jitter_floor(a: Array) -> Array:
    """The least jitter with which a PSD matrix's Cholesky factor is reliable in its dtype:
    ``10 eps tr(a)`` (batched over leading axes).

    Cholesky perturbs ``a`` by up to ``D eps ||a||`` (and ``||a|| <= tr(a)``), so an
    eigenvalue of ``a`` below that may come out negative: NaN, or a factor whose solves are
    rounding. In float64 the floor is ``2e-15 tr(a)``, below any jitter in use, and changes
    nothing measurable; in float32 it is ``1.2e-6 tr(a)``, what lets a float32 run factor a
    kernel matrix with inducing points close together, or a posterior precision with a small
    noise (its effect on a result is of the order of what float32 resolves of it anyway)."""
    return 10 * jnp.finfo(a.dtype).eps * jnp.trace(a, axis1=-2, axis2=-1)


def jittered_cholesky(a: Array) -> Array:
    """Lower Cholesky factor of the PSD ``a + jitter_floor(a) I``: finite in float32 where
    rounding alone makes ``a`` indefinite (see :func:`jitter_floor`)."""
    shift = jitter_floor(a)[..., None, None]
    return jnp.linalg.cholesky(a + shift * jnp.eye(a.shape[-1], dtype=a.dtype))


def num_bytes(g: Gaussian) -> int:
    """Size in bytes of what it takes to send this factor (both natural parameters)."""
    if isinstance(g, FullGaussian):
        d = g.dim  # a symmetric precision needs only its lower triangle on the wire
        per = d + d * (d + 1) // 2
        lead = g.nat1.size // d
        return int(lead * per * g.nat1.dtype.itemsize)
    return int((g.nat1.size + g.prec.size) * g.nat1.dtype.itemsize)  # arrays or their shapes


# -- a client's joint over global and local coordinates ------------------------------------------
#
# A client with local latent variables z (random effects) keeps a Gaussian over (theta, z). Its
# private part is the conditional q(z | theta); the global part is the marginal q(theta), whose
# quotient by the cavity is the factor that client sends.


class Conditional(NamedTuple):
    """``q(z | theta) ~ exp(-z'Cz/2 - z'B theta + h'z)``: the rows of a joint precision that belong
    to the local coordinates (``prec`` = C, ``cross`` = B, ``nat1`` = h). The conditional mean is
    ``C^-1 (h - B theta)`` and its covariance ``C^-1``; ``cross = 0`` makes z independent of
    theta."""

    nat1: Array  # (..., d)
    prec: Array  # (..., d, d)
    cross: Array  # (..., d, D)


def embed(g: Gaussian, d: int) -> Gaussian:
    """``g`` over ``D`` coordinates as a factor over ``D + d``, flat in the last ``d`` (zero
    natural parameters there): the cavity of a client with ``d`` local coordinates."""
    pad = [(0, 0)] * (g.nat1.ndim - 1) + [(0, d)]
    if isinstance(g, DiagGaussian):
        return DiagGaussian(jnp.pad(g.nat1, pad), jnp.pad(g.prec, pad))
    return FullGaussian(jnp.pad(g.nat1, pad), jnp.pad(g.prec, [*pad[:-1], (0, d), (0, d)]))


def head(g: Gaussian, D: int) -> Gaussian:
    """The natural parameters' block over the first ``D`` coordinates: the factor a client's
    cavity was before :func:`embed` (not the marginal, unless the rest is independent)."""
    if isinstance(g, DiagGaussian):
        return DiagGaussian(g.nat1[..., :D], g.prec[..., :D])
    return FullGaussian(g.nat1[..., :D], g.prec[..., :D, :D])


def join(g: Gaussian, c: Conditional, diag: bool) -> Gaussian:
    """The joint ``q(theta) q(z | theta)`` over ``(theta, z)`` (a :class:`DiagGaussian` when
    ``diag``, which needs a diagonal ``g`` and an independent, diagonal ``c``)."""
    if diag:
        return DiagGaussian(jnp.concatenate([g.nat1, c.nat1], -1),
                            jnp.concatenate([g.prec, jnp.diagonal(c.prec, axis1=-2, axis2=-1)],
                                            -1))
    g = to_full(g)
    chol = jnp.linalg.cholesky(_sym(c.prec))
    cinv_b = jsl.cho_solve((chol, True), c.cross)
    cinv_h = jsl.cho_solve((chol, True), c.nat1[..., None])[..., 0]
    bt = jnp.swapaxes(c.cross, -1, -2)
    top = jnp.concatenate([g.prec + bt @ cinv_b, bt], -1)
    bottom = jnp.concatenate([c.cross, c.prec], -1)
    nat1 = jnp.concatenate([g.nat1 + _matvec(bt, cinv_h), c.nat1], -1)
    return FullGaussian(nat1, _sym(jnp.concatenate([top, bottom], -2)))


def split(g: Gaussian, num_global: int) -> tuple[Gaussian, Conditional]:
    """The marginal over the first ``num_global`` coordinates and the conditional of the rest
    (the inverse of :func:`join`). The marginal's natural parameters are the Schur complements
    ``Lambda_tt - B' C^-1 B`` and ``eta_t - B' C^-1 h``."""
    D = num_global
    if isinstance(g, DiagGaussian):
        d = g.dim - D
        prec_z = g.prec[..., D:]
        cond = Conditional(g.nat1[..., D:], prec_z[..., :, None] * jnp.eye(d, dtype=prec_z.dtype),
                           jnp.zeros((*g.prec.shape[:-1], d, D), g.prec.dtype))
        return DiagGaussian(g.nat1[..., :D], g.prec[..., :D]), cond
    cond = Conditional(g.nat1[..., D:], g.prec[..., D:, D:], g.prec[..., D:, :D])
    chol = jnp.linalg.cholesky(_sym(cond.prec))
    cinv_b = jsl.cho_solve((chol, True), cond.cross)
    cinv_h = jsl.cho_solve((chol, True), cond.nat1[..., None])[..., 0]
    bt = jnp.swapaxes(cond.cross, -1, -2)
    marginal = FullGaussian(g.nat1[..., :D] - _matvec(bt, cinv_h),
                            _sym(g.prec[..., :D, :D] - bt @ cinv_b))
    return marginal, cond


def project_moments(g: Gaussian, diag: bool) -> Gaussian:
    """``g`` itself, or (``diag``) the diagonal Gaussian with its mean and marginal variances
    (the KL(g || q)-optimal diagonal q: what a mean-field guide keeps of a client's joint)."""
    if not diag or isinstance(g, DiagGaussian):
        return g
    mean, cov = to_moments(g)
    return DiagGaussian.from_moments(mean, jnp.diagonal(cov, axis1=-2, axis2=-1))


def conditional_entropy(c: Conditional) -> Array:
    """Entropy of ``q(z | theta)`` (the same for every theta): ``(d log(2 pi e) - log|C|) / 2``."""
    d = c.nat1.shape[-1]
    return 0.5 * (d * jnp.log(2 * jnp.pi * jnp.e) - _logdet_pd(c.prec))


# -- helpers ---------------------------------------------------------------------------------------


def _sym(a: Array) -> Array:
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def _matvec(a: Array, x: Array) -> Array:
    return jnp.einsum("...ij,...j->...i", a, x)


def _excess(x: Array) -> Array:
    """``x - log1p(x)`` (>= 0) to a few ``eps`` relative, NaN where ``x <= -1`` (a ``p`` that is
    not positive definite).

    The direct difference loses ``eps / |x|`` relative accuracy near 0 (where it is ``x^2 / 2``):
    there it is ``x^2 / (2 + x) - 2 (atanh(u) - u)`` with ``u = x / (2 + x)``, the second term a
    series in ``u`` (exact to float64 for ``|x| < 0.1``)."""
    ok = x > -1
    x = jnp.where(ok, x, 0.0)
    u = x / (2 + x)
    u2 = u * u
    tail = u * u2 * (1 / 3 + u2 * (1 / 5 + u2 * (1 / 7 + u2 * (1 / 9 + u2 * (
        1 / 11 + u2 * (1 / 13 + u2 / 15))))))
    small = x * x / (2 + x) - 2 * tail
    value = jnp.where(jnp.abs(x) < 0.1, small, x - jnp.log1p(x))
    return jnp.where(ok, value, jnp.nan)


def _rel_floor(evals: Array, dim: int) -> Array:
    """``10 * D * eps`` times the largest absolute eigenvalue (batched), in their dtype."""
    eps = jnp.finfo(evals.dtype).eps
    return 10 * dim * eps * jnp.max(jnp.abs(evals), axis=-1, keepdims=True)


def _broadcast(a: Gaussian, b: Gaussian) -> tuple[Gaussian, Gaussian]:
    """Both Gaussians with their leading (batch) axes broadcast against each other."""
    lead = jnp.broadcast_shapes(a.nat1.shape[:-1], b.nat1.shape[:-1])
    if a.nat1.shape[:-1] == lead and b.nat1.shape[:-1] == lead:
        return a, b

    def expand(g):
        return type(g)(*(jnp.broadcast_to(x, lead + x.shape[g.nat1.ndim - 1:]) for x in g))

    return expand(a), expand(b)


def _logdet_pd(a: Array) -> Array:
    chol = jnp.linalg.cholesky(_sym(a))
    return 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)


def _same_family(a: Gaussian, b: Gaussian) -> None:
    if type(a) is not type(b):
        raise TypeError(f"cannot combine a {type(a).__name__} with a {type(b).__name__}")
