"""Expectation propagation as a PVI client step (Vehtari et al. 2020, "EP as a way of life").

The server holds ``q = p * prod_k t_k`` (Gaussian sites over the model's global sites in the
unconstrained space), exactly as in :mod:`fedppl.algorithms.pvi`; only the client's step differs.
Client ``k`` (power ``alpha`` in (0, 1]; ``alpha = 1`` is plain EP):

1. cavity ``q_{\\k} = q / t_k^alpha`` (repaired if not positive definite, and flagged);
2. the tilted distribution ``q_{\\k}(theta) p(y_k | theta)^alpha`` is sampled by NUTS
   (:class:`TiltedNUTS`: numpyro's pure ``hmc(potential_fn, algo="NUTS")`` kernel, warm-up that
   adapts the step size and a dense or diagonal mass matrix started at ``q``'s covariance, then
   ``num_samples`` draws in one ``lax.scan``; ``num_chains`` chains, so that the split r-hat can
   be computed), or computed in closed form for a conjugate Gaussian model
   (:class:`ExactTilted`, which shows the algebra is exact);
3. moment matching: ``q_tilted = N(mean, cov)`` of the draws. The estimator is the sample mean and
   the sample covariance ``S`` (denominator ``n - 1``, all ``n = chains * samples`` draws), with
   the precision taken as ``(m - D - 2) / (m - 1) S^-1``: the inverse of a sample covariance
   overestimates the precision by ``(m - 1) / (m - D - 2)`` (inverse Wishart with ``m``
   independent draws), and the sites are differences of precisions, so over ``K`` clients the
   bias adds up to ``K`` times that in ``q`` (``D = 31, m = 2000, K = 10``: 17%, sds 8% small).
   For a Markov chain ``m`` is the effective number of draws of the covariance: the smallest
   effective sample size of the squared centred draws over the coordinates (clipped to
   ``[2 D + 10, n]``); for NUTS it is well below ``n``, and taking ``m = n`` would leave a bias
   per site that adds up over the clients in ``q``. No shrinkage. ``n`` must
   be at least ``2 D + 10`` (:func:`check_draws`). With ``estimator="stein"`` the moments come
   from the gradients and Hessians of the client's likelihood at the draws instead
   (:func:`stein_moments`), whose noise scales with the site, not the cavity, along the
   directions where the site is weaker than the cavity, and from the draws along the rest
   (:func:`blend_moments`): with many clients the sampled sites' noise, summed in ``q``, is
   what the sample moments cannot get below;
4. new site ``t_k' = (q_tilted / q_{\\k})^(1 / alpha)``, damped ``t_k'' = t_k^(1 - rho) t_k'^rho``;
   the message (:class:`EPMessage`) is ``delta_k = t_k'' / t_k`` with the sampler's diagnostics:
   the largest split r-hat and smallest effective sample size over the global coordinates and
   the Monte Carlo error of the tilted mean in tilted sds (``1 / sqrt(ESS)``, the largest).

The server is PVI's (:func:`fedppl.algorithms.pvi.server_update`): it refuses non-finite deltas,
deltas with which ``q`` alone would not be positive definite and implausible ones, and applies
the sum of the rest with the largest step in 1, 1/2, ..., 2^-10 that keeps ``q`` positive
definite. A site's precision may be indefinite (EP's negative site variances); only ``q`` must
stay positive definite. With ``alpha = 1`` the client step is exactly
:func:`fedppl.algorithms.pvi.client_update` with :class:`TiltedNUTS` as the local solver (a
:class:`~fedppl.algorithms.pvi.LocalSolver`: ``q_k`` is the tilted moment match); this module's
:func:`client_update` adds the power and the diagnostics.

Example (one synchronous round by hand; Bayesian linear regression, the tilted moments in closed
form, so one undamped round gives the exact posterior)::

    >>> import jax, jax.numpy as jnp, numpy as np, fedppl
    >>> from fedppl.families import gaussian as g
    >>> from fedppl.algorithms import pvi
    >>> from fedppl.models import linear_regression
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> guide = fedppl.PVIGuide(linear_regression, family="fullrank").setup(*clients.client(0))
    >>> trio = make_trio(ExactTilted(linear_regression, guide), 1.0, guide.prior)
    >>> flat = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), g.zeros_like(guide.prior))
    >>> msgs, proposed = jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0))(
    ...     pvi.init(guide.prior, flat), pvi.ClientState(flat), clients.stacked, clients.mask,
    ...     jax.random.split(jax.random.key(0), 3), jnp.arange(3))
    >>> msgs.rhat.tolist()                                # no sampler: no r-hat
    [nan, nan, nan]
    >>> state, steps = pvi.server_update(pvi.init(guide.prior, flat), msgs)
    >>> Xb = np.c_[X, np.ones(60)]                        # (w, b): the exact posterior mean
    >>> exact = np.linalg.solve(np.eye(3) + Xb.T @ Xb, Xb.T @ (X @ np.ones(2)))
    >>> bool(np.allclose(g.to_moments(state.q)[0], exact, atol=1e-4)), steps.tolist()
    (True, [1.0, 1.0, 1.0])

:class:`TiltedNUTS` in its place samples the tilted distributions (``fedppl.EP`` runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
from jax import Array
from numpyro.infer.hmc import hmc

from fedppl.algorithms import conjugate, pvi
from fedppl.algorithms.natural_gradient import LocalResult, log_lik_fn
from fedppl.algorithms.trio import Trio
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client

__all__ = ["TiltedMoments", "TiltedNUTS", "ExactTilted", "EPMessage", "client_update",
           "make_trio", "check_draws", "moments_from_draws", "log_factor", "stein_moments",
           "blend_moments", "split_rhat",
           "effective_sample_size", "decaying_damping", "local_conditional"]

Damping = float | Callable[[Array], Array]


class TiltedMoments(NamedTuple):
    """The moment match of a tilted distribution and how far to trust it: the largest split
    r-hat and smallest effective sample size over the global coordinates, the largest Monte
    Carlo standard error of the mean in tilted sds, and the number of draws (NaN diagnostics,
    and ``num_draws = 0``, for a closed form)."""

    tilted: g.Gaussian
    rhat: Array
    ess: Array
    mc_error: Array
    num_draws: Array
    local: g.Conditional | None = None  # q(z_k | theta) from the joint draws (local sites)
    draws: Array | None = None  # the global draws (n, D), for a merge of draws (consensus)
    extensions: Array | int = 0  # the sampler's extra stages (TiltedNUTS; 0 for the rest)


class EPMessage(NamedTuple):
    """What client k sends up: its site update ``delta`` and the sampler's diagnostics. The
    first five fields are :class:`~fedppl.algorithms.pvi.ClientMessage`'s (``free_energy`` is
    NaN: EP has none; ``converged``: r-hat below the solver's ``max_rhat``; ``iterations``: the
    draws, chains times samples), so PVI's server and round log take it as it is."""

    delta: g.Gaussian
    free_energy: Array
    cavity_repaired: Array
    converged: Array
    iterations: Array
    rhat: Array
    ess: Array
    mc_error: Array
    draws: Array | None = None  # the tilted draws (n, D): only a consensus merge sends them
    extensions: Array | int = 0  # extra sampler stages the client's chains took to mix


