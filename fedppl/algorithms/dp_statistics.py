"""Differentially private sufficient statistics for the exact-aggregation methods.

FedBNR's last layer (:mod:`fedppl.algorithms.fedbnr`) and FSGP's aggregation round
(:mod:`fedppl.algorithms.fsgp`) both let each client send the sums ``S = Phi^T Phi``,
``b = Phi^T y`` and its count ``n`` (:class:`fedppl.algorithms.exact.Stats`), where a row
``phi_n`` of ``Phi`` is a record's feature vector (random features for FedBNR, the whitened
``L^-1 k(Z, x_n)`` for FSGP). This module makes that message private with the Gaussian
mechanism, in one place:

* **Bounded contributions.** Before summing, every feature row is clipped to L2 norm
  ``B_x = feature_bound`` and every target to ``[-B_y, B_y]`` (``B_y = target_bound``). One
  record then adds ``(phi phi^T, phi y, 1)``, and the released entries are the upper triangle
  (diagonal included) of ``S``, all of ``b`` and ``n``. Adding or removing one record moves
  that vector by at most (L2)

      Delta = sqrt(B_x^4 + B_x^2 B_y^2 + 1),

  since the upper triangle of ``phi phi^T`` has squared norm
  ``(||phi||^4 + sum_i phi_i^4) / 2 <= ||phi||^4 <= B_x^4`` (equal when ``phi`` lies along
  an axis), ``||phi y|| <= B_x B_y`` and the count moves by 1. ``Delta`` is attained by
  ``phi = B_x e_1, y = B_y``. ``y^T y`` is not released: neither method uses it.
* **Noise.** The client adds ``N(0, (sigma Delta)^2)`` to each released entry (the upper
  triangle of ``S``, mirrored, so that ``S`` stays symmetric), with its own key, before the
  message leaves it: the server never sees clean sums.
* **Accounting.** A client that releases ``r`` times (FedBNR: once per evaluation and per
  kernel evaluated; FSGP: once) composes ``r`` Gaussian mechanisms of noise multiplier
  ``sigma``; :class:`PrivateStatistics` gives ``sigma`` (or calibrates it from a target
  ``(epsilon, delta)`` with :func:`fedppl.accounting.calibrate`) and the ``epsilon`` spent
  (:func:`fedppl.accounting.epsilon`).
* **Repair.** A noisy sum of scatter matrices need not be positive semi-definite; the server
  projects it onto the PSD cone (:func:`repair_scatter`: eigenvalues below zero raised to
  zero), so that FedBNR's ``A = S / s^2 + I / lambda^2`` is at least its prior precision and
  FSGP's ``C_MM + S / s^2`` at least ``C_MM``; the true ``S`` lies in that convex set, so the
  projection never moves the sum further from it (in Frobenius norm). The methods record how
  often they repaired.
* **Noise-aware prediction.** Both methods predict with ``f(x*) = phi*^T m``, where
  ``m = A^-1 b / s^2`` and ``A = P + S / s^2`` (``P``: the prior precision ``I / lambda^2``,
  or ``C_MM`` for FSGP, where ``phi* = k(Z, x*)``). With noisy sums ``S + E`` and ``b + e``
  (``E`` symmetric, its upper triangle and ``e`` i.i.d. ``N(0, tau^2)``, ``tau^2`` the noise
  variance summed over the clients whose statistics entered), to first order

      m~ - m = A^-1 (e - E m) / s^2,
      Cov(E m) = tau^2 (||m||^2 I + m m^T - diag(m * m)),
      Cov_noise(m) = tau^2 / s^4 A^-1 ((1 + ||m||^2) I + m m^T - diag(m * m)) A^-1,

  (``(E m)_i = sum_j E_ij m_j``; ``E_ij`` and ``E_kl`` are the same draw only when
  ``{i, j} = {k, l}``). :func:`mean_noise_variance` evaluates ``phi*^T Cov_noise(m) phi*`` at
  the (repaired) noisy ``A`` and ``m`` and the predictive variance adds it. Clipping's bias
  and the noise in ``A^-1`` itself (second order) are not corrected.
* **Noise-aware posterior.** That plug-in ``m`` divides the noise in ``b`` by ``s^2`` along
  every direction the repaired ``S`` has lost to the noise, so with few records its means
  run into the hundreds. FedBNR and FSGP instead weigh that noise in the likelihood
  (:func:`noise_aware_factor`: ``b~ ~ N(S w, s^2 S + tau^2 I)``), which keeps the prior
  along such directions and equals the plug-in factor where the data dominate; their
  predictive variance adds the scatter noise's first-order effect
  (:func:`predict_noise_aware`).

What it covers: the statistics only. FedBNR's phase-1 kernels and log marginal likelihoods,
and FSGP's FedAvg parameters and counts, are sent in the clear and are not protected; the
features (the kernel) are treated as public. In the embedded runtime the noise key is the
client's round key from the run's key stream; a deployment must draw it from the client's own
entropy, or the server could regenerate the noise.

Example (one client's release, the server's repair and a noise-aware prediction)::

    >>> import jax, jax.numpy as jnp
    >>> from fedppl.algorithms import dp_statistics as dps
    >>> spec = dps.PrivateStatistics(epsilon=2.0, delta=1e-5, feature_bound=1.0,
    ...                              target_bound=2.0)
    >>> sigma = spec.noise_multiplier_for(releases=1)       # calibrated by the accountant
    >>> round(spec.spent(sigma, releases=1), 2) <= 2.0
    True
    >>> Phi = jax.random.normal(jax.random.key(0), (200, 3)) / 2
    >>> y = Phi @ jnp.array([1.0, -1.0, 0.5])
    >>> mech = spec.mechanism(sigma)                        # bounds and the noise std
    >>> stats = dps.private_stats(Phi, y, None, mech, jax.random.key(1))  # on the client
    >>> scatter, floored = dps.repair_scatter(stats.scatter)              # on the server
    >>> mean, var = dps.predict(stats._replace(scatter=scatter), Phi[:2], noise=0.3,
    ...                         prior_scale=1.0, stat_noise_var=mech.noise_std**2)
    >>> mean.shape, bool((var > 0.3**2).all())
    ((2,), True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jax import Array

from fedppl import accounting
from fedppl.algorithms import exact
from fedppl.families import gaussian as g

if TYPE_CHECKING:
    import dp_accounting

__all__ = ["PrivateStatistics", "Mechanism", "sensitivity", "clip_rows", "clip_targets",
           "add_noise", "private_stats", "released", "repair_scatter", "noise_aware_factor",
           "noise_aware_posterior", "plug_in_precision", "mean_noise_variance", "predict",
           "predict_posterior", "predict_noise_aware", "COVERS"]

COVERS = ("the sufficient statistics only (scatter, projection, count); parameters sent in "
          "training rounds are not protected")


def sensitivity(feature_bound: float, target_bound: float) -> float:
    """L2 sensitivity of the released vector (upper triangle of ``S``, ``b``, ``n``) to adding
    or removing one record: ``sqrt(B_x^4 + B_x^2 B_y^2 + 1)``."""
    return math.sqrt(feature_bound**4 + feature_bound**2 * target_bound**2 + 1.0)


class Mechanism(NamedTuple):
    """The calibrated mechanism a trio runs (static, hashable): the clipping bounds and the
    standard deviation of the noise on each released entry, ``sigma * Delta``."""

    feature_bound: float
    target_bound: float
    noise_std: float


def _bound(value: Any, name: str) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class PrivateStatistics:
    """What a user asks for: the clipping bounds and either a target ``epsilon`` (the noise
    multiplier is then calibrated for the number of releases the run plans) or a fixed
    ``noise_multiplier`` (the run reports the ``epsilon`` it spent), at ``delta``.

    :param feature_bound: ``B_x``, the L2 norm each feature row is clipped to.
    :param target_bound: ``B_y``, targets are clipped to ``[-B_y, B_y]``.
    :param epsilon: the per-client budget for the whole run (``inf``: no noise).
    :param noise_multiplier: ``sigma``, the noise std over the sensitivity (0: no noise).
    :param delta: in ``(0, 1)``.
    :param accounting: ``"rdp"`` or ``"pld"`` (see :func:`fedppl.accounting.epsilon`).

    Every argument is checked here, before any client runs.
    """

    feature_bound: float
    target_bound: float
    epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float = 1e-5
    accounting: str = "rdp"

    def __post_init__(self) -> None:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of epsilon (calibrate the noise) and "
                             f"noise_multiplier (fixed noise), got epsilon={self.epsilon!r}, "
                             f"noise_multiplier={self.noise_multiplier!r}")
        if self.epsilon is not None:
            object.__setattr__(self, "epsilon", accounting.check_epsilon(self.epsilon))
        if self.noise_multiplier is not None:
            s = self.noise_multiplier
            ok = isinstance(s, (int, float, np.integer, np.floating)) and not isinstance(s, bool)
            if not ok or not math.isfinite(s) or s < 0:
                raise ValueError(f"noise_multiplier must be a non-negative finite number, got "
                                 f"{s!r}")
            object.__setattr__(self, "noise_multiplier", float(s))
        object.__setattr__(self, "delta", accounting.check_delta(self.delta))
        object.__setattr__(self, "feature_bound", _bound(self.feature_bound, "feature_bound"))
        object.__setattr__(self, "target_bound", _bound(self.target_bound, "target_bound"))
        if self.accounting not in accounting.METHODS:
            raise ValueError(f"accounting must be one of {accounting.METHODS}, got "
                             f"{self.accounting!r}")

    @property
    def sensitivity(self) -> float:
        """``Delta`` (see :func:`sensitivity`)."""
        return sensitivity(self.feature_bound, self.target_bound)

    def event(self, sigma: float, releases: int) -> dp_accounting.DpEvent:
        """``releases`` Gaussian mechanisms of multiplier ``sigma``, composed."""
        import dp_accounting

        if releases == 0:
            return dp_accounting.NoOpDpEvent()
        if sigma == 0:
            return dp_accounting.NonPrivateDpEvent()
        one = dp_accounting.GaussianDpEvent(sigma)
        return one if releases == 1 else dp_accounting.SelfComposedDpEvent(one, releases)

    def noise_multiplier_for(self, releases: int) -> float:
        """``sigma``: the one given, or the smallest that keeps ``releases`` releases within
        ``epsilon`` at ``delta`` (a ValueError when none up to
        :data:`fedppl.accounting.MAX_NOISE` does)."""
        if self.noise_multiplier is not None:
            return self.noise_multiplier
        assert self.epsilon is not None
        if releases < 1:
            raise ValueError(f"calibrating the noise needs the number of releases, got "
                             f"{releases}")
        return accounting.calibrate(lambda s: self.event(s, releases), self.epsilon,
                                    self.delta, self.accounting)

    def spent(self, sigma: float, releases: int) -> float:
        """The ``epsilon`` (at ``delta``) of ``releases`` releases with multiplier ``sigma``."""
        return accounting.epsilon(self.event(sigma, releases), self.delta, self.accounting)

    def mechanism(self, sigma: float) -> Mechanism:
        return Mechanism(self.feature_bound, self.target_bound, float(sigma) * self.sensitivity)

    def report(self, sigma: float, releases: Any) -> dict[str, Any]:
        """The run's privacy record: ``epsilon`` per client (from its ``releases``),
        ``worst_epsilon``, ``delta`` and the mechanism's settings."""
        releases = np.asarray(releases, int)
        cache: dict[int, float] = {}
        eps = np.array([cache.setdefault(int(r), self.spent(sigma, int(r))) for r in releases])
        return {"epsilon": eps, "worst_epsilon": float(eps.max()) if eps.size else 0.0,
                "delta": self.delta, "releases": releases, "noise_multiplier": float(sigma),
                "sensitivity": self.sensitivity, "noise_std": float(sigma) * self.sensitivity,
                "feature_bound": self.feature_bound, "target_bound": self.target_bound,
                "accounting": self.accounting, "covers": COVERS}


