"""The default PVI local step in torch: natural-gradient ascent on a deterministic free energy.

The twin of :mod:`fedppl.algorithms.natural_gradient` (read its module doc for the method): each
client iterates ``q <- damp(q, q_cav * t(q), beta)``, the likelihood's site ``t(q)`` read from the
expected gradient and Hessian of its log-likelihood over ``S`` fixed antithetic, whitened base
draws, with a backtracking step size, a second-order correction where no damped step is positive
definite, and a stop when the residual ``KL(q_new || q_old) / step^2`` is below ``tol``.

Every function here works on a batch of clients at once (leading axis ``K``): the expectations
come from one ``torch.func.vmap`` over clients and draws (:func:`~fedppl.pyro.algorithms.terms.
per_client`), and the iteration is the vectorised form of JAX's ``vmap`` of a ``while_loop``:
every client steps until it stops, a stopped client's state is frozen, and the loop ends when all
have stopped. A client's answer does not depend on which others share its batch.

The base draws come from torch's generator (``seed``), not JAX's, so this solver and the NumPyro
core's reach fixed points that differ by their Monte Carlo error (``tests/pyro``).

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from fedppl.pyro.guides import PVIGuide
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    >>> X = torch.randn(2, 30, 2, dtype=torch.float64)       # two clients
    >>> y = (X[..., 0] > 0).double()
    >>> guide = PVIGuide(model, dtype=torch.float64).setup(X[0], y[0])
    >>> solver = NaturalGradientSolver(model, guide, 32)
    >>> ctx = solver.prepare((X, y), torch.ones(2, 30, dtype=torch.bool))
    >>> prior = g.DiagGaussian(*(x.expand(2, 2) for x in guide.prior))
    >>> out = solver(prior, prior, ctx)
    >>> out.converged.tolist(), tuple(out.q.nat1.shape)
    ([True, True], (2, 2))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedppl.pyro.algorithms.terms import (
    ClientContext,
    LogLik,
    per_client,
    per_client_derivatives,
)
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.sites import vmap

__all__ = ["LocalResult", "NaturalGradientSolver", "PriorSolver", "base_draws", "solve",
           "round_off", "Terms"]

STEP_HALVINGS = 11
MIN_STEP = 2.0**-20
SLACK = 1e-2


class LocalResult(NamedTuple):
    """What a local solver returns (batched over clients): the new ``q_k``, its local free
    energy, whether the solve met its tolerance, its iterations, and the clients' new private
    guides over their local sites (None without them)."""

    q: g.Gaussian
    free_energy: Tensor
    converged: Tensor
    iterations: Tensor
    local: g.Conditional | None = None


def base_draws(num_draws: int, dim: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    """``num_draws`` standard normal vectors in antithetic pairs, whitened to an exact identity
    second moment when there are more pairs than dimensions (torch's generator, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    half = torch.randn((num_draws // 2, dim), generator=gen, dtype=torch.float32).double()
    if num_draws // 2 > dim:
        chol = torch.linalg.cholesky(half.T @ half / (num_draws // 2))
        half = torch.linalg.solve_triangular(chol, half.T, upper=False).T
    return torch.cat([half, -half]).to(dtype)


class Terms:
    """The log-likelihood terms of a batch of clients: a data term (``lik`` with the clients'
    ``ctx``) and an optional ``extra`` term over ``theta`` alone (``(fn, hessian)``: the prior
    correction, curvature ``"pointwise"`` or ``"stein"``)."""

    def __init__(self, lik: Callable | None, ctx: ClientContext | None,
                 extra: tuple[Callable[[Tensor], Tensor], str] | None = None,
                 num_global: int | None = None, hessian: str = "pointwise"):
        self.lik, self.ctx, self.extra = lik, ctx, extra
        self.num_global = num_global
        self.hessian = hessian

    def _extra_fn(self) -> Callable[[Tensor], Tensor]:
        assert self.extra is not None
        fn, D = self.extra[0], self.num_global
        return (lambda phi: fn(phi[:D])) if D is not None else fn

    def value(self, phi: Tensor) -> Tensor:
        """Log-likelihood at the points ``phi`` ``(K, M, P)``: ``(K, M)``."""
        out = torch.zeros(phi.shape[:2], dtype=phi.dtype)
        if self.lik is not None:
            assert self.ctx is not None
            out = out + per_client(self.lik, phi, self.ctx, _seeds(phi))
        if self.extra is not None:
            flat = phi.reshape(-1, phi.shape[-1])
            out = out + vmap(self._extra_fn())(flat).reshape(phi.shape[:2])
        return out

    def derivatives(self, q: g.Gaussian, eps: Tensor) -> tuple[Tensor, Tensor]:
        """``E_q[grad]`` ``(K, P)`` and ``E_q[Hessian]`` ``(K, P, P)`` over the draws
        ``theta = m + L eps``."""
        mean, sc, phi = draws(q, eps)
        eg = torch.zeros_like(mean)
        eh = torch.zeros((*mean.shape, mean.shape[-1]), dtype=mean.dtype)
        if self.lik is not None:
            assert self.ctx is not None
            a, b = _expected(lambda p, h: per_client_derivatives(self.lik, p, self.ctx,
                                                                 _seeds(p), h),
                             self.hessian, q, sc, eps, phi)
            eg, eh = eg + a, eh + b
        if self.extra is not None:
            fn = self._extra_fn()

            def flat(p, h):
                x = p.reshape(-1, p.shape[-1])
                grad = torch.func.grad(fn)
                if not h:
                    return vmap(grad)(x).reshape(p.shape), None
                hess = vmap(torch.func.jacrev(torch.func.jacrev(fn)))(x)
                return vmap(grad)(x).reshape(p.shape), hess.reshape(*p.shape, p.shape[-1])

            a, b = _expected(flat, self.extra[1], q, sc, eps, phi)
            eg, eh = eg + a, eh + b
        return eg, 0.5 * (eh + eh.transpose(-1, -2))


def _seeds(phi: Tensor) -> Tensor:
    return torch.arange(phi.shape[1])


def _expected(fn, kind: str, q: g.Gaussian, sc: Tensor, eps: Tensor, phi: Tensor
              ) -> tuple[Tensor, Tensor]:
    """Expected gradient and Hessian from pointwise Hessians or (``"stein"``) from gradients."""
    if kind == "stein":
        grads, _ = fn(phi, False)
        cross = torch.einsum("si,ksj->kij", eps, grads) / eps.shape[0]  # E[eps g'] = L' E[H]
        if isinstance(q, g.DiagGaussian):
            return grads.mean(1), cross / sc.unsqueeze(-1)
        return grads.mean(1), torch.linalg.solve_triangular(sc.transpose(-1, -2), cross,
                                                            upper=True)
    grads, hess = fn(phi, True)
    return grads.mean(1), hess.mean(1)


def draws(q: g.Gaussian, eps: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q's mean, scale and the draws ``theta = m + L eps`` ``(K, S, P)``."""
    mean, sc = g.mean_and_scale_tril(q)
    if isinstance(q, g.DiagGaussian):
        return mean, sc, mean.unsqueeze(-2) + eps * sc.unsqueeze(-2)
    return mean, sc, mean.unsqueeze(-2) + eps @ sc.transpose(-1, -2)


def expected_log_lik(terms: Terms, q: g.Gaussian, eps: Tensor) -> Tensor:
    """``E_q[log p]`` by the fixed draws, per client: ``(K,)``."""
    return terms.value(draws(q, eps)[2]).mean(1)


class NaturalGradientSolver(NamedTuple):
    """Clients' local free energies solved by natural-gradient fixed-point iteration (the
    arguments are those of :class:`fedppl.algorithms.pvi.NaturalGradientSolver`)."""

    model: Callable
    guide: PVIGuide
    num_draws: int = 128
    max_iters: int = 100
    tol: float = 1e-10
    seed: int = 0
    step_size: float = 1.0
    extra: Callable[[Tensor], Tensor] | None = None
    hessian: str = "pointwise"

    def prepare(self, data: tuple, masks: Tensor) -> ClientContext:
        """The clients' context, once per run (data in the guide's dtype, touched locals)."""
        return LogLik(self.model, self.guide).prepare(data, masks)

    def terms(self, ctx: ClientContext) -> Terms:
        D = self.guide._require_setup().dim
        extra = None if self.extra is None else (self.extra, self.hessian)
        return Terms(LogLik(self.model, self.guide), ctx, extra, num_global=D)

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, ctx: ClientContext,
                 local: g.Conditional | None = None, generator: Any = None) -> LocalResult:
        """Solve the clients' local problems from ``q`` (all batched over clients)."""
        terms = self.terms(ctx)
        if local is None:
            eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
            return solve(terms, q_cavity, q, eps, self.max_iters, self.tol, self.step_size)
        D, d, diag = q.dim, local.nat1.shape[-1], self.guide.client_diag
        cavity = g.embed(q_cavity if diag else g.to_full(q_cavity), d)
        eps = base_draws(self.num_draws, D + d, q.nat1.dtype, self.seed)
        out = solve(terms, cavity, g.join(q, local, diag), eps, self.max_iters, self.tol,
                    self.step_size, num_global=D, structure=self.guide.structure())
        marginal, conditional = g.split(out.q, D)
        return out._replace(q=g.project_moments(marginal, self.guide.diag), local=conditional)

    def expected_log_lik(self, q: g.Gaussian, ctx: ClientContext,
                         local: g.Conditional | None = None) -> Tensor:
        """``E_q[log p(y_k, z_k | theta)]`` (plus the entropy of the private guide) with the
        fixed draws, for candidates ``q`` (leading axis ``C``) and every client: ``(C, K)``."""
        terms = self.terms(ctx)
        C, K = q.nat1.shape[0], ctx.mask.shape[0]
        if local is None:
            eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
            _, _, theta = draws(q, eps)  # (C, S, D)
            phi = theta.unsqueeze(0).expand(K, *theta.shape)
            entropy = torch.zeros((), dtype=q.nat1.dtype)
        else:
            qk = type(q)(*(x.unsqueeze(1).expand(C, K, *x.shape[1:]) for x in q))
            lk = g.Conditional(*(x.unsqueeze(0).expand(C, *x.shape) for x in local))
            joint = g.join(qk, lk, self.guide.client_diag)
            eps = base_draws(self.num_draws, joint.dim, q.nat1.dtype, self.seed)
            _, _, phi = draws(joint, eps)  # (C, K, S, P)
            phi = phi.transpose(0, 1)
            entropy = g.conditional_entropy(local)
        S = eps.shape[0]
        flat = phi.reshape(K, C * S, phi.shape[-1])
        seeds = torch.arange(S).repeat(C)
        values = per_client(terms.lik, flat, ctx, seeds) if terms.lik is not None else 0.0
        ell = torch.as_tensor(values).reshape(K, C, S).mean(-1).T
        return ell + entropy


class PriorSolver(NamedTuple):
    """The server's step on the prior factor ``t_0``: a client step whose log-likelihood is the
    prior correction (no data); ``hessian="stein"`` reads the curvature from gradients."""

    correction: Callable[[Tensor], Tensor]
    num_draws: int = 128
    max_iters: int = 100
    tol: float = 1e-10
    seed: int = 0
    hessian: str = "pointwise"

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian) -> LocalResult:
        eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
        terms = Terms(None, None, (self.correction, self.hessian))
        return solve(terms, q_cavity, q, eps, self.max_iters, self.tol)

    def expected_log_lik(self, q: g.Gaussian) -> Tensor:
        """``E_q[correction]`` for a batch of ``q``."""
        eps = base_draws(self.num_draws, q.dim, q.nat1.dtype, self.seed)
        return expected_log_lik(Terms(None, None, (self.correction, self.hessian)), q, eps)


def solve(terms: Terms, q_cavity: g.Gaussian, q_init: g.Gaussian, eps: Tensor, max_iters: int,
          tol: float, step_size: float = 1.0, num_global: int | None = None,
          structure: Tensor | None = None) -> LocalResult:
    """Iterate ``q <- damp(q, q_cav * t(q), beta)`` from ``q_init`` for every client of the batch
    (see the module doc); each client stops on its own."""
    dtype = q_init.nat1.dtype
    K = q_init.nat1.shape[0]
    rel_slack = max(SLACK * 1e-4, 100 * float(torch.finfo(dtype).eps))
    betas = torch.tensor([2.0**-i for i in range(STEP_HALVINGS)], dtype=dtype)
    inf = torch.full((K,), torch.inf, dtype=dtype)

    def objective(q: g.Gaussian) -> Tensor:
        ell = expected_log_lik(terms, q, eps)
        if num_global is None or num_global == q.dim:
            return ell - g.kl(q, q_cavity)
        marginal, conditional = g.split(q, num_global)
        return (ell - g.kl(marginal, g.head(q_cavity, num_global))
                + g.conditional_entropy(conditional))

    q = q_init
    beta = torch.full((K,), float(step_size), dtype=dtype)
    last, residual = inf.clone(), inf.clone()
    iters = torch.zeros(K, dtype=torch.long)
    ok = torch.ones(K, dtype=torch.bool)
    f_old = objective(q)

    def running() -> Tensor:
        return (iters < max_iters) & (residual > torch.clamp(round_off(q), min=tol)) & ok

    active = running()
    while bool(active.any()):
        aim = target(terms, q_cavity, q, eps, structure)
        steps = beta.unsqueeze(-1) * betas  # (K, H)
        candidates = g.damp(_expand(q, STEP_HALVINGS), _expand(aim, STEP_HALVINGS), steps)
        pd = g.is_pd(candidates) & g.is_finite(candidates)
        none = ~pd.any(-1)
        if bool(none.any()):  # no damped step is positive definite: second-order steps
            pd_c, cand_c = _corrected_steps(q, aim, steps)
            pd = torch.where(none.unsqueeze(-1), pd_c, pd)
            candidates = g.where(none, cand_c, candidates)
        floor = f_old - SLACK - rel_slack * f_old.abs()
        pick = torch.zeros(K, dtype=torch.long)
        found = torch.zeros(K, dtype=torch.bool)
        f_new = -inf
        for j in range(STEP_HALVINGS):  # backtrack: the first acceptable step per client
            need = ~found & active
            if not bool(need.any()):
                break
            cj = g.index(candidates, (slice(None), j))
            safe = g.where(pd[:, j], cj, q)
            fj = torch.where(pd[:, j], objective(safe), -torch.inf)
            hit = need & (fj >= floor)
            pick = torch.where(need & ~hit, j + 1, pick)
            f_new = torch.where(need, fj, f_new)
            found = found | hit
        pick = pick.clamp(max=STEP_HALVINGS - 1)
        rows = torch.arange(K)
        q_new = g.where(found, g.index(candidates, (rows, pick)), q)
        change = torch.where(found, g.kl(q_new, q), torch.inf)
        res_new = change / steps[rows, pick] ** 2
        gain = torch.where(found, f_new - f_old, 0.0)
        shrink = (res_new > last) & (iters > 0) & (gain < SLACK)
        beta_new = torch.where(shrink, 0.5 * beta, torch.clamp(1.25 * beta, max=step_size))
        f_next = torch.where(found, f_new, f_old)
        # a client that has stopped keeps its state
        q = g.where(active, q_new, q)
        beta = torch.where(active, beta_new, beta)
        last = torch.where(active, res_new, last)
        residual = torch.where(active, res_new, residual)
        ok = torch.where(active, found & (beta_new > MIN_STEP), ok)
        f_old = torch.where(active, f_next, f_old)
        iters = iters + active.long()
        active = running()
    converged = residual <= torch.clamp(round_off(q), min=tol)
    return LocalResult(q, f_old, converged, iters)


def round_off(q: g.Gaussian) -> Tensor:
    """``10 eps^2 (D + m' Lambda m)``: the smallest residual a solve in q's dtype resolves."""
    eps = torch.finfo(q.nat1.dtype).eps
    mean, _ = g.to_moments(q)
    size = (q.nat1 * mean).sum(-1).abs()
    return 10 * eps**2 * (q.dim + torch.where(torch.isfinite(size), size, 0.0))


def _expand(q: g.Gaussian, n: int) -> g.Gaussian:
    """``q`` with a new axis of length ``n`` after the client axis."""
    return type(q)(*(x.unsqueeze(1).expand(x.shape[0], n, *x.shape[1:]) for x in q))


def _corrected_steps(q: g.Gaussian, aim: g.Gaussian, steps: Tensor) -> tuple[Tensor, g.Gaussian]:
    """Steps ``Lambda + b G + (b^2 / 2) G Sigma G``, positive definite for every ``b``, with the
    mean moved ``b Lambda'^-1 r`` (Lin, Schmidt and Khan 2020); same fixed point."""
    mean, cov = g.to_moments(q)
    G = aim.prec - q.prec
    if isinstance(q, g.DiagGaussian):
        r = aim.nat1 - aim.prec * mean
        quad = G * cov * G
    else:
        r = aim.nat1 - torch.einsum("...ij,...j->...i", aim.prec, mean)
        quad = G @ cov @ G
    b = steps.reshape(steps.shape + (1,) * (q.prec.ndim - 1))
    prec = q.prec.unsqueeze(1) + b * G.unsqueeze(1) + 0.5 * b**2 * quad.unsqueeze(1)
    bm = steps.unsqueeze(-1)
    if isinstance(q, g.DiagGaussian):
        cand: g.Gaussian = g.DiagGaussian(prec * mean.unsqueeze(1) + bm * r.unsqueeze(1), prec)
    else:
        prec = 0.5 * (prec + prec.transpose(-1, -2))
        cand = g.FullGaussian(torch.einsum("...ij,...j->...i", prec, mean.unsqueeze(1))
                              + bm * r.unsqueeze(1), prec)
    return g.is_pd(cand) & g.is_finite(cand), cand


def target(terms: Terms, q_cavity: g.Gaussian, q: g.Gaussian, eps: Tensor,
           structure: Tensor | None = None) -> g.Gaussian:
    """Where one full natural-gradient step from ``q`` lands (batched): full rank, ``q_cav``
    times the likelihood site ``(E[g] - E[H] m, -E[H])``; mean-field (or a ``structure``), the
    kept entries of ``P = Lambda_cav - E[H]`` and a Newton step with the full ``P``."""
    eg, eh = terms.derivatives(q, eps)
    mean = g.to_moments(q)[0]
    if isinstance(q, g.FullGaussian) and structure is None:
        site = g.FullGaussian(eg - torch.einsum("...ij,...j->...i", eh, mean), -eh)
        return g.product(q_cavity, site)
    cav = g.to_full(q_cavity)
    prec = cav.prec - eh
    resid = eg - (torch.einsum("...ij,...j->...i", cav.prec, mean) - q_cavity.nat1)
    chol = g.cholesky(prec)
    newton = torch.cholesky_solve(resid.unsqueeze(-1),
                                  torch.nan_to_num(chol, nan=0.0)).squeeze(-1)
    good = torch.isfinite(chol).all(-1).all(-1) & torch.isfinite(newton).all(-1)
    diag = torch.diagonal(prec, dim1=-2, dim2=-1)
    step = torch.where(good.unsqueeze(-1), newton, resid / diag)
    new_mean = mean + step
    if isinstance(q, g.DiagGaussian):
        return g.DiagGaussian(diag * new_mean, diag)
    kept = torch.diag_embed(diag) if structure is None else torch.where(structure, prec, 0.0)
    return g.FullGaussian(torch.einsum("...ij,...j->...i", kept, new_mean), kept)