class TiltedSolver(Protocol):
    """Moments of ``cavity(theta) p(y_k | theta)^alpha``: :class:`TiltedNUTS`,
    :class:`ExactTilted`."""

    @property
    def max_rhat(self) -> float: ...

    def moments(self, cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                rng_key: Array, alpha: float = 1.0, local: g.Conditional | None = None
                ) -> TiltedMoments: ...


# -- the estimators --------------------------------------------------------------------------------


def split_rhat(draws: Array) -> Array:
    """Split r-hat per coordinate of ``draws`` ``(chains, samples, D)`` (Gelman et al. BDA3)."""
    half = draws.shape[1] // 2
    x = jnp.concatenate([draws[:, :half], draws[:, half:2 * half]])
    n = x.shape[1]
    within = jnp.mean(jnp.var(x, axis=1, ddof=1), axis=0)
    between = jnp.var(jnp.mean(x, axis=1), axis=0, ddof=1)  # B / n
    pooled = (n - 1) / n * within + between
    return jnp.sqrt(pooled / within)


def effective_sample_size(draws: Array) -> Array:
    """Effective sample size per coordinate of ``draws`` ``(chains, samples, D)``: the
    multi-chain autocorrelation estimate with Geyer's initial monotone sequence (as
    :func:`numpyro.diagnostics.effective_sample_size`, in JAX)."""
    C, N = draws.shape[:2]
    centred = draws - jnp.mean(draws, axis=1, keepdims=True)
    nfft = 1 << (2 * N - 1).bit_length()
    f = jnp.fft.rfft(centred, n=nfft, axis=1)
    acov = jnp.fft.irfft(f * jnp.conj(f), n=nfft, axis=1)[:, :N] / N  # (C, N, D), biased
    within = jnp.mean(acov[:, 0] * N / (N - 1), axis=0)
    var_plus = within * (N - 1) / N
    if C > 1:
        var_plus = var_plus + jnp.var(jnp.mean(draws, axis=1), axis=0, ddof=1)
    rho = 1.0 - (within - jnp.mean(acov, axis=0)) / var_plus
    rho = rho.at[0].set(1.0)
    M = N // 2
    pairs = rho[:2 * M].reshape(M, 2, -1).sum(axis=1)  # Geyer's pair sums
    positive = jnp.cumprod(pairs > 0, axis=0).astype(bool)  # up to the first non-positive one
    pairs = jax.lax.cummin(jnp.where(positive, pairs, jnp.inf), axis=0)  # monotone
    tau = -1.0 + 2.0 * jnp.sum(jnp.where(positive, pairs, 0.0), axis=0)
    return C * N / jnp.maximum(tau, 1.0 / jnp.log10(C * N))