# -- the client's side ---------------------------------------------------------------------------


def clip_rows(features: Array, bound: float) -> Array:
    """Each row scaled down to L2 norm at most ``bound`` (rows within it are left exactly)."""
    norm = jnp.linalg.norm(features, axis=-1, keepdims=True)
    return features * (bound / jnp.maximum(norm, bound))


def clip_targets(y: Array, bound: float) -> Array:
    return jnp.clip(y, -bound, bound)


def add_noise(stats: exact.Stats, std: Array | float, key: Array) -> exact.Stats:
    """``stats`` plus ``N(0, std^2)`` on each released entry: the upper triangle of the scatter
    (mirrored), the projection and the count."""
    k_s, k_b, k_n = jax.random.split(key, 3)
    D = stats.proj.shape[-1]
    upper = jnp.triu(jax.random.normal(k_s, (D, D), stats.scatter.dtype))
    E = upper + jnp.triu(upper, 1).T
    e = jax.random.normal(k_b, (D,), stats.proj.dtype)
    count = jnp.asarray(stats.count, stats.proj.dtype)
    n = jax.random.normal(k_n, (), count.dtype)
    return exact.Stats(stats.scatter + std * E, stats.proj + std * e, count + std * n)


def private_stats(features: Array, y: Array, mask: Array | None, mechanism: Mechanism,
                  key: Array) -> exact.Stats:
    """One client's release: clip every row and target, sum (:func:`exact.client_stats`),
    add the noise."""
    clipped = clip_rows(features, mechanism.feature_bound)
    stats = exact.client_stats(clipped, clip_targets(y, mechanism.target_bound), mask)
    return add_noise(stats, mechanism.noise_std, key)


