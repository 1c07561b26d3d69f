"""Partitioned variational inference in torch: the client step, the server's acceptance rule and
the acknowledgement, on clients stacked on a leading axis.

The twin of :mod:`fedppl.algorithms.pvi` (read it for the method). The server holds ``q = p~ t_0
prod_k t_k``; a client step repairs its cavity ``q / t_k``, solves its local problem with a local
solver, damps its new factor and sends only the change ``delta_k``. The server judges each delta
alone (:func:`verdicts`: refused, with the reason, if not finite, if ``q * delta_k`` is not
positive definite, or if its Jeffreys divergence from ``q`` exceeds ``max_divergence`` nats per
dimension), applies the rest with the largest step in ``1, 1/2, ..., 2^-10`` that keeps ``q``
finite and positive definite (and, given a ``score``, does not lower the global ELBO), and answers
each client with that step or a refusal code (:data:`REFUSALS`, the same codes and words as the
NumPyro core); the client applies its delta with the step it was given (:func:`acknowledge`).

Every function takes the whole batch of clients at once: :func:`client_update` on ``K`` clients
is one vectorised local solve (``torch.func.vmap`` over their padded data), which is what the
synchronous schedule runs.

Example (one synchronous round by hand, Bayesian linear regression, closed-form local steps)::

    >>> import torch, numpy as np, fedppl, pyro, pyro.distributions as dist
    >>> from fedppl.pyro.guides import PVIGuide
    >>> from fedppl.pyro.algorithms.polya_gamma import padded
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> X = np.random.default_rng(0).normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> guide = PVIGuide(model).setup(*clients.client(0))
    >>> solver = ConjugateSolver(model, guide)
    >>> ctx = solver.prepare(*padded(clients, guide.layout.dtype))
    >>> flat = stacked(g.zeros_like(guide.prior), 3)
    >>> state, cstates = init(guide.prior, flat), ClientState(flat)
    >>> msgs, proposed = client_update(state.q, cstates, ctx, solver, 1.0)
    >>> state, steps = server_update(state, msgs)
    >>> cstates = acknowledge(cstates, msgs, steps, proposed)
    >>> steps.tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedppl.algorithms.pvi import (  # the NumPyro core's step sizes and refusal codes
    IMPLAUSIBLE,
    MAX_DIVERGENCE,
    NOT_FINITE,
    NOT_PD,
    NOT_RECEIVED,
    REFUSALS,
    STEP_SIZES,
)
from fedppl.pyro.algorithms import conjugate
from fedppl.pyro.algorithms.natural_gradient import LocalResult, PriorSolver
from fedppl.pyro.algorithms.terms import ClientContext, LogLik, per_client
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.client import client
from fedppl.pyro.sites import cast_floats, vmap

__all__ = ["ServerState", "ClientState", "ClientMessage", "ConjugateSolver", "OptimSolver",
           "init", "client_update", "prior_update", "verdicts", "server_update", "acknowledge",
           "stacked", "REFUSALS", "STEP_SIZES", "MAX_DIVERGENCE"]

class ServerState(NamedTuple):
    """The server's ``q``, the rounds done and the prior factor ``t_0`` (None when the prior is
    Gaussian in the unconstrained space)."""

    q: g.Gaussian
    round: int
    prior_factor: g.Gaussian | None = None


class ClientState(NamedTuple):
    """Each client's factor ``t_k`` and private guide over its local sites (stacked)."""

    factor: g.Gaussian
    local: g.Conditional | None = None


class ClientMessage(NamedTuple):
    """What the clients send up (stacked): factor updates and diagnostics, no data."""

    delta: g.Gaussian
    free_energy: Tensor
    cavity_repaired: Tensor
    converged: Tensor
    iterations: Tensor


def stacked(x: Any, n: int) -> Any:
    """``x`` (a Gaussian or Conditional) repeated on a new leading axis of length ``n``."""
    return type(x)(*(t.unsqueeze(0).expand(n, *t.shape).clone() for t in x))


class ConjugateSolver(NamedTuple):
    """Closed-form maximiser for a Gaussian likelihood affine in the global sites; the clients'
    likelihood factors are read once (:meth:`prepare`)."""

    model: Callable
    guide: PVIGuide

    def prepare(self, data: tuple, masks: Tensor) -> conjugate.GaussianLikelihood:
        layout = self.guide._require_setup()
        data = cast_floats(data, layout.dtype)

        def terms(data_k, mask_k):
            return tuple(conjugate.likelihood_terms(client(self.model, mask=mask_k), layout,
                                                    *data_k))

        return conjugate.GaussianLikelihood(*vmap(terms, (0, 0))(data, masks))

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, ctx: conjugate.GaussianLikelihood,
                 local: Any = None, generator: Any = None) -> LocalResult:
        target = g.product(g.to_full(q_cavity), conjugate.likelihood_factor(ctx))
        assert isinstance(target, g.FullGaussian)
        q_new = g.project_diag(target) if self.guide.diag else target
        mean, cov = g.to_moments(g.to_full(q_new))
        free_energy = conjugate.expected_log_lik(ctx, mean, cov) - g.kl(q_new, q_cavity)
        K = free_energy.shape[0]
        return LocalResult(q_new, free_energy, torch.ones(K, dtype=torch.bool),
                           torch.ones(K, dtype=torch.long))

    def expected_log_lik(self, q: g.Gaussian, ctx: conjugate.GaussianLikelihood,
                         local: Any = None) -> Tensor:
        """``E_q[log p(y_k | theta)]`` in closed form for candidates ``q`` (leading axis ``C``)
        and every client: ``(C, K)``."""
        mean, cov = g.to_moments(g.to_full(q))
        return conjugate.expected_log_lik(ctx, mean[:, None], cov[:, None])