def moments_from_draws(theta: Array, diag: bool, num_eff: Array | float | None = None
                       ) -> g.Gaussian:
    """The tilted Gaussian from ``n`` draws ``(n, D)``: the sample mean, and the precision
    ``(m - D - 2) / (m - 1) S^-1`` of the sample covariance ``S``, ``m = num_eff`` effective
    draws (default ``n``: unbiased for independent Gaussian draws); per coordinate (``D = 1``)
    for a diagonal family."""
    n, D = theta.shape
    m = n if num_eff is None else num_eff
    mean = jnp.mean(theta, axis=0)
    centred = theta - mean
    if diag:
        var = jnp.sum(centred**2, axis=0) / (n - 1)
        prec = (m - 3) / (m - 1) / var
        return g.DiagGaussian(prec * mean, prec)
    cov = centred.T @ centred / (n - 1)
    full = g.FullGaussian.from_moments(mean, cov)
    return g.scale(full, (m - D - 2) / (m - 1))


def log_factor(model: Callable, guide: PVIGuide, data: tuple, mask: Array, alpha: float = 1.0,
               share: Callable[[Array], Array] | None = None) -> Callable[[Array], Array]:
    """``phi -> alpha * [log p(y_k, z_k | theta) + share(theta)]``: what a client's tilted
    distribution adds to its cavity, at the flat ``phi = (theta, z_k)`` (``share``: its part of
    a non-Gaussian prior's correction)."""
    D = guide.layout_or_raise().dim
    log_lik: Callable[..., Array] = log_lik_fn(model, guide, data, mask)

    def log_f(phi: Array) -> Array:
        own = log_lik(phi) if share is None else log_lik(phi) + share(phi[:D])
        return alpha * own

    return log_f


STRONG = 0.5  # a direction where the tilted variance falls below this share of the cavity's