def released(stats: exact.Stats) -> Array:
    """The released entries as one vector: upper triangle of the scatter (row by row), the
    projection, the count (batch axes in front)."""
    D = stats.proj.shape[-1]
    i, j = np.triu_indices(D)
    return jnp.concatenate([stats.scatter[..., i, j], stats.proj,
                            jnp.asarray(stats.count)[..., None]], axis=-1)


# -- the server's side ---------------------------------------------------------------------------


def repair_scatter(scatter: Array, rtol: float = 1e-10) -> tuple[Array, Array]:
    """The projection of a (noisy, summed) scatter matrix onto the PSD cone: eigenvalues below
    zero raised to zero, and how many were. A matrix whose smallest eigenvalue is above
    ``-rtol * D * max|eigenvalue|`` (rounding) is returned unchanged, with count 0."""
    S = 0.5 * (scatter + jnp.swapaxes(scatter, -1, -2))
    w, V = jnp.linalg.eigh(S)
    D = w.shape[-1]
    tol = rtol * D * jnp.max(jnp.abs(w), axis=-1, keepdims=True)
    needs = jnp.any(w < -tol, axis=-1)
    fixed = (V * jnp.maximum(w, 0.0)[..., None, :]) @ jnp.swapaxes(V, -1, -2)
    out = jnp.where(needs[..., None, None], fixed, scatter)
    return out, jnp.where(needs, jnp.sum(w < 0, axis=-1), 0)


