"""Sparse GP regression as a NumPyro model, trained with guides over the inducing values ``u``.

The model (:class:`SparseGPRegression`) is the sparse GP of the thesis (Sec. 1.3)::

    theta = (lengthscales, variance, noise)       numpyro.param sites (type-II ML)
    u ~ N(0, K_uu)                                 site "u": PointsPrior (M inducing inputs Z)
                                                   or GridPrior (a full grid, K_uu = ⊗_l K_l)
    with plate("data", N, subsample_size=b):       minibatches, log-likelihood scaled by N / b
        y_i ~ InducingLikelihood(u)                log N(y_i | k_i' K_uu^-1 u, s2)
                                                       - ktilde_ii / (2 s2)

The likelihood site is Titsias' conditional bound ``L1`` (thesis Eq. 1.26) on ``log p(y | u)``,
so the ELBO of this model under any guide ``q(u)`` is Hensman's bound ``L3`` (Eq. 1.34); the
bounds of Eqs. 2.12, 2.15, 2.17 and 2.19 are that ELBO for the structured guides of
:mod:`fedppl.guides.svgp`, :mod:`fedppl.guides.kronecker` and :mod:`fedppl.guides.rnvgp`.

**How it is trained.** ``numpyro.infer.SVI(model, guide, any_optax_optimizer, InducingELBO())``.
:class:`InducingELBO` is numpyro's mean-field ELBO with one difference: the inducing site ``u``
is never drawn. Its KL divergence is closed-form (:func:`inducing_kl`) and the expected
log-likelihood of every :class:`InducingLikelihood` site under ``q(u)`` is closed-form
(:func:`expected_log_likelihood`), so the objective is the exact bound (for the minibatch)
rather than a Monte Carlo estimate of it, and a step with a Kronecker-structured ``q(u)`` over
``m0^p`` grid points never forms a vector of that length (``SVI.init`` draws ``u`` once, as
numpyro traces the guide to find its parameters, so ``M`` values must fit in memory once).
Under numpyro's own ``Trace_ELBO`` the same model and guide give a Monte Carlo estimate of the
same bound (tested). Each guide registers its closed forms with the three generic functions
here.

Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from numpyro.infer import SVI
    >>> from fedppl.guides.svgp import SVIGPGuide
    >>> X = jnp.linspace(-2.0, 2.0, 20)[:, None]
    >>> y = jnp.sin(2.0 * X[:, 0])
    >>> model = SparseGPRegression(Points(X[::4]), batch_size=10)
    >>> svi = SVI(model, SVIGPGuide(model), optax.adam(0.05), InducingELBO())
    >>> res = svi.run(jax.random.key(0), 200, X, y, progress_bar=False)
    >>> mean, var = predict(model, SVIGPGuide(model), res.params, X)
    >>> bool(jnp.sqrt(jnp.mean((mean - y) ** 2)) < 0.2)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import singledispatch
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array
from numpyro.distributions import constraints
from numpyro.distributions.kl import kl_divergence
from numpyro.distributions.util import scale_and_mask
from numpyro.handlers import replay, seed, substitute, trace
from numpyro.infer.elbo import ELBO

from fedppl.families import gaussian as g
from fedppl.families import kronecker as kr
from fedppl.models.kernels import SEParams, se
from fedppl.models.sparse_gp import kzz

__all__ = ["JITTER", "Points", "Grid", "SparseGPRegression", "PointsPrior", "GridPrior",
           "InducingLikelihood", "Undrawn", "expected_log_likelihood", "inducing_kl",
           "predict_latent", "InducingELBO", "posterior", "predict", "gaussian_terms",
           "require_float64"]

JITTER = 1e-6
HYPER = ("lengthscale", "variance", "noise")


class Points(NamedTuple):
    """``M`` inducing inputs ``Z (M, D)``; learned (a ``numpyro.param`` site ``"Z"``) or fixed."""

    Z: Any
    learn: bool = True


class Grid(NamedTuple):
    """A full grid of inducing inputs: one axis of ``m_l >= 2`` points per input dimension,
    ``M = prod_l m_l``; fixed (not learned), as in the thesis."""

    axes: tuple[Any, ...]

    @classmethod
    def over(cls, X: Any, m0: int | Sequence[int]) -> Grid:
        """``m0`` evenly spaced points from the smallest to the largest value of each column."""
        X = np.asarray(X, dtype=float)
        if X.ndim != 2:
            raise ValueError(f"X must be 2-D (N, D), got shape {X.shape}")
        sizes = [m0] * X.shape[1] if np.ndim(m0) == 0 else list(m0)  # type: ignore[list-item]
        if len(sizes) != X.shape[1]:
            raise ValueError(f"{len(sizes)} grid sizes for {X.shape[1]} input dimensions")
        _check_sizes(sizes)
        return cls(tuple(np.linspace(X[:, l].min(), X[:, l].max(), int(m))
                         for l, m in enumerate(sizes)))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.shape(a)[0]) for a in self.axes)

    @property
    def num_inducing(self) -> int:
        return kr.grid_size(self.sizes)


def _check_sizes(sizes: Sequence[int]) -> None:
    if any(int(m) < 2 for m in sizes):
        raise ValueError(f"every grid axis needs m0 >= 2 points, got sizes {list(sizes)}")


def _check_grid(grid: Grid, input_dim: int) -> None:
    if len(grid.axes) != input_dim:
        raise ValueError(f"the grid has {len(grid.axes)} axes but the data have {input_dim} "
                         "columns: the product kernel needs one grid axis per input dimension")
    if any(np.ndim(a) != 1 for a in grid.axes):
        raise ValueError("each grid axis must be a 1-D array of inducing inputs")
    _check_sizes(grid.sizes)


def _concrete(a: Any) -> bool:
    return not isinstance(a, jax.core.Tracer)


def check_data(X: Any, y: Any = None) -> None:
    """Shapes and finiteness of ``X (N, D)`` and ``y (N,)``; values are checked where they are
    concrete (at ``SVI.init`` and in eager calls), not inside a jitted step."""
    if np.ndim(X) != 2:
        raise ValueError(f"X must be 2-D (N, D), got shape {np.shape(X)}")
    if y is not None and np.shape(y) != (np.shape(X)[0],):
        raise ValueError(f"y must have shape ({np.shape(X)[0]},), got {np.shape(y)}")
    for name, a in (("X", X), ("y", y)):
        if a is not None and _concrete(a) and not np.all(np.isfinite(np.asarray(a))):
            raise ValueError(f"{name} has NaN or infinite values; clean or drop those rows")


def require_float64(X: Any, who: str, why: str) -> None:
    """Refuse to compute in float32 (``X``'s dtype, or JAX's default float for a Python
    array): a ``TypeError`` naming ``numpyro.enable_x64()`` and ``why``, raised when the guide is
    first traced (``SVI.init``), before any step."""
    dtype = jnp.result_type(X, float)
    if dtype != jnp.float64:
        raise TypeError(f"{who} computes in float64 only, got {jnp.dtype(dtype).name} inputs: "
                        f"{why}. Call numpyro.enable_x64() first (and pass float64 data)")


class PointsPrior(dist.MultivariateNormal):
    """``p(u) = N(0, K_ZZ + jitter v I)`` at inducing inputs ``Z``; also gives the cross-covariances
    of the likelihood (``cross``) and the Nyström residual ``ktilde`` (``O(b M^2)``)."""

    def __init__(self, Z: Array, hyper: SEParams, jitter: float = JITTER):
        self.Z, self.hyper = Z, hyper
        self.K = kzz(Z, hyper, jitter)
        super().__init__(jnp.zeros(Z.shape[0], self.K.dtype),
                         scale_tril=jnp.linalg.cholesky(self.K))

    def cross(self, X: Array) -> Array:
        """``K_XZ (b, M)``."""
        return self.hyper.kernel(X, self.Z)

    def ktilde(self, X: Array, Kxu: Array | None = None) -> Array:
        """``k(x_i, x_i) - k_i' K_uu^-1 k_i`` for every row of ``X``."""
        Kxu = self.cross(X) if Kxu is None else Kxu
        A = jsl.solve_triangular(self.scale_tril, Kxu.T, lower=True)
        return jnp.maximum(self.hyper.variance - jnp.sum(A**2, axis=0), 0.0)

    def project(self, u: Array, X: Array) -> Array:
        """``K_XZ K_ZZ^-1 u``."""
        return self.cross(X) @ jsl.cho_solve((self.scale_tril, True), u)