def stein_moments(cavity: g.Gaussian, joint: Array, log_factor: Callable[[Array], Array],
                  D: int) -> tuple[Array, Array, Array]:
    """The tilted mean and covariance from the gradients and Hessians of the client's log factor
    ``f`` (likelihood to the power alpha, with local sites and prior share) at joint draws
    ``(chains, samples, D + d)`` of ``(theta, z)``, by Stein's identities for a tilted
    distribution ``N(theta; m, S) f(theta, z)``:

    ``mean = m + S E[g]``, ``cov = S + S (E[H] + Cov[g]) S``, with ``g`` and ``H`` the gradient
    and Hessian of ``log f`` in ``theta`` (integration by parts in ``theta``, for each ``z``).

    What the sample moments estimate as ``S`` plus a small difference, these estimate as the
    difference itself: along a direction where the site holds a share ``s`` of the cavity's
    precision, their relative error in the tilted variance grows as ``s`` where the sample
    covariance's is the same for every ``s``. So they win where the site is weak against its
    cavity (many clients with little data each) and lose where it dominates;
    :func:`blend_moments` takes each from where it wins. The cost is a ``D``-column Hessian per
    draw. Also returns the largest Monte Carlo standard error of the mean in tilted sds (the
    ``ESS`` of each coordinate of ``S g``)."""
    m, S = g.to_moments(g.to_full(cavity))

    def at(phi):
        def f(theta):
            return log_factor(jnp.concatenate([theta, phi[D:]]))
        return jax.grad(f)(phi[:D]), jax.hessian(f)(phi[:D])

    def chain(h_sum, x):  # one chain at a time: the Hessians are summed, never all kept
        grads, hess = jax.vmap(at)(x)
        return h_sum + jnp.sum(hess, axis=0), grads

    h_sum, grads = jax.lax.scan(chain, jnp.zeros((D, D), joint.dtype), joint)
    n = grads.shape[0] * grads.shape[1]
    flat = grads.reshape(n, D)
    mean_g = jnp.mean(flat, axis=0)
    cov_g = (flat - mean_g).T @ (flat - mean_g) / (n - 1)
    A = h_sum / n + cov_g
    mean = m + S @ mean_g
    cov = S + S @ (0.5 * (A + A.T)) @ S
    shifts = grads @ S  # (chains, samples, D): each draw's S g
    sd = jnp.sqrt(jnp.clip(jnp.diagonal(cov), jnp.finfo(cov.dtype).tiny))
    mc = jnp.sqrt(jnp.var(shifts, axis=(0, 1)) / effective_sample_size(shifts)) / sd
    return mean, cov, jnp.max(mc)