def noise_aware_factor(scatter: Array, proj: Array, noise_var: Array | float,
                       stat_noise_var: Array | float) -> tuple[Array, Array]:
    """The likelihood of the weights given noisy sums, as natural parameters ``(nat1, prec)``:
    ``b~ = Phi^T y + e ~ N(S w, s^2 S + tau^2 I)`` with ``S`` the (repaired) noisy scatter
    taken as known, so ``prec = S C^-1 S`` and ``nat1 = S C^-1 b~``, ``C = s^2 S + tau^2 I``
    (``noise_var``: ``s^2``, ``stat_noise_var``: ``tau^2``). Along an eigenvector of ``S``
    with eigenvalue ``mu`` the factor weighs the data by ``mu / (s^2 mu + tau^2)``: ``1 / s^2``
    (the plug-in factor ``(b~ / s^2, S / s^2)``) where ``mu >> tau^2 / s^2``, nothing where
    the noise swamps ``S``."""
    mu, V = jnp.linalg.eigh(0.5 * (scatter + scatter.T))
    mu = jnp.maximum(mu, 0.0)
    c = noise_var * mu + stat_noise_var
    gain = jnp.where(c > 0, mu / jnp.where(c > 0, c, 1.0), 0.0)
    return V @ (gain * (V.T @ proj)), (V * (gain * mu)) @ V.T


def noise_aware_posterior(stats: exact.Stats, noise: Array | float, prior_scale: Array | float,
                          stat_noise_var: Array | float) -> g.FullGaussian:
    """Bayesian linear regression's posterior from noisy sums: the prior ``N(0, lambda^2 I)``
    times :func:`noise_aware_factor` (:func:`fedppl.algorithms.exact.posterior` when
    ``stat_noise_var = 0``)."""
    nat1, prec = noise_aware_factor(stats.scatter, stats.proj, noise**2, stat_noise_var)
    dim = stats.proj.shape[-1]
    return g.FullGaussian(nat1, prec + jnp.eye(dim, dtype=prec.dtype) / prior_scale**2)