class GridPrior(dist.Distribution):
    """``p(u) = N(0, K_1 ⊗ ... ⊗ K_p)`` on a full grid: the ARD squared-exponential kernel is a
    product over dimensions, ``K_l`` is the 1-D kernel on axis ``l`` with variance ``v^(1/p)`` plus
    ``jitter v^(1/p) I``. Nothing of size ``M x M`` is formed; ``sample`` and ``log_prob`` cost
    ``O(M sum m_l)`` (for tests and Monte Carlo checks on small grids)."""

    support = constraints.real_vector

    def __init__(self, axes: Sequence[Array], hyper: SEParams, jitter: float = JITTER):
        self.axes, self.hyper = [jnp.asarray(a) for a in axes], hyper
        self.sizes = tuple(int(a.shape[0]) for a in self.axes)
        self.scale_l = hyper.variance ** (1.0 / len(self.axes))  # each factor's variance
        kernels = [se(a[:, None], a[:, None], hyper.lengthscale[l], self.scale_l)
                   for l, a in enumerate(self.axes)]
        # the jitter at least g.jitter_floor (10 eps tr(K_l)): binds only in float32
        self.factors = [K + jnp.maximum(jitter * self.scale_l, g.jitter_floor(K))
                        * jnp.eye(K.shape[0], dtype=K.dtype) for K in kernels]
        self.chols = [jnp.linalg.cholesky(K) for K in self.factors]
        super().__init__(batch_shape=(), event_shape=(kr.grid_size(self.sizes),))

    def cross(self, X: Array) -> list[Array]:
        """The per-dimension rows ``k_il`` (``(b, m_l)`` each): ``k_i = k_i1 ⊗ ... ⊗ k_ip``."""
        return [se(X[:, l:l + 1], a[:, None], self.hyper.lengthscale[l], self.scale_l)
                for l, a in enumerate(self.axes)]

    def nystrom(self, rows: Sequence[Array]) -> Array:
        """``a_il = k_il' K_l^-1 k_il``, shape ``(b, p)``."""
        return jnp.stack([jnp.sum(jsl.solve_triangular(L, r.T, lower=True) ** 2, axis=0)
                          for L, r in zip(self.chols, rows, strict=True)], axis=1)

    def ktilde(self, X: Array, rows: Sequence[Array] | None = None) -> Array:
        """``k_ii - prod_l a_il`` as ``v (1 - prod_l (1 - e_il))``, ``e_il = 1 - a_il / v^(1/p)``
        (the per-dimension residuals), without cancellation near the grid."""
        a = self.nystrom(self.cross(X) if rows is None else rows)
        e = jnp.clip(1.0 - a / self.scale_l, 0.0, 1.0)
        return self.hyper.variance * kr.one_minus_prod(e)

    def _inverse_factors(self) -> list[Array]:
        return [jsl.cho_solve((L, True), jnp.eye(L.shape[0], dtype=L.dtype)) for L in self.chols]

    def project(self, u: Array, X: Array) -> Array:
        """``k_i' K_uu^-1 u`` for every row of ``X`` (``O(M sum m_l + b M)``)."""
        return kr.contract_rows(kr.kron_matvec(self._inverse_factors(), u), self.cross(X))

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        eps = jax.random.normal(key, (*sample_shape, *self.event_shape))
        flat = eps.reshape(-1, self.event_shape[0])
        out = jax.vmap(lambda e: kr.kron_matvec(self.chols, e))(flat)
        return out.reshape(eps.shape)

    def log_prob(self, value: Array) -> Array:
        inv_l = [jsl.solve_triangular(L, jnp.eye(L.shape[0], dtype=L.dtype), lower=True)
                 for L in self.chols]
        w = jax.vmap(lambda v: kr.kron_matvec(inv_l, v))(value.reshape(-1, self.event_shape[0]))
        logdet = kr.kron_logdet([2.0 * jnp.sum(jnp.log(jnp.diagonal(L))) for L in self.chols],
                                self.sizes)
        lp = -0.5 * (jnp.sum(w**2, -1) + logdet + self.event_shape[0] * jnp.log(2 * jnp.pi))
        return lp.reshape(value.shape[:-1])