def blend_moments(cavity: g.Gaussian, stein: tuple[Array, Array], theta: Array,
                  num_eff: Array | float, diag: bool) -> tuple[g.Gaussian, Array]:
    """The tilted Gaussian from the draws ``theta`` ``(n, D)`` along the directions where the
    site is strong against the cavity and from Stein's moments along the rest. In the cavity's
    whitened coordinates the tilted covariance has eigenvalues ``1 / (1 + s)`` for a site
    holding ``s`` of the cavity's precision along each eigenvector. The directions are those of
    the sample covariance (its relative error is the same for every ``s``, so it tells strong
    from weak reliably, where Stein's own grows with ``s``): the eigenvalues below
    :data:`STRONG` (``s > 1``) keep the sample moments (their precision corrected as
    :func:`moments_from_draws` does, for the block's dimension), the rest of the space takes
    Stein's moments projected on it. The blocks do not mix. Where Stein's block is not positive
    definite, or not finite, the sample moments are used everywhere. Per coordinate for a
    diagonal family. Returns the Gaussian and the number of strong directions (``D`` for the
    sample moments everywhere)."""
    mc, Sc = g.to_moments(g.to_full(cavity))
    st_mean, st_cov = stein
    n = theta.shape[0]
    sa_mean = jnp.mean(theta, axis=0)
    centred = theta - sa_mean
    sa_cov = centred.T @ centred / (n - 1)
    finite = jnp.all(jnp.isfinite(st_cov)) & jnp.all(jnp.isfinite(st_mean))
    if diag:
        st_var, sample = jnp.diagonal(st_cov), moments_from_draws(theta, True, num_eff)
        strong = ~(jnp.diagonal(sa_cov) >= STRONG * jnp.diagonal(Sc)) | ~(st_var > 0) | ~finite
        prec = jnp.where(strong, sample.prec, 1.0 / st_var)
        mean = jnp.where(strong, sa_mean, st_mean)
        return g.DiagGaussian(prec * mean, prec), jnp.sum(strong)
    L = jnp.linalg.cholesky(Sc)

    def white(C):  # L^-1 C L^-T
        half = jax.scipy.linalg.solve_triangular(L, C, lower=True)
        return jax.scipy.linalg.solve_triangular(L, half.T, lower=True)

    lam, V = jnp.linalg.eigh(white(sa_cov))
    W_stein = white(jnp.where(finite, st_cov, sa_cov))  # finite, so that 0 * W is 0
    strong = ~(lam >= STRONG)
    Vw = V * ~strong
    weak = Vw.T @ W_stein @ Vw  # Stein's, on the weak space (zero rows for the strong ones)
    ok = finite & (jnp.min(jnp.linalg.eigvalsh(weak + jnp.diag(strong.astype(weak.dtype))))
                   > 0)
    strong = strong | ~ok
    Vt, Vw = V * strong, V * ~strong
    k = jnp.sum(strong)
    strong_block = (Vt * lam) @ Vt.T * (num_eff - 1) / (num_eff - k - 2)
    cov_w = strong_block + Vw @ (Vw.T @ W_stein @ Vw) @ Vw.T

    def shift(x):  # whitened x - mc
        return jax.scipy.linalg.solve_triangular(L, x - mc, lower=True)

    mean_w = Vt @ (Vt.T @ shift(sa_mean)) + Vw @ (Vw.T @ shift(jnp.where(finite, st_mean, mc)))
    return g.FullGaussian.from_moments(mc + L @ mean_w, L @ cov_w @ L.T), k


def local_conditional(joint: Array, D: int) -> g.Conditional:
    """``q(z | theta)`` of the Gaussian fitted to joint draws ``(n, D + d)`` of ``(theta, z)``:
    the rows of its precision that belong to ``z`` (a client's private guide, as PVI keeps)."""
    mean = jnp.mean(joint, axis=0)
    centred = joint - mean
    fit = g.FullGaussian.from_moments(mean, centred.T @ centred / (joint.shape[0] - 1))
    return g.Conditional(fit.nat1[D:], fit.prec[D:, D:], fit.prec[D:, :D])


def check_draws(num_draws: int, dim: int) -> None:
    """Refuse too few draws for a ``dim``-dimensional moment match (``2 dim + 10`` at least: the
    sample covariance must be invertible and its inverse's correction ``(n - D - 2) / (n - 1)``
    well away from zero)."""
    need = 2 * dim + 10
    if num_draws < need:
        raise ValueError(f"EP's moment match over {dim} global coordinates needs at least "
                         f"{need} draws per client (num_samples * num_chains = {num_draws}): "
                         "raise num_samples or num_chains")


# -- the tilted solvers ----------------------------------------------------------------------------