def plug_in_precision(prec: Array, prior_prec: Array | float, noise_var: Array | float,
                      stat_noise_var: Array | float) -> Array:
    """``prior_prec I + S / s^2`` from the precision of :func:`noise_aware_posterior`,
    ``prior_prec I + S C^-1 S``: the eigenvalues ``g = mu^2 / (s^2 mu + tau^2)`` of its
    likelihood part turned back into ``mu = (s^2 g + sqrt(s^4 g^2 + 4 tau^2 g)) / 2``."""
    dim = prec.shape[-1]
    g_, V = jnp.linalg.eigh(prec - prior_prec * jnp.eye(dim, dtype=prec.dtype))
    g_ = jnp.maximum(g_, 0.0)
    mu = 0.5 * (noise_var * g_ + jnp.sqrt((noise_var * g_) ** 2 + 4 * stat_noise_var * g_))
    return (V * (mu / noise_var)) @ V.T + prior_prec * jnp.eye(dim, dtype=prec.dtype)


def mean_noise_variance(chol: Array, mean: Array, features: Array, stat_noise_var: Array | float,
                        noise_var: Array | float, projection: bool = True) -> Array:
    """``phi*^T Cov_noise(m) phi*`` for each row of ``features (n, D)``, with
    ``Cov_noise(m) = tau^2 / s^4 A^-1 ((1 + ||m||^2) I + m m^T - diag(m * m)) A^-1``
    (module docstring); ``chol``: the lower Cholesky factor of ``A``, ``mean``: ``m``,
    ``stat_noise_var``: ``tau^2``, ``noise_var``: ``s^2``. ``projection=False`` leaves out
    the projection's noise (the ``1``): for the mean of :func:`noise_aware_posterior`, whose
    likelihood accounts for it, with ``chol`` the factor of :func:`plug_in_precision` (the
    scatter noise's first-order effect)."""
    h = jsl.cho_solve((chol, True), features.T)  # A^-1 phi*  (D, n)
    m2 = mean**2
    quad = ((float(projection) + jnp.sum(m2)) * jnp.sum(h**2, axis=0) + (mean @ h) ** 2
            - jnp.sum(m2[:, None] * h**2, axis=0))
    return stat_noise_var / noise_var**2 * quad


def predict(stats: exact.Stats, features: Array, noise: Array | float,
            prior_scale: Array | float, stat_noise_var: Array | float = 0.0
            ) -> tuple[Array, Array]:
    """Bayesian linear regression's predictive mean and variance (observation noise included)
    from (repaired) noisy statistics, the variance inflated by :func:`mean_noise_variance`
    (``stat_noise_var = 0``: :func:`fedppl.algorithms.exact.predict`)."""
    post = exact.posterior(stats, noise, prior_scale)
    return predict_posterior(post.nat1, post.prec, features, noise, stat_noise_var)


def predict_posterior(nat1: Array, prec: Array, features: Array, noise: Array | float,
                      stat_noise_var: Array | float) -> tuple[Array, Array]:
    """:func:`predict` from the posterior's natural parameters ``(A m, A)``."""
    mean, chol = exact.solve(prec, nat1)
    half = jsl.solve_triangular(chol, features.T, lower=True)
    extra = mean_noise_variance(chol, mean, features, stat_noise_var, noise**2)
    return features @ mean, jnp.sum(half**2, axis=0) + noise**2 + extra


def predict_noise_aware(post: g.FullGaussian, features: Array, noise: Array | float,
                        prior_scale: Array | float, stat_noise_var: Array | float
                        ) -> tuple[Array, Array]:
    """The predictive mean and variance (observation noise included) of
    :func:`noise_aware_posterior` ``post``, the variance with the scatter noise's first-order
    effect on the mean (:func:`mean_noise_variance` at :func:`plug_in_precision`)."""
    mean, chol = exact.solve(post.prec, post.nat1)
    half = jsl.solve_triangular(chol, features.T, lower=True)
    plug = plug_in_precision(post.prec, 1 / prior_scale**2, noise**2, stat_noise_var)
    extra = mean_noise_variance(g.jittered_cholesky(plug), mean, features,
                                stat_noise_var, noise**2, projection=False)
    return features @ mean, jnp.sum(half**2, axis=0) + noise**2 + extra