class Undrawn(NamedTuple):
    """The value :class:`InducingELBO` gives an inducing site instead of a draw (its name)."""

    name: str


class InducingLikelihood(dist.Distribution):
    """The likelihood site of the sparse GP given ``u`` for a minibatch ``X (b, D)``:
    ``log_prob(y) = log N(y | k' K_uu^-1 u, s2) - ktilde / (2 s2)`` per point (Titsias' ``L1``,
    a lower bound on ``log p(y | u)``). Under :class:`InducingELBO` ``u`` is :class:`Undrawn` and
    the ELBO asks :func:`expected_log_likelihood` for its closed-form expectation instead."""

    support = constraints.real

    def __init__(self, u: Array | Undrawn, prior: PointsPrior | GridPrior, X: Array,
                 noise: Array):
        self.u, self.prior, self.X, self.noise = u, prior, X, noise
        super().__init__(batch_shape=(X.shape[0],), event_shape=())

    def _mean(self) -> Array:
        if isinstance(self.u, Undrawn):
            raise ValueError(f"inducing site {self.u.name!r} was not drawn (InducingELBO): use "
                             "expected_log_likelihood(q, likelihood, y)")
        return self.prior.project(self.u, self.X)

    def log_prob(self, value: Array) -> Array:
        s2 = self.noise**2
        resid = value - self._mean()
        return (-0.5 * jnp.log(2 * jnp.pi * s2) - 0.5 * resid**2 / s2
                - 0.5 * self.prior.ktilde(self.X) / s2)

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        sd = jnp.sqrt(self.prior.ktilde(self.X) + self.noise**2)
        return self._mean() + sd * jax.random.normal(key, sample_shape + self.batch_shape)


