"""The default PVI local step: natural-gradient ascent on a deterministic local free energy.

Client ``k`` maximises ``F_k(q) = E_q[log p(y_k | theta)] - KL(q || q_cav)`` over Gaussians ``q``.
For a Gaussian, the natural gradient of ``F_k`` with respect to the mean parameters is the
difference ``lambda_cav + lambda_lik(q) - lambda_q`` of natural parameters, where by Bonnet's and
Price's theorems the likelihood's "site" is

    precision  -E_q[H],     nat1  E_q[g] - E_q[H] m_q,      g, H = grad, Hessian of log p(y_k | .)

so the optimum is the fixed point ``q = q_cav * t(q)`` and a step of size ``beta`` is
``lambda <- (1 - beta) lambda + beta (lambda_cav + lambda_lik(q))`` (Khan and Lin's conjugate-
computation VI / the Bayesian learning rule). A Gaussian likelihood affine in ``theta`` is solved
in one step; a log-concave one converges like Newton's method.

The expectations use ``S`` fixed base draws ``eps`` (antithetic pairs ``+-eps``, whitened to an
exact identity second moment, ``theta = m + L eps``), the same for every client and every round. The local problem is then one deterministic
function of ``q``, so the local step can be *solved* to a tolerance, and no optimiser noise ends up
in the factor ``t_k = q_k / q_cav``. Because ``lambda_lik`` is a sum over data points, the fixed
point of PVI with this step is exactly the fixed point of the same iteration on the pooled data
(:class:`fedppl.GlobalVI` with the same draws): clients split the sum, nothing else changes. The
KL to the cavity is never estimated: it enters in closed form through ``lambda_cav``.

Each iteration takes the largest step in ``beta, beta/2, ..., beta/2^10`` whose precision is
positive definite (a step towards a positive-definite target always is). Its progress is measured
by the residual ``KL(q_new || q_old) / step^2``, the length of a full step (KL grows as the square
of the step), so that a shrunken step cannot pass for convergence. ``beta`` is halved whenever
the residual grew (the undamped iteration oscillates on hard problems, such as nearly separable
classes or a likelihood that is not log-concave) and grows by a quarter, up to ``step_size``,
whenever it shrank. The solve stops when the residual is at most ``tol`` (converged), after
``max_iters`` iterations, or when ``beta`` falls below 2^-20 (both reported as not converged).

Cost per iteration: ``S`` Hessians of the client's log-likelihood (``D`` forward-over-reverse
passes each) and one ``D x D`` Cholesky per step-size candidate; memory ``O(S D^2)``. A mean-field
guide's precision uses the Hessian's diagonal, and its mean a Newton step with the full expected
Hessian (see :func:`target`); its fixed point is still the mean-field stationarity condition.

Example::

    >>> solver = NaturalGradientSolver(model, guide.setup(X, y), num_draws=32)
    >>> out = solver(q_cavity, q, (X_k, y_k), mask_k, key)   # out.q, out.converged, ...
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client

__all__ = ["LocalResult", "NaturalGradientSolver", "base_draws", "expected_log_lik",
           "log_lik_fn"]

STEP_HALVINGS = 11
MIN_STEP = 2.0**-20  # a solve whose step size fell below this stops, reported as not converged


class LocalResult(NamedTuple):
    """What a local solver returns: the new ``q_k``, its local free energy, whether the solve met
    its tolerance, and how many iterations (or steps, or sweeps) it took."""

    q: g.Gaussian
    free_energy: Array
    converged: Array
    iterations: Array


def base_draws(num_draws: int, dim: int, dtype, seed: int = 0) -> Array:
    """``num_draws`` standard normal vectors in antithetic pairs (``num_draws`` must be even).

    The pairs make the draws' mean exactly zero; when there are more pairs than dimensions the
    draws are also whitened, so that their second moment is exactly the identity. Expectations of
    quadratic functions (and so the whole step for a Gaussian likelihood) are then exact, and
    the Monte Carlo error of the rest is smaller.
    """
    # drawn in float32 whatever the dtype, so that float32 and float64 runs share their draws
    half = jax.random.normal(jax.random.key(seed), (num_draws // 2, dim), jnp.float32)
    half = half.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    if num_draws // 2 > dim:
        chol = jnp.linalg.cholesky(half.T @ half / (num_draws // 2))
        half = jax.scipy.linalg.solve_triangular(chol, half.T, lower=True).T
    return jnp.concatenate([half, -half]).astype(dtype)


def log_lik_fn(model: Callable, guide: PVIGuide, data: tuple, mask: Array
               ) -> Callable[[Array], Array]:
    """``theta -> log p(y_k | theta)``: the client's masked observed log density at the flat
    unconstrained global vector ``theta``."""
    from fedppl.algorithms.pvi import observed_log_lik

    local = client(model, mask=mask)
    return lambda theta: observed_log_lik(local, guide.layout.constrain(theta), *data)


def expected_log_lik(log_lik: Callable[[Array], Array], q: g.Gaussian, eps: Array) -> Array:
    """``E_q[log p(y | theta)]`` by the reparametrised draws ``theta = m + L eps``."""
    return jnp.mean(jax.vmap(log_lik)(_draws(q, eps)[1]))


class NaturalGradientSolver(NamedTuple):
    """Client ``k``'s local free energy solved by natural-gradient fixed-point iteration.

    :param model: the NumPyro model.
    :param guide: the :class:`PVIGuide` (set up); its family decides full or diagonal updates.
    :param num_draws: ``S``, the fixed base draws (even; antithetic pairs).
    :param max_iters: cap on iterations per local step.
    :param tol: converged when the residual ``KL(q_new || q_old) / step^2`` (module doc) is at
        most ``tol``.
    :param seed: seed of the base draws (the same for every client and round).
    :param step_size: the first iteration's ``beta``.
    """

    model: Callable
    guide: PVIGuide
    num_draws: int = 128
    max_iters: int = 100
    tol: float = 1e-10
    seed: int = 0
    step_size: float = 1.0

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                 rng_key: Array) -> LocalResult:
        del rng_key  # deterministic: the base draws are fixed
        log_lik = log_lik_fn(self.model, self.guide, data, mask)
        eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
        return solve(log_lik, q_cavity, q, eps, self.max_iters, self.tol, self.step_size)

    def expected_log_lik(self, q: g.Gaussian, data: tuple, mask: Array) -> Array:
        """The client's ``E_q[log p(y_k | theta)]`` with the solver's fixed draws (the server's
        line search sums these into the global ELBO)."""
        eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
        return expected_log_lik(log_lik_fn(self.model, self.guide, data, mask), q, eps)


def solve(log_lik: Callable[[Array], Array], q_cavity: g.Gaussian, q_init: g.Gaussian, eps: Array,
          max_iters: int, tol: float, step_size: float = 1.0) -> LocalResult:
    """Iterate ``q <- damp(q, q_cav * t(q), beta)`` from ``q_init`` (see module doc)."""
    dtype = q_init.nat1.dtype
    betas = jnp.asarray([2.0**-i for i in range(STEP_HALVINGS)], dtype)
    inf = jnp.asarray(jnp.inf, dtype)

    def body(state):
        q, beta, last, i, _ = state
        aim = target(log_lik, q_cavity, q, eps)
        steps = beta * betas
        candidates = jax.vmap(lambda b: g.damp(q, aim, b))(steps)
        pd = g.is_pd(candidates) & g.is_finite(candidates)
        pick = jnp.argmax(pd)
        q_new = jax.tree_util.tree_map(lambda c: c[pick], candidates)
        ok = jnp.any(pd)
        q_new = jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), q_new, q)
        change = jnp.where(ok, g.kl(q_new, q), inf)
        # the full step's length, estimated from the damped one (KL grows as the step squared),
        # so that a small step size cannot pass for convergence
        residual = change / steps[pick] ** 2
        beta = jnp.where((residual > last) & (i > 0), 0.5 * beta,
                         jnp.minimum(1.25 * beta, step_size))
        return q_new, beta, residual, i + 1, ok & (beta > MIN_STEP)

    def cond(state):
        _, _, residual, i, ok = state
        return (i < max_iters) & (residual > tol) & ok

    init = (q_init, jnp.asarray(step_size, dtype), inf, jnp.asarray(0), jnp.asarray(True))
    q, _, residual, iters, _ = jax.lax.while_loop(cond, body, init)
    free_energy = expected_log_lik(log_lik, q, eps) - g.kl(q, q_cavity)
    return LocalResult(q, free_energy, residual <= tol, iters)


def target(log_lik: Callable[[Array], Array], q_cavity: g.Gaussian, q: g.Gaussian, eps: Array
           ) -> g.Gaussian:
    """Where one full natural-gradient step from ``q`` lands (module doc).

    Full rank: ``q_cav`` times the likelihood site ``(E[g] - E[H] m, -E[H])``. Mean-field: the
    precision is the diagonal of ``P = Lambda_cav - E[H]`` (the mean-field stationarity
    condition), and the mean takes a Newton step with the full ``P``; the diagonal-only step
    would be a Jacobi iteration, which diverges when the sites are strongly correlated.
    """
    mean, theta = _draws(q, eps)
    grads, hess = jax.vmap(lambda t: (jax.grad(log_lik)(t), jax.hessian(log_lik)(t)))(theta)
    eg, eh = jnp.mean(grads, axis=0), jnp.mean(hess, axis=0)
    eh = 0.5 * (eh + eh.T)
    if isinstance(q, g.FullGaussian):
        return g.product(q_cavity, g.FullGaussian(eg - eh @ mean, -eh))
    cav_mean, _ = g.to_moments(q_cavity)
    prec = jnp.diag(q_cavity.prec) - eh
    resid = eg - q_cavity.prec * (mean - cav_mean)
    chol = jnp.linalg.cholesky(prec)
    newton = jax.scipy.linalg.cho_solve((chol, True), resid)
    diag = jnp.diagonal(prec)
    step = jnp.where(jnp.all(jnp.isfinite(newton)), newton, resid / diag)
    return g.DiagGaussian(diag * (mean + step), diag)


def _draws(q: g.Gaussian, eps: Array) -> tuple[Array, Array]:
    """q's mean and the draws ``theta = m + L eps`` (one factorisation for both)."""
    mean, sc = g.mean_and_scale_tril(q)
    if isinstance(q, g.DiagGaussian):
        return mean, mean + eps * sc
    return mean, mean + eps @ sc.T