class TiltedNUTS(NamedTuple):
    """NUTS on a client's tilted distribution over the flat unconstrained ``(theta, z_k)`` (its
    local sites, if any, sampled jointly and marginalised by keeping ``theta``'s coordinates).

    Chains start at draws from ``q`` (standard normal in local coordinates) with the inverse mass
    matrix at ``q``'s covariance (identity in local coordinates); warm-up adapts the step size and
    the mass matrix (``dense_mass``). ``max_rhat`` decides ``converged``. ``chain_method``:
    ``"sequential"`` (``lax.map`` over the chains; on CPU as fast, and a third of the compile
    time of) ``"vectorized"`` (``vmap`` over the chains: for an accelerator). As a
    :class:`~fedppl.algorithms.pvi.LocalSolver` (``__call__``) it returns the tilted moment match
    as ``q_k`` (``alpha = 1``).
    """

    model: Callable
    guide: PVIGuide
    num_warmup: int = 300
    num_samples: int = 500
    num_chains: int = 4
    dense_mass: bool = True
    target_accept_prob: float = 0.8
    max_tree_depth: int = 8
    max_rhat: float = 1.05
    chain_method: str = "sequential"
    prior_share: Callable[[Array], Array] | None = None
    keep_draws: bool = False
    estimator: str = "sample"
    extensions: int = 0

    def log_factor(self, data: tuple, mask: Array, alpha: float = 1.0
                   ) -> Callable[[Array], Array]:
        return log_factor(self.model, self.guide, data, mask, alpha, self.prior_share)

    def draws(self, cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
              rng_key: Array, alpha: float = 1.0, local: g.Conditional | None = None,
              log_f: Callable[[Array], Array] | None = None) -> tuple[Array, Array]:
        """The tilted draws of the global and local coordinates, ``(num_chains, num_samples,
        D + d)``, and the number of extensions they took. With ``local`` (the client's
        ``q(z_k | theta)``, fitted to its last round's joint draws) the chains start at draws of
        ``q(theta) q(z_k | theta)`` with its covariance as the inverse mass matrix: the previous
        round's adaptation, carried over. ``log_f``: the client's :func:`log_factor`, if the
        caller has built it already.

        A stage is ``num_warmup`` steps of adaptation and ``num_samples`` draws per chain. While
        the largest split r-hat of a stage's global draws is at or above ``max_rhat``, and at
        most ``extensions`` times, every chain runs another stage from where it stopped, its
        warm-up starting at the step size and mass matrix it had adapted; the last stage's
        draws are returned. (Under ``vmap`` over clients, the clients that mixed wait for the
        rest: their draws are kept, not extended.)"""
        layout = self.guide.layout_or_raise()
        D = layout.dim
        d = 0 if self.guide.local_layout is None else self.guide.local_layout.dim
        own = self.log_factor(data, mask, alpha) if log_f is None else log_f

        def potential(phi):
            return -(g.log_prob(cavity, phi[:D]) + own(phi))

        joint = g.to_full(q) if not d or local is None else g.join(q, local, False)
        mean, cov = g.to_moments(joint)
        dtype = mean.dtype
        fresh = d and local is None  # local coordinates with nothing learnt yet: N(0, I)
        inv_mass = jax.scipy.linalg.block_diag(cov, jnp.eye(d, dtype=dtype)) if fresh else cov
        if not self.dense_mass:
            inv_mass = jnp.diagonal(inv_mass)
        k_init, k_local, k_run = jax.random.split(rng_key, 3)
        start = g.sample(k_init, joint, self.num_chains)
        if fresh:
            start = jnp.concatenate(
                [start, jax.random.normal(k_local, (self.num_chains, d), dtype)], axis=1)
        init_kernel, sample_kernel = hmc(potential_fn=potential, algo="NUTS")

        def chain(x0, step_size, mass, key):  # one stage: warm-up, then num_samples draws
            state = init_kernel(x0, self.num_warmup, step_size=step_size,
                                inverse_mass_matrix=mass, dense_mass=self.dense_mass,
                                target_accept_prob=self.target_accept_prob,
                                max_tree_depth=self.max_tree_depth, rng_key=key)

            def step(s, _):  # warm-up and sampling in one scan: the kernel is traced once
                s = sample_kernel(s)
                return s, s.z

            end, zs = jax.lax.scan(step, state, None, length=self.num_warmup + self.num_samples)
            return zs[self.num_warmup:], end.adapt_state.step_size, \
                end.adapt_state.inverse_mass_matrix

        def stage(carry):  # every chain through one stage, from where the last one ended
            draws, step_size, mass, _, n, key = carry
            key, sub = jax.random.split(key)
            keys = jax.random.split(sub, self.num_chains)
            x0 = draws[:, -1]
            if self.chain_method == "vectorized":
                out = jax.vmap(chain)(x0, step_size, mass, keys)
            else:  # one chain after another: a third of the tracing and compiling time on CPU
                out = jax.lax.map(lambda a: chain(*a), (x0, step_size, mass, keys))
            zs = out[0]
            return zs, out[1], out[2], jnp.max(split_rhat(zs[..., :D])), n + 1, key

        def unmixed(carry):  # the first stage always; then while r-hat fails, up to the budget
            rhat, n = carry[3], carry[4]
            return (n == 0) | ((rhat >= self.max_rhat) & (n <= self.extensions))

        C, P = self.num_chains, start.shape[1]
        draws0 = jnp.zeros((C, self.num_samples, P), dtype).at[:, -1].set(start)
        carry = (draws0, jnp.ones((C,), dtype), jnp.broadcast_to(inv_mass, (C, *inv_mass.shape)),
                 jnp.asarray(jnp.inf, dtype), jnp.asarray(0), k_run)
        zs, _, _, _, stages, _ = jax.lax.while_loop(unmixed, stage, carry)
        return zs, stages - 1

    def moments(self, cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                rng_key: Array, alpha: float = 1.0, local: g.Conditional | None = None
                ) -> TiltedMoments:
        log_f = self.log_factor(data, mask, alpha)
        joint, extended = self.draws(cavity, q, data, mask, rng_key, alpha, local, log_f)
        D = self.guide.layout_or_raise().dim
        draws = joint[..., :D]
        ess = effective_sample_size(draws)
        n = self.num_chains * self.num_samples
        squares = (draws - jnp.mean(draws, axis=(0, 1))) ** 2
        num_eff = jnp.clip(jnp.min(effective_sample_size(squares)), min(2 * D + 10, n), n)
        mc_error = jnp.max(1.0 / jnp.sqrt(ess))
        if self.estimator == "stein":
            st_mean, st_cov, mc_stein = stein_moments(cavity, joint, log_f, D)
            tilted, strong = blend_moments(cavity, (st_mean, st_cov), draws.reshape(-1, D),
                                           num_eff, self.guide.diag)
            mc_error = jnp.where(strong > 0, jnp.maximum(mc_stein, mc_error), mc_stein)
        else:
            tilted = moments_from_draws(draws.reshape(-1, D), self.guide.diag, num_eff)
        local = (None if joint.shape[-1] == D else
                 local_conditional(joint.reshape(n, -1), D))
        return TiltedMoments(tilted, jnp.max(split_rhat(draws)), jnp.min(ess), mc_error,
                             jnp.asarray(n), local,
                             draws.reshape(n, D) if self.keep_draws else None, extended)

    def __call__(self, q_cavity, q, data, mask, rng_key) -> LocalResult:
        m = self.moments(q_cavity, q, data, mask, rng_key)
        return LocalResult(m.tilted, jnp.full((), jnp.nan, m.rhat.dtype), m.rhat < self.max_rhat,
                           m.num_draws)