def gaussian_terms(y: Array, mean: Array, var: Array, noise: Array) -> Array:
    """``log N(y_i | mean_i, s2) - var_i / (2 s2)``: the expected Gaussian log-likelihood of a
    point whose latent value has that mean and variance."""
    s2 = noise**2
    return -0.5 * jnp.log(2 * jnp.pi * s2) - 0.5 * ((y - mean) ** 2 + var) / s2


@singledispatch
def expected_log_likelihood(q: Any, lik: InducingLikelihood, y: Array) -> Array:
    """``E_q(u)[lik.log_prob(y)]`` per point, in closed form; each guide registers its family."""
    raise NotImplementedError(f"no closed-form expected log-likelihood for {type(q).__name__}")


@singledispatch
def inducing_kl(q: Any, p: Any) -> Array:
    """``KL(q(u) || p(u))`` in closed form (for the sum of Kronecker terms, the upper bound of
    Eq. 2.17); each guide registers its family."""
    raise NotImplementedError(f"no closed-form KL for {type(q).__name__} || {type(p).__name__}")


@singledispatch
def predict_latent(q: Any, prior: Any, X: Array) -> tuple[Array, Array]:
    """Mean and variance of ``f(X)`` under ``q(f) = int p(f | u) q(u) du``."""
    raise NotImplementedError(f"no prediction for {type(q).__name__}")


def _mvn_moments(q: dist.MultivariateNormal, prior: PointsPrior, X: Array
                 ) -> tuple[Array, Array, Array]:
    Kxu = prior.cross(X)
    A = jsl.cho_solve((prior.scale_tril, True), Kxu.T)            # K_uu^-1 k_i  (M, b)
    spread = jnp.sum((q.scale_tril.T @ A) ** 2, axis=0)          # k_i' K^-1 S K^-1 k_i
    return A.T @ q.loc, spread, prior.ktilde(X, Kxu)


@expected_log_likelihood.register
def _(q: dist.MultivariateNormal, lik: InducingLikelihood, y: Array) -> Array:
    mean, spread, ktilde = _mvn_moments(q, lik.prior, lik.X)      # type: ignore[arg-type]
    return gaussian_terms(y, mean, ktilde + spread, lik.noise)


@inducing_kl.register
def _(q: dist.MultivariateNormal, p: Any) -> Array:
    return kl_divergence(q, p)


@predict_latent.register
def _(q: dist.MultivariateNormal, prior: Any, X: Array) -> tuple[Array, Array]:
    mean, spread, ktilde = _mvn_moments(q, prior, X)
    return mean, ktilde + spread