class OptimSolver(NamedTuple):
    """Constant-step stochastic optimisation of the local free energy with a torch optimiser (the
    NumPyro core's ``VariationalSolver`` with optax): ``steps`` updates of the guide's mean and
    raw scale, each with ``num_particles`` fresh reparametrised draws for the expected
    log-likelihood and the KL to the cavity in closed form. All clients' parameters are stacked
    into one tensor per kind and updated by one optimiser: an elementwise optimiser (Adam, SGD,
    RMSprop) so runs exactly the clients' independent optimisers at once. Its noise stays in the
    factors. ``converged``: ``KL(q_T || q_{0.9T}) <= tol``.

    :param make_optimizer: ``params -> torch.optim.Optimizer``.
    """

    model: Callable
    guide: PVIGuide
    make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer]
    steps: int
    num_particles: int = 8
    tol: float = 1e-4

    def prepare(self, data: tuple, masks: Tensor) -> ClientContext:
        return LogLik(self.model, self.guide).prepare(data, masks)

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, ctx: ClientContext,
                 local: Any = None, generator: torch.Generator | None = None) -> LocalResult:
        guide, S = self.guide, self.num_particles
        lik = LogLik(self.model, guide)
        cav_mean = g.to_moments(q_cavity)[0]
        start = guide.params_from(q)
        params = {k: v.detach().clone().requires_grad_(True) for k, v in start.items()}
        opt = self.make_optimizer(list(params.values()))

        def losses() -> Tensor:
            mean, tril = guide.mean_and_tril(params)
            eps = torch.randn((*mean.shape[:-1], S, mean.shape[-1]), generator=generator,
                              dtype=mean.dtype)
            if guide.diag:
                theta = mean.unsqueeze(-2) + eps * tril.unsqueeze(-2)
            else:
                theta = mean.unsqueeze(-2) + eps @ tril.transpose(-1, -2)
            ell = per_client(lik, theta, ctx).mean(-1)
            return g.kl_from_moments(mean, tril, q_cavity, cav_mean) - ell

        head = self.steps - max(self.steps // 10, 1)
        mid = q
        for step in range(self.steps):
            opt.zero_grad()
            losses().sum().backward()
            opt.step()
            if step == head - 1:
                mid = guide.q_from({k: v.detach() for k, v in params.items()})
        q_new = guide.q_from({k: v.detach() for k, v in params.items()})
        with torch.no_grad():
            free_energy = -losses()
        K = free_energy.shape[0]
        return LocalResult(q_new, free_energy, g.kl(q_new, mid) <= self.tol,
                           torch.full((K,), self.steps, dtype=torch.long))


# -- the trio --------------------------------------------------------------------------------------


def init(prior: g.Gaussian, factors: g.Gaussian, prior_factor: g.Gaussian | None = None
         ) -> ServerState:
    """Server state for ``q = prior * prior_factor * prod_k factors[k]``."""
    total = type(factors)(*(x.sum(0) for x in factors))
    q = g.product(prior, total) if prior_factor is None else g.product(prior, prior_factor,
                                                                         total)
    return ServerState(g.symmetric(q), 0, prior_factor)


def client_update(q: g.Gaussian, state: ClientState, ctx: Any, solver: Any,
                  damping: float | Tensor, generator: torch.Generator | None = None
                  ) -> tuple[ClientMessage, ClientState]:
    """One PVI step on every client of the batch ``state`` (one vectorised local solve); returns
    the messages and the clients' proposed new states."""
    K = state.factor.nat1.shape[0]
    qk = stacked(q, K)
    q_cav, repaired = g.repair(g.symmetric(g.quotient(qk, state.factor)))
    if state.local is None:
        out = solver(q_cav, qk, ctx, generator=generator)
    else:
        out = solver(q_cav, qk, ctx, local=state.local, generator=generator)
    return _propose(state, q_cav, repaired, out, damping)


def prior_update(state: ServerState, solver: PriorSolver, damping: float | Tensor
                 ) -> tuple[ClientMessage, ClientState]:
    """The server's step on its prior factor ``t_0`` (a batch of one)."""
    if state.prior_factor is None:
        raise ValueError("the server state has no prior factor t_0: pass prior_factor to init")
    cstate = ClientState(stacked(state.prior_factor, 1))
    q = stacked(state.q, 1)
    q_cav, repaired = g.repair(g.quotient(q, cstate.factor))
    return _propose(cstate, q_cav, repaired, solver(q_cav, q), damping)


def _propose(state: ClientState, q_cav: g.Gaussian, repaired: Tensor, out: LocalResult,
             damping: float | Tensor) -> tuple[ClientMessage, ClientState]:
    new_factor = g.symmetric(g.damp(state.factor, g.quotient(out.q, q_cav), damping))
    msg = ClientMessage(g.quotient(new_factor, state.factor), out.free_energy, repaired,
                        out.converged, out.iterations)
    return msg, ClientState(new_factor, out.local)


def verdicts(q: g.Gaussian, deltas: g.Gaussian, max_divergence: float = MAX_DIVERGENCE
             ) -> Tensor:
    """Each delta (stacked on axis 0) judged alone against ``q``: 1.0 where acceptable, else the
    refusal code: not finite, ``q * delta`` not positive definite, or a Jeffreys divergence
    between ``q`` and ``q * delta`` above ``max_divergence`` nats per dimension."""
    finite = g.is_finite(deltas)
    safe = type(deltas)(*(torch.where(finite.reshape(finite.shape + (1,) * (d.ndim - 1)), d, 0.0)
                          for d in deltas))
    K = finite.shape[0]
    qk = stacked(q, K)
    moved = g.product(qk, safe)
    pd = g.is_pd(moved) & g.is_finite(moved)
    proper = g.where(pd, moved, qk)
    jeffreys = (g.kl(proper, qk) + g.kl(qk, proper)) / q.dim
    plausible = jeffreys <= max_divergence  # False for NaN
    one = torch.ones(K, dtype=q.nat1.dtype)
    return torch.where(~finite, NOT_FINITE * one,
                       torch.where(~pd, NOT_PD * one,
                                   torch.where(~plausible, IMPLAUSIBLE * one, one)))


def server_update(state: ServerState, messages: ClientMessage, received: Tensor | None = None,
                  score: Callable[[g.Gaussian], tuple[Tensor, Tensor]] | None = None,
                  max_divergence: float = MAX_DIVERGENCE) -> tuple[ServerState, Tensor]:
    """Apply the acceptable deltas with the largest step in 1, 1/2, ..., 2^-10 that keeps q
    finite and positive definite and, given ``score`` (candidates -> the clients' expected
    log-likelihoods ``(C, K)`` and ``KL(q || prior)`` ``(C,)``), does not lower the global ELBO by
    more than ``1e-2 + 1e-6 |ELBO|`` nats. Returns the new state and each client's reply."""
    verdict = verdicts(state.q, messages.delta, max_divergence)
    ok = verdict > 0
    if received is not None:
        ok = ok & received
        verdict = torch.where(received, verdict, NOT_RECEIVED * torch.ones_like(verdict))
    delta = messages.delta
    clean = type(delta)(*(torch.where(ok.reshape(ok.shape + (1,) * (d.ndim - 1)), d, 0.0)
                          for d in delta))
    total = g.symmetric(type(clean)(*(x.sum(0) for x in clean)))
    sizes = torch.tensor(STEP_SIZES, dtype=total.nat1.dtype)
    candidates = g.product(stacked(state.q, len(sizes)), g.scale(stacked(total, len(sizes)),
                                                                  sizes))
    accept = g.is_pd(candidates) & g.is_finite(candidates)
    if score is not None:
        both = type(candidates)(*(torch.cat([a.unsqueeze(0), b]) for a, b in
                                  zip(state.q, candidates, strict=True)))
        safe = g.where(torch.cat([torch.ones(1, dtype=torch.bool), accept]), both,
                       stacked(state.q, len(sizes) + 1))
        ells, kls = score(safe)
        use = (verdict != NOT_FINITE) & torch.isfinite(ells[0])

        def elbo(ell: Tensor, kl: Tensor) -> Tensor:
            return torch.where(use, ell, 0.0).sum(-1) - kl

        current = elbo(ells[0], kls[0])
        floor = current - 1e-2 - 1e-6 * current.abs()
        accept = accept & (elbo(ells[1:], kls[1:]) >= floor)
    if bool(accept.any()):
        step = sizes[int(torch.nonzero(accept)[0, 0])]
    else:
        step = torch.zeros((), dtype=sizes.dtype)
    q = g.symmetric(g.product(state.q, g.scale(total, step)))
    replies = torch.where(ok, step.expand_as(verdict), torch.clamp(verdict, max=0.0))
    return state._replace(q=q, round=state.round + 1), replies


def acknowledge(states: ClientState, messages: ClientMessage, steps: Tensor,
                proposed: ClientState | None = None) -> ClientState:
    """Clients apply their delta with the step the server accepted; a client whose update was
    applied (step > 0) keeps its ``proposed`` private guide, the others their old one."""

    def apply(t: Tensor, d: Tensor) -> Tensor:
        s = steps.reshape(steps.shape + (1,) * (d.ndim - 1))
        return t + torch.where(s > 0, s * d, 0.0)

    factor = g.symmetric(type(states.factor)(*(apply(t, d) for t, d in
                                               zip(states.factor, messages.delta, strict=True))))
    local = states.local
    if local is not None and proposed is not None and proposed.local is not None:
        local = g.where(steps > 0, proposed.local, local)
    return ClientState(factor, local)