class ExactTilted(NamedTuple):
    """The tilted moments in closed form for a Gaussian likelihood affine in the global sites
    (:mod:`fedppl.algorithms.conjugate`): ``cavity * likelihood^alpha`` (moment-projected to a
    diagonal Gaussian for a mean-field guide). EP with it is exact in one undamped round."""

    model: Callable
    guide: PVIGuide
    max_rhat: float = jnp.inf

    def moments(self, cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                rng_key: Array, alpha: float = 1.0, local: g.Conditional | None = None
                ) -> TiltedMoments:
        lik = self.terms(data, mask)
        target = cast(g.FullGaussian, g.product(g.to_full(cavity),
                                                g.scale(conjugate.likelihood_factor(lik), alpha)))
        tilted = g.project_diag(target) if self.guide.diag else target
        nan = jnp.full((), jnp.nan, target.nat1.dtype)
        return TiltedMoments(tilted, nan, nan, nan, jnp.asarray(0))

    def terms(self, data: tuple, mask: Array) -> conjugate.GaussianLikelihood:
        """The client's Gaussian likelihood terms, read from the model."""
        layout = self.guide.layout_or_raise()
        return conjugate.likelihood_terms(client(self.model, mask=mask), layout, *data)

    def __call__(self, q_cavity, q, data, mask, rng_key) -> LocalResult:
        m = self.moments(q_cavity, q, data, mask, rng_key)
        return LocalResult(m.tilted, jnp.full((), jnp.nan, m.rhat.dtype), jnp.asarray(True),
                           jnp.asarray(1))