class SparseGPRegression:
    """The NumPyro model above; ``model(X, y)`` with ``X (N, D)`` and ``y (N,)``.

    ``inducing`` is :class:`Points` (SVIGP, the (alpha, Sigma) family, RNVGP) or :class:`Grid`
    (Kronecker, Tucker and sum-of-Kronecker guides). ``batch_size`` is ``b`` of the minibatch
    plate (``None``: all points). Hyperparameters start at ``lengthscale``, ``variance`` and
    ``noise`` (the noise standard deviation); those named in ``learn`` are ``numpyro.param``
    sites in log space (``log_lengthscale``, ``log_variance``, ``log_noise``), the others stay
    fixed (the thesis fixed variance 1 and noise variance 0.1 for TVGP).
    """

    def __init__(self, inducing: Points | Grid, *, batch_size: int | None = None,
                 lengthscale: float | Sequence[float] = 1.0, variance: float = 1.0,
                 noise: float = 0.1, learn: Sequence[str] = HYPER, jitter: float = JITTER):
        unknown = set(learn) - set(HYPER)
        if unknown:
            raise ValueError(f"learn names {sorted(unknown)}; choose from {HYPER}")
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
        if min(np.min(lengthscale), variance, noise) <= 0:
            raise ValueError("lengthscale, variance and noise must be positive")
        if isinstance(inducing, Grid):
            _check_sizes(inducing.sizes)
        elif np.ndim(inducing.Z) != 2:
            raise ValueError(f"inducing inputs Z must be 2-D (M, D), got {np.shape(inducing.Z)}")
        self.inducing, self.batch_size, self.jitter = inducing, batch_size, jitter
        self.init = (lengthscale, variance, noise)
        self.learn = tuple(learn)

    @property
    def num_inducing(self) -> int:
        g = self.inducing
        return g.num_inducing if isinstance(g, Grid) else int(np.shape(g.Z)[0])

    def hyperparameters(self, input_dim: int) -> SEParams:
        """The kernel and noise hyperparameters (declares the learned ``numpyro.param`` sites;
        guides call this too, so model and guide share them)."""
        lengthscale, variance, noise = self.init
        log_l = jnp.log(jnp.broadcast_to(jnp.asarray(lengthscale, dtype=float), (input_dim,)))
        values = {"lengthscale": log_l, "variance": jnp.log(jnp.asarray(variance, dtype=float)),
                  "noise": jnp.log(jnp.asarray(noise, dtype=float))}
        values = {k: numpyro.param(f"log_{k}", v) if k in self.learn else v
                  for k, v in values.items()}
        return SEParams(values["lengthscale"], values["variance"], values["noise"])

    def prior(self, hyper: SEParams, input_dim: int) -> PointsPrior | GridPrior:
        """``p(u)`` at the current hyperparameters (declares ``"Z"`` when inducing inputs are
        learned)."""
        if isinstance(self.inducing, Grid):
            _check_grid(self.inducing, input_dim)
            return GridPrior(self.inducing.axes, hyper, self.jitter)
        Z = jnp.asarray(self.inducing.Z, dtype=float)
        if Z.shape[1] != input_dim:
            raise ValueError(f"inducing inputs have {Z.shape[1]} columns, the data {input_dim}")
        if self.inducing.learn:
            Z = numpyro.param("Z", Z)
        return PointsPrior(Z, hyper, self.jitter)

    def __call__(self, X: Array, y: Array | None = None) -> None:
        check_data(X, y)
        X = jnp.asarray(X)
        y = None if y is None else jnp.asarray(y)
        hyper = self.hyperparameters(X.shape[1])
        prior = self.prior(hyper, X.shape[1])
        u = numpyro.sample("u", prior)
        b = None if self.batch_size is None else min(int(self.batch_size), X.shape[0])
        with numpyro.plate("data", X.shape[0], subsample_size=b) as idx:
            numpyro.sample("y", InducingLikelihood(u, prior, X[idx], hyper.noise),
                           obs=None if y is None else y[idx])


