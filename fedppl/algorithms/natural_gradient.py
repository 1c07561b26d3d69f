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
exact identity second moment, ``theta = m + L eps``), the same for every client and every round. The
local problem is then one deterministic function of ``q``, so the local step can be *solved* to a
tolerance, and no optimiser noise ends up in the factor ``t_k = q_k / q_cav``. Because
``lambda_lik`` is a sum over data points, the fixed point of PVI with this step is exactly the fixed
point of the same iteration on the pooled data (:class:`fedppl.GlobalVI` with the same draws):
clients split the sum, nothing else changes. The KL to the cavity is never estimated: it enters in
closed form through ``lambda_cav``.

Each iteration takes the largest step in ``beta, beta/2, ..., beta/2^10`` whose precision is
positive definite and which does not lower the local objective ``E_q[log p] - KL(q || q_cav)``
(with the same fixed draws) by more than a slack of 0.01 nats (plus ``1e-6``, or in float32
``100 eps``, of the objective's size, for its rounding); the slack covers the small gap, of Monte
Carlo size, between the fixed point and that objective's optimum. Where no damped step
is positive definite (a likelihood with positive curvature where q looks, as in a funnel or a
mixture) the step carries the second-order term of Lin, Schmidt and Khan (2020), ``Lambda + b G
+ (b^2/2) G Sigma G``, which is positive definite for every ``b`` and has the same fixed point.
Progress is measured by the residual ``KL(q_new || q_old) / step^2``, the length of a full step
(KL grows as the square of the step), so that a shrunken step cannot pass for convergence.
``beta`` is halved whenever the residual grows while the objective gains less than the slack (the
undamped iteration oscillates on hard problems, such as nearly separable classes) and grows by a
quarter, up to ``step_size``, otherwise (a drift along a flat valley, where the residual may grow
while the objective climbs, keeps its step). The solve stops
when the residual is at most ``tol`` (converged), after ``max_iters`` iterations, or when no step
is acceptable or ``beta`` falls below 2^-20 (all reported as not converged). ``tol`` is floored at
the residual that rounding alone leaves, ``10 eps^2 (D + m' Lambda m)`` for the dtype's ``eps``
(:func:`round_off`): two iterates that differ by a relative ``eps`` in their natural parameters
are that far apart. In float64 the floor is ~1e-29 and never binds; in float32 it is ~1e-12 for
a posterior mean a few standard deviations from zero, so a float32 solve converges where it can.

Local latent sites extend ``q`` to the client's joint over ``(theta, z_k)``: the cavity is flat in
``z_k`` (their prior is in the client's likelihood), and the factor is the joint's marginal over
``theta`` divided by the cavity.

Cost per iteration: ``S`` Hessians of the client's log-likelihood (``D`` forward-over-reverse
passes each) and one ``D x D`` Cholesky per step-size candidate; memory ``O(S D^2)``. A mean-field
guide's precision uses the Hessian's diagonal, and its mean a Newton step with the full expected
Hessian (see :func:`target`); its fixed point is still the mean-field stationarity condition.

Example::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import logistic_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(40, 2))
    >>> y = (X[:, 0] > 0) * 1.0
    >>> guide = fedppl.PVIGuide(model).setup(X, y)
    >>> solver = NaturalGradientSolver(model, guide, 32)       # 32 fixed draws
    >>> out = solver(guide.prior, guide.prior, (X, y), jax.numpy.ones(40, bool), jax.random.key(0))
    >>> bool(out.converged), out.q.nat1.shape                 # q over (w, b)
    (True, (3,))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.sites import cast_floats

__all__ = ["LocalResult", "NaturalGradientSolver", "PriorSolver", "base_draws",
           "depends_on", "expected_log_lik", "held_coordinates", "log_lik_fn", "round_off"]

STEP_HALVINGS = 11
MIN_STEP = 2.0**-20  # a solve whose step size fell below this stops, reported as not converged
SLACK = 1e-2  # nats a step may lower the local objective (plus 1e-6 of its size) and be taken
# ... or plus 100 eps of its size where the dtype rounds coarser than that (float32: 1.2e-5): two
# evaluations of a sum over N points at nearby q differ by a few eps of the sum's size


class LocalResult(NamedTuple):
    """What a local solver returns: the new ``q_k`` (over the global sites), its local free
    energy, whether the solve met its tolerance, how many iterations (or steps, or sweeps) it
    took, and the client's new private guide over its local sites (None without them)."""

    q: g.Gaussian
    free_energy: Array
    converged: Array
    iterations: Array
    local: g.Conditional | None = None
    parties: g.Gaussian | None = None  # DP-PVI's virtual parties' new factors (stacked)


def base_draws(num_draws: int, dim: int, dtype, seed: int = 0) -> Array:
    """``num_draws`` standard normal vectors in antithetic pairs (``num_draws`` must be even).

    The pairs make the draws' mean exactly zero; when there are more pairs than dimensions the
    draws are also whitened, so that their second moment is exactly the identity. Expectations of
    quadratic functions (and so the whole step for a Gaussian likelihood) are then exact, and
    the Monte Carlo error of the rest is smaller.
    """
    # drawn in float32 whatever the dtype, so that float32 and float64 runs share their draws
    half = jax.random.normal(jax.random.key(seed), (num_draws // 2, dim), jnp.float32)
    half = half.astype(jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32)
    if num_draws // 2 > dim:
        chol = jnp.linalg.cholesky(half.T @ half / (num_draws // 2))
        half = jax.scipy.linalg.solve_triangular(chol, half.T, lower=True).T
    return jnp.concatenate([half, -half]).astype(dtype)


def log_lik_fn(model: Callable, guide: PVIGuide, data: tuple, mask: Array
               ) -> Callable[[Array, Array], Array]:
    """``(phi, seed) -> log p(y_k, z_k | theta)``: the client's masked observed log density at the
    flat unconstrained vector ``phi = (theta, z_k)`` of its global and (if the guide has any)
    local sites, with the local sites' prior densities and Jacobians. ``seed`` is the draw's
    index: a subsampling data plate takes its minibatch from it (see
    :class:`~fedppl.handlers.client.client`).

    A local coordinate that none of the client's observations depends on (a group this client
    holds no data for, kept so that every client's local sites have one shape) is marginalised
    out exactly: its prior term is replaced by a standard normal in its own coordinate, so the
    client's optimum there is that normal, independent of ``theta``, and it adds nothing to the
    free energy. Kept in, its prior term would inform the group scale through the Gaussian
    approximation of an integral that is 1 (each such group shrinks the variance of log tau).

    A guide with a ``log_lik_fn(model, data, mask)`` method (the Pyro port's
    :class:`fedppl.pyro.PVIGuide`) gives the function itself: every local step of the core then
    runs on its PPL's model.
    """
    hook = getattr(guide, "log_lik_fn", None)
    if hook is not None:  # a guide over another PPL's model (fedppl.pyro) evaluates its own
        return hook(model, data, mask)
    layout, loc = guide.layout_or_raise(), guide.local_layout
    D = layout.dim
    data = cast_floats(data, layout.dtype)  # float32 data meet a float32 theta, not float64

    def scoped(seed):
        return client(model, mask=mask, draw=seed)

    if loc is None:
        def global_only(phi: Array, seed: Array | int = 0) -> Array:
            return _observed(_trace(scoped(seed), layout.constrain(phi), data), layout.dtype)

        return global_only

    def trace(phi, seed):
        values = layout.constrain(phi[:D])
        values.update(loc.constrain(phi[D:]))
        return _trace(scoped(seed), values, data)

    def observed(phi, seed):
        return _observed(trace(phi, seed), dtype)

    dtype = layout.dtype
    touched = depends_on(observed, D + loc.dim, dtype)[D:]

    def log_lik(phi: Array, seed: Array | int = 0) -> Array:
        tr = trace(phi, seed)
        total = _observed(tr, dtype)
        z = phi[D:]
        for s in loc.sites:
            u = z[s.slice]
            here = touched[s.slice]
            std = -0.5 * (u**2 + jnp.log(2 * jnp.pi))
            value = tr[s.name]["value"]
            lp = tr[s.name]["fn"].log_prob(value)
            ladj = s.transform.log_abs_det_jacobian(u.reshape(s.unconstrained_shape), value)
            if jnp.shape(lp) == s.shape and jnp.shape(ladj) == s.shape and s.size == lp.size:
                exact = jnp.reshape(lp + ladj, (-1,))  # one term per coordinate
                total = total + jnp.sum(jnp.where(here, exact, std))
            else:  # terms that do not split by coordinate: the whole site or nothing
                total = total + jnp.where(jnp.any(here), jnp.sum(lp) + jnp.sum(ladj),
                                          jnp.sum(std))
        return total.astype(dtype)

    return log_lik


def held_coordinates(model: Callable, guide: PVIGuide, data: tuple, mask: Array) -> Array:
    """``(d,)`` booleans over the client's local coordinates: True where its observations
    depend on them (the groups it holds data for). :func:`log_lik_fn` integrates the others
    out; a result draws them from the model's prior given the global sites."""
    layout, loc = guide.layout_or_raise(), guide.local_layout
    if loc is None:
        raise ValueError("the model has no local sites")
    D, dtype = layout.dim, layout.dtype
    data = cast_floats(data, dtype)

    def observed(phi, seed):
        values = layout.constrain(phi[:D])
        values.update(loc.constrain(phi[D:]))
        return _observed(_trace(client(model, mask=mask, draw=seed), values, data), dtype)

    return depends_on(observed, D + loc.dim, dtype)[D:]


def depends_on(f: Callable[[Array, int], Array], dim: int, dtype) -> Array:
    """``(dim,)`` booleans: the coordinates of ``phi`` that ``f(phi, 0)`` depends on (its
    gradient at two generic points); a client's log-likelihood does not depend on the
    coordinates of groups it holds no data for."""
    probe = [c + 0.05 * jnp.arange(dim, dtype=dtype) for c in (0.1, -0.3)]
    grads = [jnp.abs(jax.grad(f)(p, 0)) for p in probe]
    return (grads[0] + grads[1]) > 0


def data_dtype(data: tuple):
    """The floating dtype the client's arrays compute in (float64 under x64)."""
    floats = [jnp.result_type(a) for a in data if jnp.issubdtype(jnp.result_type(a), jnp.floating)]
    return floats[0] if floats else jnp.result_type(float)


def _trace(model: Callable, values: dict, data: tuple) -> dict:
    from numpyro import handlers

    return handlers.trace(handlers.substitute(handlers.seed(model, 0), data=values)).get_trace(
        *data)


def _observed(tr: dict, dtype) -> Array:
    """The trace's observed log density, in ``dtype``: numpyro turns a Python-float parameter
    next to an array one into a float64 NumPy array under x64 (``Normal(X @ w, 0.5)``), and the
    client handler's ``num_data`` scale is float64 there too, so a float32 ``theta`` would
    otherwise come back as a float64 log density (and objective, and free energy)."""
    total = jnp.zeros((), dtype)
    for site in tr.values():
        if site["type"] == "sample" and site["is_observed"]:
            lp = jnp.sum(site["fn"].log_prob(site["value"]))
            total = total + (lp if site["scale"] is None else site["scale"] * lp)
    return jnp.asarray(total, dtype)


def expected_log_lik(log_lik: Callable[[Array, Array], Array], q: g.Gaussian, eps: Array
                     ) -> Array:
    """``E_q[log p(y | theta)]`` by the reparametrised draws ``theta = m + L eps``; draw ``s``
    seeds the model with ``s`` (a fixed minibatch per draw for subsampling models)."""
    seeds = jnp.arange(eps.shape[0])
    return jnp.mean(jax.vmap(log_lik)(_draws(q, eps)[1], seeds))


class NaturalGradientSolver(NamedTuple):
    """Client ``k``'s local free energy solved by natural-gradient fixed-point iteration.

    :param model: the NumPyro model.
    :param guide: the :class:`PVIGuide` (set up); its family decides full or diagonal updates,
        its local sites (if any) extend ``q`` to the client's joint over ``(theta, z_k)``.
    :param num_draws: ``S``, the fixed base draws (even; antithetic pairs).
    :param max_iters: cap on iterations per local step.
    :param tol: converged when the residual ``KL(q_new || q_old) / step^2`` (module doc) is at
        most ``tol`` (or at the dtype's rounding floor, :func:`round_off`, if that is larger).
    :param seed: seed of the base draws (the same for every client and round).
    :param step_size: the first iteration's ``beta``.
    :param extra: an optional term over ``theta`` added to the client's log-likelihood
        (``GlobalVI`` adds the prior correction of :func:`fedppl.sites.prior_correction`).
    :param hessian: how the curvature of ``extra`` is estimated (``"pointwise"`` or ``"stein"``,
        see :class:`PriorSolver`); the data term's is always pointwise.
    """

    model: Callable
    guide: PVIGuide
    num_draws: int = 128
    max_iters: int = 100
    tol: float = 1e-10
    seed: int = 0
    step_size: float = 1.0
    extra: Callable[[Array], Array] | None = None
    hessian: str = "pointwise"

    def _extra(self) -> tuple[Callable, str] | None:
        """``extra`` as a term over ``phi`` with its curvature estimator, or None."""
        if self.extra is None:
            return None
        D = self.guide.layout_or_raise().dim
        return (lambda phi, seed=0: self.extra(phi[:D]), self.hessian)

    def draws(self, dim: int, dtype) -> Array:
        """The fixed base draws (:func:`base_draws`, or the guide's own ``base_draws``: the Pyro
        port draws them with torch's generator)."""
        return getattr(self.guide, "base_draws", base_draws)(self.num_draws, dim, dtype,
                                                             self.seed)

    def log_lik(self, data: tuple, mask: Array) -> Callable[[Array, Array], Array]:
        """The client's log density over ``phi``, with ``extra`` added."""
        log_lik, extra = log_lik_fn(self.model, self.guide, data, mask), self._extra()
        return log_lik if extra is None else _sum(log_lik, extra[0])

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                 rng_key: Array, local: g.Conditional | None = None) -> LocalResult:
        """Solve the local problem from ``q``; with local sites, over the client's joint
        ``q(theta) local(z | theta)`` against the cavity (flat in ``z``), returning the
        marginal over ``theta`` (moment-projected for a mean-field guide) and the new
        conditional."""
        del rng_key  # deterministic: the base draws are fixed
        log_lik, extra = log_lik_fn(self.model, self.guide, data, mask), self._extra()
        if local is None:
            eps = self.draws(q.dim, q.nat1.dtype)
            return solve(log_lik, q_cavity, q, eps, self.max_iters, self.tol, self.step_size,
                         extra=extra)
        D, d, diag = q.dim, local.nat1.shape[-1], self.guide.client_diag
        cavity = g.embed(q_cavity if diag else g.to_full(q_cavity), d)
        eps = self.draws(D + d, q.nat1.dtype)
        out = solve(log_lik, cavity, g.join(q, local, diag), eps, self.max_iters, self.tol,
                    self.step_size, num_global=D, structure=self.guide.structure(),
                    extra=extra)
        marginal, conditional = g.split(out.q, D)
        return out._replace(q=g.project_moments(marginal, self.guide.diag), local=conditional)

    def expected_log_lik(self, q: g.Gaussian, data: tuple, mask: Array,
                         local: g.Conditional | None = None) -> Array:
        """The client's ``E_q[log p(y_k, z_k | theta)]`` with the solver's fixed draws (the
        server's line search sums these into the global ELBO); with local sites, under
        ``q(theta) local(z_k | theta)``, plus the entropy of ``local``."""
        if local is None:
            eps = self.draws(q.dim, q.nat1.dtype)
            return expected_log_lik(self.log_lik(data, mask), q, eps)
        joint = g.join(q, local, self.guide.client_diag)
        eps = self.draws(joint.dim, q.nat1.dtype)
        return (expected_log_lik(self.log_lik(data, mask), joint, eps)
                + g.conditional_entropy(local))


class PriorSolver(NamedTuple):
    """The server's step on the prior factor ``t_0``: the local problem of a "client" whose
    log-likelihood is the prior correction ``log p(theta) + log|J| - log p~(theta)`` (no data).

    ``hessian="stein"`` estimates ``E[H]`` from gradients (``E[Sigma^-1 (theta - m) g']``, Stein's
    lemma), which sees the curvature of a kink (a Laplace prior at zero) that pointwise Hessians,
    zero almost everywhere, miss.
    """

    correction: Callable[[Array], Array]
    num_draws: int = 128
    max_iters: int = 100
    tol: float = 1e-10
    seed: int = 0
    hessian: str = "pointwise"

    def _log_lik(self, theta: Array, seed: Array | int = 0) -> Array:
        return self.correction(theta)

    def __call__(self, q_cavity, q, data, mask, rng_key) -> LocalResult:
        eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
        return solve(self._log_lik, q_cavity, q, eps, self.max_iters, self.tol,
                     hessian=self.hessian)

    def expected_log_lik(self, q, data=None, mask=None) -> Array:
        eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
        return expected_log_lik(self._log_lik, q, eps)


def solve(log_lik: Callable[[Array, Array], Array], q_cavity: g.Gaussian, q_init: g.Gaussian,
          eps: Array, max_iters: int, tol: float, step_size: float = 1.0,
          num_global: int | None = None, structure: Array | None = None,
          hessian: str = "pointwise", extra: tuple[Callable, str] | None = None) -> LocalResult:
    """Iterate ``q <- damp(q, q_cav * t(q), beta)`` from ``q_init`` (see module doc).

    With local coordinates (``num_global < q.dim``) the cavity is flat in them and the free
    energy is ``E_q[log p(y, z | theta)] - KL(q(theta) || q_cav) + H[q(z | theta)]``.
    ``extra = (fn, hessian)`` adds a term to ``log_lik`` whose curvature is estimated its own
    way (the prior correction, when GlobalVI folds it in).
    """
    terms = ((log_lik, hessian),) + ((extra,) if extra is not None else ())
    if extra is not None:
        log_lik = _sum(log_lik, extra[0])
    dtype = q_init.nat1.dtype
    rel_slack = max(SLACK * 1e-4, 100 * float(jnp.finfo(dtype).eps))
    betas = jnp.asarray([2.0**-i for i in range(STEP_HALVINGS)], dtype)
    inf = jnp.asarray(jnp.inf, dtype)

    def objective(q):
        ell = expected_log_lik(log_lik, q, eps)
        if num_global is None or num_global == q.dim:
            return ell - g.kl(q, q_cavity)
        marginal, conditional = g.split(q, num_global)
        return (ell - g.kl(marginal, g.head(q_cavity, num_global))
                + g.conditional_entropy(conditional))

    def body(state):
        q, beta, last, i, _, f_old = state
        aim = target(terms, q_cavity, q, eps, structure)
        steps = beta * betas
        candidates = jax.vmap(lambda b: g.damp(q, aim, b))(steps)
        pd = g.is_pd(candidates) & g.is_finite(candidates)
        # where no damped step is positive definite (the target is not: the likelihood's
        # curvature is positive somewhere q looks, as in a funnel), take the step with the
        # second-order correction that keeps it so (Lin, Schmidt and Khan 2020)
        pd, candidates = jax.lax.cond(
            jnp.any(pd), lambda: (pd, candidates),
            lambda: _corrected_steps(q, aim, steps))
        # backtrack to the first positive-definite step that does not lower the objective
        # (beyond a slack for the gap between the fixed point and the objective's optimum)
        floor = f_old - SLACK - rel_slack * jnp.abs(f_old)

        def look(c):
            j, _, _ = c
            cj = jax.tree_util.tree_map(lambda x: x[j], candidates)
            fj = jax.lax.cond(pd[j], objective, lambda _: -inf, cj)
            found = fj >= floor
            return jnp.where(found, j, j + 1), found, fj

        pick, ok, f_new = jax.lax.while_loop(
            lambda c: (c[0] < STEP_HALVINGS) & ~c[1], look,
            (jnp.asarray(0), jnp.asarray(False), -inf))
        pick = jnp.minimum(pick, STEP_HALVINGS - 1)
        q_new = jax.tree_util.tree_map(lambda c: c[pick], candidates)
        q_new = jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), q_new, q)
        change = jnp.where(ok, g.kl(q_new, q), inf)
        # the full step's length, estimated from the damped one (KL grows as the step squared),
        # so that a small step size cannot pass for convergence
        residual = change / steps[pick] ** 2
        # an oscillation: the residual grew while the objective hardly moved. A residual that
        # grows while the objective climbs is a drift along a valley, and keeps its step.
        gain = jnp.where(ok, f_new - f_old, 0.0)
        beta = jnp.where((residual > last) & (i > 0) & (gain < SLACK), 0.5 * beta,
                         jnp.minimum(1.25 * beta, step_size))
        return (q_new, beta, residual, i + 1, ok & (beta > MIN_STEP),
                jnp.where(ok, f_new, f_old))

    def cond(state):
        q, _, residual, i, ok, _ = state
        return (i < max_iters) & (residual > jnp.maximum(tol, round_off(q))) & ok

    init = (q_init, jnp.asarray(step_size, dtype), inf, jnp.asarray(0), jnp.asarray(True),
            objective(q_init))
    q, _, residual, iters, _, free_energy = jax.lax.while_loop(cond, body, init)
    return LocalResult(q, free_energy, residual <= jnp.maximum(tol, round_off(q)), iters)


def round_off(q: g.Gaussian) -> Array:
    """``10 eps^2 (D + m' Lambda m)``: about the ``KL`` between ``q`` and ``q`` with its natural
    parameters perturbed by a relative ``eps`` (the dtype's), the smallest residual a solve in
    that dtype can resolve (~1e-12 in float32 for ``m' Lambda m`` ~ 100, ~1e-29 in float64)."""
    eps = jnp.finfo(q.nat1.dtype).eps
    mean, _ = g.to_moments(q)
    size = jnp.abs(jnp.sum(q.nat1 * mean, axis=-1))
    return 10 * eps**2 * (q.dim + jnp.where(jnp.isfinite(size), size, 0.0))


def _expected_derivatives(log_lik: Callable, kind: str, q: g.Gaussian, eps: Array,
                          theta: Array) -> tuple[Array, Array]:
    """``E_q[grad]`` and ``E_q[Hessian]`` of ``log_lik`` over the draws ``theta = m + L eps``:
    pointwise Hessians, or (``"stein"``) ``L^-T E[eps grad']`` from gradients alone."""
    seeds = jnp.arange(eps.shape[0])
    if kind == "stein":
        grads = jax.vmap(jax.grad(log_lik))(theta, seeds)
        cross = eps.T @ grads / eps.shape[0]  # E[eps g'] = L' E[H]
        _, sc = g.mean_and_scale_tril(q)
        if isinstance(q, g.DiagGaussian):
            return jnp.mean(grads, axis=0), cross / sc[:, None]
        return jnp.mean(grads, axis=0), jax.scipy.linalg.solve_triangular(sc.T, cross,
                                                                          lower=False)
    grads, hess = jax.vmap(lambda t, s: (jax.grad(log_lik)(t, s),
                                         jax.hessian(log_lik)(t, s)))(theta, seeds)
    return jnp.mean(grads, axis=0), jnp.mean(hess, axis=0)


def _corrected_steps(q: g.Gaussian, aim: g.Gaussian, steps: Array) -> tuple[Array, g.Gaussian]:
    """Steps ``Lambda + b G + (b^2 / 2) G Sigma G`` (``G`` the precision's full step, ``Sigma``
    q's covariance), positive definite for every ``b``, with the mean moved ``b Lambda'^-1 r``
    along the natural gradient ``r = aim.nat1 - aim.prec m``; the fixed point is unchanged."""
    mean, cov = g.to_moments(q)
    G = aim.prec - q.prec
    r = aim.nat1 - (aim.prec * mean if isinstance(q, g.DiagGaussian) else aim.prec @ mean)
    quad = G * cov * G if isinstance(q, g.DiagGaussian) else G @ cov @ G

    def one(b):
        prec = q.prec + b * G + 0.5 * b**2 * quad
        if isinstance(q, g.DiagGaussian):
            return g.DiagGaussian(prec * mean + b * r, prec)
        return g.FullGaussian(prec @ mean + b * r, 0.5 * (prec + prec.T))

    candidates = jax.vmap(one)(steps)
    return g.is_pd(candidates) & g.is_finite(candidates), candidates


def _sum(f: Callable, h: Callable) -> Callable:
    return lambda phi, seed=0: f(phi, seed) + h(phi, seed)


def target(terms, q_cavity: g.Gaussian, q: g.Gaussian, eps: Array, structure: Array | None = None
           ) -> g.Gaussian:
    """Where one full natural-gradient step from ``q`` lands (module doc).

    ``terms`` is a log-likelihood ``(phi, seed) -> value``, or pairs ``(log_lik, hessian)`` whose
    expected gradients and Hessians add up (``hessian`` ``"pointwise"`` or ``"stein"``).

    Full rank: ``q_cav`` times the likelihood site ``(E[g] - E[H] m, -E[H])``. Mean-field: the
    precision is the diagonal of ``P = Lambda_cav - E[H]`` (the mean-field stationarity
    condition), and the mean takes a Newton step with the full ``P``; the diagonal-only step
    would be a Jacobi iteration, which diverges when the sites are strongly correlated. A
    ``structure`` (a boolean mask of the precision entries q may have, e.g. a client's global and
    local blocks kept independent) works the same way: precision ``structure * P``, Newton mean.
    """
    if callable(terms):
        terms = ((terms, "pointwise"),)
    mean, theta = _draws(q, eps)
    (eg, eh), *rest = [_expected_derivatives(fn, kind, q, eps, theta) for fn, kind in terms]
    for g_k, h_k in rest:
        eg, eh = eg + g_k, eh + h_k
    eh = 0.5 * (eh + eh.T)
    if isinstance(q, g.FullGaussian) and structure is None:
        return g.product(q_cavity, g.FullGaussian(eg - eh @ mean, -eh))
    cav_prec = g.to_full(q_cavity).prec
    prec = cav_prec - eh
    resid = eg - (cav_prec @ mean - q_cavity.nat1)
    chol = jnp.linalg.cholesky(prec)
    newton = jax.scipy.linalg.cho_solve((chol, True), resid)
    kept = jnp.diag(jnp.diagonal(prec)) if structure is None else jnp.where(structure, prec, 0.0)
    step = jnp.where(jnp.all(jnp.isfinite(newton)), newton,
                     resid / jnp.diagonal(prec))
    new_mean = mean + step
    if isinstance(q, g.DiagGaussian):
        diag = jnp.diagonal(prec)
        return g.DiagGaussian(diag * new_mean, diag)
    return g.FullGaussian(kept @ new_mean, kept)


def _draws(q: g.Gaussian, eps: Array) -> tuple[Array, Array]:
    """q's mean and the draws ``theta = m + L eps`` (one factorisation for both)."""
    mean, sc = g.mean_and_scale_tril(q)
    if isinstance(q, g.DiagGaussian):
        return mean, mean + eps * sc
    return mean, mean + eps @ sc.T