# -- the client step and the trio ------------------------------------------------------------------


def client_update(q: g.Gaussian, state: pvi.ClientState, data: tuple, mask: Array,
                  rng_key: Array, solver: TiltedSolver, damping: float | Array,
                  alpha: float = 1.0) -> tuple[EPMessage, pvi.ClientState]:
    """One (power) EP step on one client; returns the message and the proposed new state.

    A client whose chains did not mix (r-hat at or above ``solver.max_rhat``) skips its update:
    its message is a zero change (``converged`` False, which the round log records) and it keeps
    its site and its local guide; the next round samples afresh from the same cavity."""
    cavity, repaired = g.repair(g.quotient(q, g.scale(state.factor, alpha)))
    m = solver.moments(cavity, q, data, mask, rng_key, alpha, state.local)
    site = g.scale(g.quotient(m.tilted, cavity), 1.0 / alpha)
    mixed = ~(m.rhat >= solver.max_rhat)  # NaN (a closed form) counts as mixed
    def keep(a, b):  # the update where the chains mixed, the old state where they did not
        return jax.tree_util.tree_map(lambda x, y: jnp.where(mixed, x, y), a, b)

    new = keep(g.damp(state.factor, site, damping), state.factor)
    local = state.local if m.local is None or state.local is None else keep(m.local, state.local)
    msg = EPMessage(g.quotient(new, state.factor), jnp.full((), jnp.nan, m.rhat.dtype), repaired,
                    mixed, m.num_draws, m.rhat, m.ess, m.mc_error, m.draws,
                    jnp.asarray(m.extensions))
    return msg, state._replace(factor=new, local=local)


def decaying_damping(start: float = 0.5, end: float = 0.2, rate: float = 0.8
                     ) -> Callable[[Array], Array]:
    """``rho_r = end + (start - end) rate^r`` for round ``r = 0, 1, ...`` (ep-stan's decaying
    damping; with ``K`` clients, ``end = min(1 / K, 0.2)`` is its choice)."""

    def rho(r: Array) -> Array:
        return end + (start - end) * rate ** jnp.asarray(r)

    return rho


def make_trio(solver: TiltedSolver, damping: Damping, prior: g.Gaussian, *, alpha: float = 1.0,
              schedule: str = "synchronous", max_divergence: float = pvi.MAX_DIVERGENCE) -> Trio:
    """EP as a :class:`~fedppl.algorithms.trio.Trio`: PVI's (:func:`fedppl.algorithms.pvi.
    make_trio`, no line search) with :func:`client_update` as the client's step. ``damping`` is
    a float or a function of the round (``ServerState.round``, from 0: :func:`decaying_damping`).
    """
    base = pvi.make_trio(cast(pvi.LocalSolver, solver), 1.0, prior, schedule=schedule,
                         max_divergence=max_divergence)

    def client_step(server: pvi.ServerState, cstate: pvi.ClientState, data, mask, rng_key,
                    index):
        rho = damping(server.round) if callable(damping) else damping
        return client_update(server.q, cstate, data, mask, rng_key, solver, rho, alpha)

    return base._replace(client_update=client_step)
