"""``PVI`` and ``GlobalVI`` for Pyro models: the front of the Pyro port.

Names, arguments, history keys, warnings and error messages are the NumPyro core's
(:mod:`fedppl.infer.variational`), with torch in JAX's place: ``rng_key`` is a
``torch.Generator`` (never an integer seed), the stochastic local step is ``solver="optim"``
with a torch optimiser (``torch.optim`` or ``pyro.optim``), and results hold torch tensors.

The runtime is this module's: ``"synchronous"`` runs every client's local step as one vectorised
solve (``torch.func.vmap`` over the clients' padded data; the local iterations are batched, each
client stopping on its own), then one server update; ``"sequential"`` runs the clients in turn,
the server updating after each; ``"loop"`` is the synchronous round with a Python loop over the
clients (the baseline ``benchmarks/pyro_rounds.py`` can compare against).

Example (logistic regression on 3 clients, against the pooled fit it converges to)::

    >>> import torch, numpy as np, fedppl, pyro, pyro.distributions as dist
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(90, 2))
    >>> y = (rng.uniform(size=90) < 1 / (1 + np.exp(-X @ np.array([1.5, -1.0])))) * 1.0
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    >>> key = torch.Generator().manual_seed(0)
    >>> guide = PVIGuide(model, dtype=torch.float64)
    >>> result = PVI(model, guide, "synchronous", num_particles=16, elbo_samples=0).run(
    ...     key, clients, 6, progress_bar=False)
    >>> reference = GlobalVI(model, PVIGuide(model, dtype=torch.float64), num_particles=16,
    ...                      elbo_samples=0).run(key, clients)
    >>> bool(torch.allclose(result.mean_and_cov()[0], reference.mean_and_cov()[0], atol=1e-3))
    True
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedppl import validation
from fedppl.clients import Clients
from fedppl.infer.base import check_tol
from fedppl.infer.round_log import Progress, RoundLog
from fedppl.pyro.algorithms import conjugate, pvi
from fedppl.pyro.algorithms import polya_gamma as pga
from fedppl.pyro.algorithms.natural_gradient import NaturalGradientSolver, PriorSolver
from fedppl.pyro.algorithms.terms import ClientContext, LogLik, per_client, tree_index
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.client import client
from fedppl.pyro.result import PVIResult, _generator
from fedppl.pyro.sites import (
    cast_floats,
    curvature,
    float_dtype,
    nodes,
    original,
    trace,
    vmap,
)

__all__ = ["PVI", "GlobalVI", "PVIResult", "RunState"]

SOLVERS = ("natural-gradient", "optim")
SCHEDULES = ("sequential", "synchronous", "loop")


class RunState(NamedTuple):
    """Everything one round needs: the server's and the clients' states (clients stacked), the
    solver's per-client context (the padded data and what it reads from them once), the
    log-likelihood context for the ELBO, the generator and the rounds done."""

    server: pvi.ServerState
    clients: pvi.ClientState
    ctx: Any
    lik_ctx: ClientContext | None
    rng_key: torch.Generator
    round: int


def _optimizer(value: Any) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    """A factory ``params -> torch.optim.Optimizer`` from a ``pyro.optim`` optimiser (its
    constructor and arguments), a ``torch.optim`` class, or a callable."""
    if hasattr(value, "pt_optim_constructor"):
        args = value.pt_optim_args
        if callable(args):
            raise TypeError("optimizer: a pyro.optim optimiser with per-parameter arguments is "
                            "not supported; give its arguments as a dict")
        return partial(value.pt_optim_constructor, **args)
    if callable(value) and not isinstance(value, (str, bytes, int, float)):
        return value
    raise TypeError(f"optimizer must be a torch optimiser factory such as pyro.optim.Adam("
                    f"{{'lr': 1e-2}}) or lambda params: torch.optim.Adam(params, lr=1e-2), got "
                    f"{value!r}")


class PVI:
    """Partitioned variational inference over the global sites of a Pyro model; the arguments
    are those of :class:`fedppl.PVI` (see it), with ``solver="optim"`` (a torch optimiser from
    ``optimizer``, default Adam with learning rate 1e-2) in place of ``"optax"``."""

    name = "PVI"

    def __init__(self, model: Callable, guide: PVIGuide, schedule: str = "sequential",
                 damping: float = 1.0, *, solver: str = "natural-gradient",
                 optimizer: Any = None, local_steps: int | None = None,
                 num_particles: int | None = None, local_tol: float | None = None,
                 conjugate: bool | str = "auto", elbo_samples: int = 64,
                 clients_per_round: int | None = None, shrink_warning: float = 2.0,
                 line_search: bool = True, max_divergence: float = pvi.MAX_DIVERGENCE):
        validation.pvi_settings(damping, conjugate, solver, SOLVERS, local_steps, num_particles,
                                local_tol, shrink_warning, max_divergence)
        if optimizer is not None and solver != "optim" and conjugate != "polya-gamma":
            warnings.warn("optimizer is used only by solver='optim'; the default "
                          "natural-gradient local step needs no optimiser and ignores it",
                          UserWarning, stacklevel=2)
        if clients_per_round is not None and clients_per_round < 1:
            raise ValueError(f"clients_per_round must be positive, got {clients_per_round}")
        self.model = model
        self.guide = guide
        self.schedule = schedule
        self.damping = float(damping)
        self.solver = solver
        self.optimizer = (partial(torch.optim.Adam, lr=1e-2) if optimizer is None
                          else _optimizer(optimizer))
        self.local_steps = None if local_steps is None else int(local_steps)
        self.num_particles = None if num_particles is None else int(num_particles)
        self.local_tol = local_tol
        self.conjugate = conjugate
        self.elbo_samples = int(elbo_samples)
        self.clients_per_round = clients_per_round
        self.shrink_warning = float(shrink_warning)
        self.line_search = bool(line_search)
        self.max_divergence = float(max_divergence)
        self._pooled = False

    # -- set-up --------------------------------------------------------------------------------

    def _solver(self, clients: Clients, model: Callable, model_kwargs: dict
                ) -> tuple[Any, PriorSolver | None]:
        """The clients' local solver and (for a prior that is not Gaussian) the server's."""
        self.guide.setup(*clients.client(0), **model_kwargs)
        layout = self.guide._require_setup()
        has_local = self.guide.local_layout is not None
        if self.conjugate == "polya-gamma" and not has_local:
            pga.validate(model, self.guide, clients)
        _check_clients(self.guide, clients, model_kwargs)
        correction = self.guide.prior_correction
        fold_prior = self._pooled and correction is not None

        def opt(value, default):
            return default if value is None else value

        S, iters = opt(self.num_particles, 128), opt(self.local_steps, 100)
        tol = opt(self.local_tol, 1e-10)
        prior_solver = None
        if correction is not None and not fold_prior:
            prior_solver = PriorSolver(correction, S, iters, tol, hessian=curvature(layout))
        reason = None
        if has_local:
            reason = "the model has local latent sites"
        elif fold_prior:
            reason = "the prior is not Gaussian (GlobalVI folds it into the likelihood)"
        if self.conjugate == "polya-gamma":
            if reason:
                raise ValueError(f"conjugate='polya-gamma' is not available: {reason}")
            return (pga.PolyaGammaSolver(model, self.guide, opt(self.local_steps, 200),
                                         opt(self.local_tol, 1e-10)), prior_solver)
        if self.conjugate is not False and reason is None:
            data, masks = pga.padded(clients.subset([0]), layout.dtype)
            why = conjugate.check(client(model, mask=masks[0]), layout,
                                  *(a[0] for a in data), **{})
            if why is None:
                return pvi.ConjugateSolver(model, self.guide), prior_solver
            if self.conjugate is True:
                raise ValueError(f"conjugate=True but the model is not conjugate: {why}")
        elif self.conjugate is True:
            raise ValueError(f"conjugate=True is not available: {reason}")
        if self.solver == "optim":
            if reason:
                raise ValueError(f"solver='optim' is not available: {reason}; use the default "
                                 "natural-gradient solver")
            return (pvi.OptimSolver(model, self.guide, self.optimizer, opt(self.local_steps, 200),
                                    opt(self.num_particles, 8), opt(self.local_tol, 1e-4)),
                    prior_solver)
        return (NaturalGradientSolver(model, self.guide, S, iters, tol,
                                      extra=correction if fold_prior else None,
                                      hessian=curvature(layout) if fold_prior else "pointwise"),
                prior_solver)

    def init_factors(self, num_clients: int) -> g.Gaussian:
        """Flat factors ``t_k = 1`` for every client (q starts at the prior)."""
        return pvi.stacked(g.zeros_like(self.guide._require_prior()), num_clients)

    def init(self, rng_key: torch.Generator, clients: Clients, factors: g.Gaussian | None = None,
             *, resume: PVIResult | None = None, **model_kwargs: Any) -> RunState:
        """Check the clients, set up the local solver, the initial factors (``factors`` or
        ``resume``'s, else flat) and the clients' private guides. Keyword arguments are the
        model's own static keyword arguments."""
        if not isinstance(clients, Clients):
            raise TypeError(f"clients must be a fedppl.Clients (see fedppl.partition), got "
                            f"{type(clients).__name__}")
        gen = _generator(rng_key)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        model = partial(self.model, **model_kwargs) if model_kwargs else self.model
        solver, prior_solver = self._solver(clients, model, model_kwargs)
        K = clients.num_clients
        if resume is not None:
            factors = resume.factors
        want = self.init_factors(K)
        factors = want if factors is None else factors
        if [tuple(x.shape) for x in factors] != [tuple(x.shape) for x in want]:
            raise ValueError(
                "the factors to resume from do not fit this model and these clients: shapes "
                f"{[tuple(x.shape) for x in factors]}, expected {[tuple(x.shape) for x in want]}"
                " (a different number of clients or of features?)")
        prior = self.guide._require_prior()
        t0 = None
        if prior_solver is not None:
            t0 = (resume.prior_factor if resume is not None and resume.prior_factor is not None
                  else g.zeros_like(prior))
        local = self.guide.init_local()
        if local is not None:
            local = (resume.local if resume is not None and resume.local is not None
                     else pvi.stacked(local, K))
        data, masks = pga.padded(clients, float_dtype(self.guide._require_setup().dtype))
        ctx = solver.prepare(data, masks)
        lik_ctx = ctx if isinstance(ctx, ClientContext) else None
        if lik_ctx is None and self.elbo_samples > 0 and not isinstance(
                solver, pvi.ConjugateSolver):
            lik_ctx = LogLik(model, self.guide).prepare(data, masks)
        self._run = _Run(solver, prior_solver, model, clients.names,
                         RoundLog(clients.names, self.shrink_warning))
        return RunState(pvi.init(prior, factors, t0), pvi.ClientState(factors, local), ctx,
                        lik_ctx, gen, 0)

    # -- a round -------------------------------------------------------------------------------

    def _participants(self, gen: torch.Generator, K: int) -> Tensor:
        m = self.clients_per_round
        if m is None or m >= K:
            return torch.ones(K, dtype=torch.bool)
        active = torch.zeros(K, dtype=torch.bool)
        active[torch.randperm(K, generator=gen)[:m]] = True
        return active

    def _score(self, ctx: Any, local: g.Conditional | None):
        run, prior = self._run, self.guide._require_prior()
        if not (self.line_search and hasattr(run.solver, "expected_log_lik")):
            return None

        def score(candidates: g.Gaussian) -> tuple[Tensor, Tensor]:
            ell = run.solver.expected_log_lik(candidates, ctx, local)
            if run.prior_solver is not None:
                ell = torch.cat([ell, run.prior_solver.expected_log_lik(candidates)[:, None]], 1)
            return ell, g.kl(candidates, prior)

        return score

    def _clients_step(self, server: pvi.ServerState, cstates: pvi.ClientState, ctx: Any,
                      active: Tensor, gen: torch.Generator):
        """Every client's message from the same ``q``: one vectorised solve, or (``"loop"``)
        one solve per taking-part client."""
        solver = self._run.solver
        if self.schedule == "synchronous":
            return pvi.client_update(server.q, cstates, ctx, solver, self.damping, gen)
        outs = {k: pvi.client_update(server.q, tree_index(cstates, [k]), tree_index(ctx, [k]),
                                     solver, self.damping, gen)
                for k in range(len(active)) if active[k]}
        if not outs:
            raise ValueError("no client takes part in this round")
        some = next(iter(outs.values()))
        parts = [outs.get(k, _zeros(some)) for k in range(len(active))]
        return _concat([p[0] for p in parts]), _concat([p[1] for p in parts])

    def _round(self, state: RunState, active: Tensor):
        server, cstates, ctx, gen = state.server, state.clients, state.ctx, state.rng_key
        run = self._run
        if self.schedule == "sequential":
            if run.prior_solver is not None:
                pmsg, _ = pvi.prior_update(server, run.prior_solver, self.damping)
                new, s = pvi.server_update(server, pmsg, torch.ones(1, dtype=torch.bool), None,
                                           self.max_divergence)
                server = _acknowledge_prior(server._replace(q=new.q), pmsg, s[0])
            msgs: list[pvi.ClientMessage | None] = []
            replies: list[Tensor] = []
            for k in range(len(active)):
                one_state, one_ctx = tree_index(cstates, [k]), tree_index(ctx, [k])
                if not active[k]:
                    msgs.append(None)
                    replies.append(torch.zeros(1, dtype=server.q.nat1.dtype))
                    continue
                msg, proposed = pvi.client_update(server.q, one_state, one_ctx, run.solver,
                                                  self.damping, gen)
                server, reply = pvi.server_update(server, msg, torch.ones(1, dtype=torch.bool),
                                                  None, self.max_divergence)
                cstates = _put(cstates, k, pvi.acknowledge(one_state, msg, reply, proposed))
                msgs.append(msg)
                replies.append(reply)
            some = next(m for m in msgs if m is not None)
            msgs_all = _concat([m if m is not None else _zeros(some) for m in msgs])
            return server._replace(round=state.server.round + 1), cstates, msgs_all, \
                torch.cat(replies)
        stacked, proposed = self._clients_step(server, cstates, ctx, active, gen)
        score = self._score(ctx, proposed.local)
        if run.prior_solver is None:
            server, steps = pvi.server_update(server, stacked, active, score, self.max_divergence)
        else:
            pmsg, _ = pvi.prior_update(server, run.prior_solver, self.damping)
            both = _concat([stacked, pmsg])
            new, steps = pvi.server_update(server, both, torch.cat([active, torch.ones(1).bool()]),
                                           score, self.max_divergence)
            server, steps = _acknowledge_prior(new, pmsg, steps[-1]), steps[:-1]
        return server, pvi.acknowledge(cstates, stacked, steps, proposed), stacked, steps

    def update(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        """One round: every taking-part client's update, then the server's."""
        if not hasattr(self, "_run"):
            raise RuntimeError(f"call {type(self).__name__}.init(rng_key, clients) before update")
        K = state.clients.factor.nat1.shape[0]
        active = self._participants(state.rng_key, K)
        t0 = time.perf_counter()
        server, cstates, msgs, replies = self._round(state, active)
        seconds = time.perf_counter() - t0
        new = state._replace(server=server, clients=cstates, round=state.round + 1)
        act = active.numpy()
        self.last_messages, self.last_active = msgs, act
        steps = replies.detach().numpy()
        n = int(act.sum())
        info: dict[str, Any] = {
            "round": new.round, "seconds": seconds, "messages_up": n, "messages_down": n,
            "bytes_up": n * g.num_bytes(g.index(msgs.delta, 0)),
            "bytes_down": n * g.num_bytes(state.server.q),
            "rejected": int((act & (steps <= 0)).sum())}
        q_old, q_new = state.server.q, server.q
        m = _numpy(msgs)
        self._run.log.report(new.round - 1, steps, m, act, *_numpy((q_old, q_new)))
        info.update({
            "free_energy": np.where(act, m.free_energy, np.nan),
            "converged": np.where(act, m.converged.astype(float), np.nan),
            "local_iterations": np.where(act, m.iterations.astype(float), np.nan),
            "step": np.where(act, np.maximum(steps.astype(float), 0.0), np.nan),
            "kl_change": float(g.kl(q_new, q_old)),
            "elbo": self._elbo(new) if self.elbo_samples > 0 else np.nan})
        return new, info

    def _elbo(self, state: RunState) -> float:
        """The global ELBO ``sum_k E_q[log p(y_k, z_k | theta)] + H[q(z_k | theta)] +
        E_q[prior correction] - KL(q || p~)`` with fresh draws (closed form when conjugate)."""
        run, q, gen = self._run, state.server.q, state.rng_key
        prior = self.guide._require_prior()
        if isinstance(run.solver, pvi.ConjugateSolver):
            ell = run.solver.expected_log_lik(pvi.stacked(q, 1), state.ctx)[0]
            total = ell.sum()
        else:
            lik_ctx = state.lik_ctx
            assert lik_ctx is not None
            S, K = self.elbo_samples, lik_ctx.mask.shape[0]
            local = state.clients.local
            extra: Tensor | float = 0.0
            if local is None:
                phi = g.sample(gen, q, S).unsqueeze(0).expand(K, S, q.dim)
            else:
                joint = g.join(pvi.stacked(q, K), local, self.guide.client_diag)
                phi = g.sample(gen, joint, S)
                extra = g.conditional_entropy(local).sum()
            lik = LogLik(run.model, self.guide)
            total = per_client(lik, phi, lik_ctx).mean(-1).sum() + extra
        total = total - g.kl(q, prior)
        if run.prior_solver is not None:
            theta = g.sample(gen, pvi.stacked(q, 1), self.elbo_samples)
            total = total + vmap(run.prior_solver.correction)(theta[0]).mean()
        return float(total)

    # -- running -------------------------------------------------------------------------------

    def run(self, rng_key: torch.Generator, clients: Clients, num_rounds: int, *,
            progress_bar: bool = True, factors: g.Gaussian | None = None,
            tol: float | None = None, resume: PVIResult | None = None,
            **model_kwargs: Any) -> PVIResult:
        """Run up to ``num_rounds`` rounds; ``tol`` stops after the first round in which
        ``KL(q_new || q_old) <= tol``; other keyword arguments are the model's own."""
        num_rounds = validation.positive_int(num_rounds, "num_rounds")
        tol = check_tol(tol, self.name)
        state = self.init(rng_key, clients, factors, resume=resume, **model_kwargs)
        rows = []
        bar = Progress(f"{self.name} ({self.schedule})", num_rounds, ("elbo", "kl_change"),
                       enabled=progress_bar)
        stopped = None
        for _ in range(num_rounds):
            state, info = self.update(state)
            rows.append(info)
            bar.update(info)
            if tol is not None and info["kl_change"] <= tol:
                if len(rows) < num_rounds:
                    stopped = f"kl_change {float(info['kl_change']):.3g} <= tol {tol:g}"
                break
        bar.close(stopped)
        history = {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
        run = self._run
        return PVIResult(guide=self.guide, q=state.server.q, factors=state.clients.factor,
                         history=history, client_names=run.names, rejected=run.log.rejected,
                         unconverged=run.log.unconverged, local=state.clients.local,
                         prior_factor=state.server.prior_factor, model=run.model)


class _Run(NamedTuple):
    solver: Any
    prior_solver: PriorSolver | None
    model: Callable
    names: tuple[str, ...]
    log: RoundLog


def _acknowledge_prior(state: pvi.ServerState, msg: pvi.ClientMessage, step: Tensor
                       ) -> pvi.ServerState:
    assert state.prior_factor is not None
    t0 = pvi.acknowledge(pvi.ClientState(pvi.stacked(state.prior_factor, 1)), msg,
                         step.reshape(1))
    return state._replace(prior_factor=g.index(t0.factor, 0))


def _rebuild(tree: Any, parts) -> Any:
    """A (named) tuple of the same type as ``tree`` from ``parts``."""
    parts = list(parts)
    return type(tree)(*parts) if hasattr(tree, "_fields") else type(tree)(parts)


def _numpy(tree: Any) -> Any:
    """``tree`` with its tensors as NumPy arrays (what :class:`RoundLog` reads)."""
    if isinstance(tree, Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, tuple):
        return _rebuild(tree, (_numpy(x) for x in tree))
    return tree


def _zeros(tree: Any) -> Any:
    if tree is None:
        return None
    if isinstance(tree, Tensor):
        return torch.zeros_like(tree)
    return _rebuild(tree, (_zeros(x) for x in tree))


def _concat(trees: list) -> Any:
    first = trees[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return torch.cat(trees)
    return _rebuild(first, (_concat(list(xs)) for xs in zip(*trees, strict=True)))


def _put(tree: Any, k: int, one: Any) -> Any:
    """``tree`` with entry ``k`` of its leading axis replaced by ``one``'s (a batch of one)."""
    if tree is None:
        return None
    if isinstance(tree, Tensor):
        out = tree.clone()
        out[k] = one[0]
        return out
    return _rebuild(tree, (_put(a, k, b) for a, b in zip(tree, one, strict=True)))


def _check_clients(guide: PVIGuide, clients: Clients, model_kwargs: dict) -> None:
    """Before anything runs: every client's observations lie in their likelihood's support, and
    every client's model gives each local site the prototype's shape (messages as the NumPyro
    core's)."""
    layout = guide._require_setup()
    want = {} if guide.local_layout is None else {s.name: s.shape
                                                  for s in guide.local_layout.sites}
    if not want and clients.num_clients > 1 and _observations_in_support(
            guide.model, cast_floats(clients.pooled().client(0), layout.dtype), model_kwargs):
        return
    for k in range(clients.num_clients):
        who = clients.names[k]
        try:
            tr = trace(guide.model, cast_floats(clients.client(k), layout.dtype), model_kwargs)
        except Exception as err:
            raise ValueError(f"{who}: the model fails on this client's data: "
                             f"{original(err)}") from err
        for name, site in nodes(tr).items():
            if site["type"] != "sample" or not site["is_observed"] or name in layout.names:
                continue
            value = torch.as_tensor(site["value"])
            inside = torch.as_tensor(site["fn"].support.check(value))
            if not bool(inside.all()):
                bad = value[~inside] if inside.shape == value.shape else value.reshape(-1)[:5]
                raise ValueError(f"{who}: observed site '{name}' has values outside its "
                                 f"distribution's support {site['fn'].support} (e.g. "
                                 f"{np.unique(bad.numpy())[:5].tolist()})")
        for name, shape in want.items():
            if name not in nodes(tr):
                raise ValueError(f"{who}: the model has no local site '{name}' with this "
                                 "client's data")
            got = tuple(nodes(tr)[name]["value"].shape)
            if got != shape:
                raise ValueError(
                    f"local site '{name}' has shape {got} for {who} but {shape} for "
                    f"{clients.names[0]}; every client's private guide must have one shape. Give "
                    "the model the number of groups as a static keyword argument (the largest "
                    "over clients; groups without data keep their prior)")


def _observations_in_support(model: Callable, data: tuple, model_kwargs: dict) -> bool:
    try:
        tr = trace(model, data, model_kwargs)
    except Exception:
        return False
    return all(bool(torch.as_tensor(site["fn"].support.check(site["value"])).all())
               for site in nodes(tr).values()
               if site["type"] == "sample" and site["is_observed"])


class GlobalVI(PVI):
    """The same guide family fitted to the pooled data: the answer PVI converges to (one client
    with every client's data; a prior correction, if any, is part of its likelihood). The
    arguments are those of :class:`fedppl.GlobalVI`."""

    name = "GlobalVI"

    def __init__(self, model: Callable, guide: PVIGuide, optimizer: Any = None,
                 num_steps: int = 2000, num_particles: int | None = None,
                 conjugate: bool | str = "auto", elbo_samples: int = 64,
                 solver: str = "natural-gradient", tol: float | None = None):
        super().__init__(model, guide, "sequential", 1.0, solver=solver, optimizer=optimizer,
                         local_steps=num_steps, num_particles=num_particles, local_tol=tol,
                         conjugate=conjugate, elbo_samples=elbo_samples)
        self._pooled = True

    def init(self, rng_key: torch.Generator, clients: Clients | tuple,
             factors: g.Gaussian | None = None, *, resume: PVIResult | None = None,
             **model_kwargs: Any) -> RunState:
        pooled = (clients.pooled() if isinstance(clients, Clients)
                  else Clients.from_list([clients]) if isinstance(clients, tuple) else clients)
        return super().init(rng_key, pooled, factors, resume=resume, **model_kwargs)

    def run(self, rng_key: torch.Generator, clients: Clients | tuple, num_rounds: int = 1, *,
            progress_bar: bool = False, **kwargs: Any) -> PVIResult:
        """Fit the pooled data (keyword arguments as for :meth:`PVI.run`)."""
        return super().run(rng_key, clients, num_rounds,  # type: ignore[arg-type]  # init pools it
                           progress_bar=progress_bar, **kwargs)