def _traces(model: Any, guide: Any, params: dict, key: Array, sites: Sequence[str],
            args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """Guide and model traces with ``params`` substituted and the inducing ``sites`` undrawn."""
    model_key, guide_key = jax.random.split(key)
    undrawn = {name: Undrawn(name) for name in sites}
    guide_tr = trace(substitute(seed(guide, guide_key), data={**params, **undrawn})
                     ).get_trace(*args, **kwargs)
    model_tr = trace(substitute(replay(seed(model, model_key), guide_tr), data=params)
                     ).get_trace(*args, **kwargs)
    return guide_tr, model_tr


def _site_elbo(name: str, site: dict, guide_tr: dict, sites: Sequence[str]) -> Array:
    fn = site["fn"]
    if site["is_observed"]:
        if isinstance(fn, InducingLikelihood) and isinstance(fn.u, Undrawn):
            lp = expected_log_likelihood(guide_tr[fn.u.name]["fn"], fn, site["value"])
        else:
            lp = fn.log_prob(site["value"])
        return jnp.sum(scale_and_mask(lp, site["scale"]))
    guide_site = guide_tr[name]
    if name in sites:
        return -jnp.sum(scale_and_mask(inducing_kl(guide_site["fn"], fn), guide_site["scale"]))
    try:                                     # any other latent site: numpyro's mean-field rule
        kl = kl_divergence(guide_site["fn"], fn)
        return -jnp.sum(scale_and_mask(kl, guide_site["scale"]))
    except NotImplementedError:
        def log_p(s: dict) -> Array:
            return jnp.sum(scale_and_mask(s["fn"].log_prob(s["value"]), s["scale"]))
        return log_p(site) - log_p(guide_site)


class InducingELBO(ELBO):
    """Numpyro's mean-field ELBO with the inducing ``sites`` (``("u",)``) left undrawn: their KL
    and the expected log-likelihood of the :class:`InducingLikelihood` sites that use them are
    closed-form (per minibatch, scaled by the plate). Other latent sites follow
    ``TraceMeanField_ELBO`` (analytic KL where numpyro has one, else one Monte Carlo draw)."""

    def __init__(self, num_particles: int = 1, sites: Sequence[str] = ("u",)):
        super().__init__(num_particles=num_particles)
        self.sites = tuple(sites)

    def elbo(self, rng_key: Array, param_map: dict, model: Any, guide: Any, *args: Any,
             **kwargs: Any) -> Array:
        """One particle of the ELBO (exact when every latent site is an inducing site)."""
        guide_tr, model_tr = _traces(model, guide, param_map, rng_key, self.sites, args, kwargs)
        return sum((_site_elbo(name, site, guide_tr, self.sites)
                    for name, site in model_tr.items() if site["type"] == "sample"),
                   start=jnp.zeros(()))

    def loss_with_mutable_state(self, rng_key: Array, param_map: dict, model: Any, guide: Any,
                                *args: Any, **kwargs: Any) -> dict:
        def one(key: Array) -> Array:
            return self.elbo(key, param_map, model, guide, *args, **kwargs)

        if self.num_particles == 1:
            return {"loss": -one(rng_key), "mutable_state": None}
        keys = jax.random.split(rng_key, self.num_particles)
        return {"loss": -jnp.mean(self.vectorize_particles_fn(one, keys)), "mutable_state": None}


def posterior(model: Any, guide: Any, params: dict, X: Array, site: str = "u",
              rng_key: Array | None = None) -> tuple[Any, Any]:
    """``(q(u), p(u))`` at ``params`` (constrained, e.g. ``svi.get_params(state)``): the guide's
    and the model's distributions at the inducing site, nothing drawn."""
    key = jax.random.key(0) if rng_key is None else rng_key
    X = jnp.asarray(X)
    guide_tr, model_tr = _traces(model, guide, params, key, (site,),
                                 (X, jnp.zeros(X.shape[0], X.dtype)), {})
    return guide_tr[site]["fn"], model_tr[site]["fn"]


def predict(model: Any, guide: Any, params: dict, X: Array, noise: bool = False
            ) -> tuple[Array, Array]:
    """Predictive mean and variance of ``f(X)`` (``noise=False``) or ``y(X)`` (``noise=True``)."""
    q, prior = posterior(model, guide, params, X)
    mean, var = predict_latent(q, prior, jnp.asarray(X))
    return mean, var + (prior.hyper.noise_var if noise else 0.0)
