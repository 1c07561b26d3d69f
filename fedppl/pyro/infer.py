"""``PVI`` and ``GlobalVI`` for Pyro models: the core's fronts, with what touches Pyro swapped in.

:class:`PVI` is :class:`fedppl.PVI`: the same server, acceptance rule, schedules, runtimes
(``runtime=``: the embedded runtime, :class:`fedppl.runtime.faults.Faults`, Flower), round log,
history and errors. Only the plan's PPL-specific pieces are the port's: the clients are checked
against the Pyro model by tracing it with ``pyro.poutine``, and the local step is the core's with
the client's log density, gradient and Hessian evaluated by torch (:class:`fedppl.pyro.PVIGuide`),
or the core's closed forms on likelihood terms torch reads from the model. With torch in JAX's
place at the edges: ``rng_key`` is a ``torch.Generator`` (copied, never an integer seed), the
stochastic local step is ``solver="optim"`` with a Pyro or torch optimiser (run as the equivalent
optax one), and results hold torch tensors.

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
    >>> guide = PVIGuide(model, dtype=torch.float32)
    >>> result = PVI(model, guide, "synchronous", num_particles=16, elbo_samples=0).run(
    ...     key, clients, 6, progress_bar=False)
    >>> reference = GlobalVI(model, PVIGuide(model, dtype=torch.float32), num_particles=16,
    ...                      elbo_samples=0).run(key, clients)
    >>> bool(torch.allclose(result.mean_and_cov()[0], reference.mean_and_cov()[0], atol=1e-3))
    True
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import jax
import numpy as np
import optax
import torch

from fedppl import validation
from fedppl.algorithms import pvi, solvers
from fedppl.algorithms.natural_gradient import NaturalGradientSolver, PriorSolver
from fedppl.clients import Clients
from fedppl.infer.base import Plan, RunState, shared
from fedppl.infer.pvi_plan import (
    Static,
    elbo_fn,
    initial_states,
    line_search_for,
    pvi_trio,
    record,
    result,
    start_log,
)
from fedppl.infer.variational import PVI as CorePVI
from fedppl.pyro.algorithms import conjugate, polya_gamma
from fedppl.pyro.bridge import to_jax, to_torch
from fedppl.pyro.checks import check_clients
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.client import client
from fedppl.pyro.result import PVIResult, jax_key
from fedppl.pyro.sites import cast_floats, curvature

__all__ = ["PVI", "GlobalVI", "PVIResult"]

SOLVERS = ("natural-gradient", "optim")
RESUMED = ("factors", "prior_factor", "local")  # what resume= takes from a result


class PVI(CorePVI):
    """Partitioned variational inference over the global sites of a Pyro model; the arguments
    are those of :class:`fedppl.PVI` (see it), with ``solver="optim"`` (``local_steps`` steps of
    ``optimizer``, a ``pyro.optim`` or ``torch.optim`` Adam, ClippedAdam, AdamW, SGD, RMSprop or
    Adagrad, or an optax optimiser; default Adam with learning rate 1e-2) in place of
    ``"optax"``, and no ``privacy``."""

    def __init__(self, model: Callable, guide: PVIGuide, schedule: str = "sequential",
                 damping: float = 1.0, *, solver: str = "natural-gradient",
                 optimizer: Any = None, local_steps: int | None = None,
                 num_particles: int | None = None, local_tol: float | None = None,
                 conjugate: bool | str = "auto", elbo_samples: int = 64,
                 clients_per_round: int | None = None, shrink_warning: float = 2.0,
                 line_search: bool | str | None = None,
                 max_divergence: float = pvi.MAX_DIVERGENCE):
        validation.pvi_settings(damping, conjugate, solver, SOLVERS, local_steps, num_particles,
                                local_tol, shrink_warning, max_divergence)
        if optimizer is not None and solver != "optim" and conjugate != "polya-gamma":
            warnings.warn("optimizer is used only by solver='optim'; the default "
                          "natural-gradient local step needs no optimiser and ignores it",
                          UserWarning, stacklevel=2)
        super().__init__(model, guide, schedule, damping, local_steps=local_steps,
                         num_particles=num_particles, local_tol=local_tol, conjugate=conjugate,
                         elbo_samples=elbo_samples, clients_per_round=clients_per_round,
                         shrink_warning=shrink_warning, line_search=line_search,
                         max_divergence=max_divergence)
        self.solver = solver
        self.optimizer = (solvers.DEFAULT_OPTIMIZER if optimizer is None
                          else as_optax(optimizer))

    def _plan(self, rng_key: jax.Array, clients: Clients, *, data_at_server: bool = True,
              factors: Any = None, resume: Any = None, **model_kwargs: Any) -> Plan:
        """The core's PVI plan, with the Pyro model's checks and local step."""
        model = solvers.bind(self.model, model_kwargs)
        guide = cast(PVIGuide, self.guide).setup(*clients.client(0), **model_kwargs)
        if self.conjugate == "polya-gamma" and guide.local_layout is None:
            polya_gamma.validate(model, guide, clients)
        check_clients(guide, clients, model_kwargs)
        guide = copy.copy(guide)
        choice = self._choose(model, guide, clients)
        if resume is not None:
            resume = SimpleNamespace(**to_jax({k: getattr(resume, k) for k in RESUMED}))
        server, cstates = initial_states(guide, clients.num_clients, to_jax(factors), resume,
                                         choice.prior is not None)
        line_search = line_search_for(self.line_search, None, data_at_server)
        trio = shared(pvi_trio, choice.local, self.damping, guide, choice.prior, line_search,
                      self.schedule, self.max_divergence)
        elbo = (shared(elbo_fn, choice.local, model, choice.prior, guide, self.elbo_samples)
                if self.elbo_samples > 0 else None)
        static = Static(guide, model, elbo, np.asarray(clients.sizes), None, None,
                        self.shrink_warning, line_search=line_search)
        return Plan(trio, self.schedule, server, cstates, record, _torch_result,
                    log=start_log(clients.num_clients), rng_key=rng_key, static=static)

    def _choose(self, model: Callable, guide: PVIGuide, clients: Clients) -> solvers.Choice:
        """The local solver (the core's, on the Pyro model) and the server's prior solver."""
        layout = guide.layout_or_raise()
        correction = None if guide.prior_correction is None else solvers.PriorCorrection(guide)
        fold_prior = self._pooled and correction is not None

        def opt(value, default):
            return default if value is None else value

        S, iters = opt(self.num_particles, 128), opt(self.local_steps, 100)
        tol = opt(self.local_tol, 1e-10)
        prior_solver = None
        if correction is not None and not fold_prior:
            prior_solver = PriorSolver(correction, S, iters, tol, hessian=curvature(layout))
        reason = None
        if guide.local_layout is not None:
            reason = "the model has local latent sites"
        elif fold_prior:
            reason = "the prior is not Gaussian (GlobalVI folds it into the likelihood)"
        local: Any = None
        if self.conjugate == "polya-gamma":
            if reason:
                raise ValueError(f"conjugate='polya-gamma' is not available: {reason}")
            local = polya_gamma.PolyaGammaSolver(model, guide, opt(self.local_steps, 200),
                                                 opt(self.local_tol, 1e-10))
        elif self.conjugate is not False and reason is None:
            data = cast_floats(clients.client(0), layout.dtype)
            mask = torch.ones(len(data[0]), dtype=torch.bool)
            why = conjugate.check(client(model, mask=mask), layout, *data)
            if why is None:
                local = conjugate.ConjugateSolver(model, guide)
            elif self.conjugate is True:
                raise ValueError(f"conjugate=True but the model is not conjugate: {why}")
        elif self.conjugate is True:
            raise ValueError(f"conjugate=True is not available: {reason}")
        if local is None and self.solver == "optim":
            if reason:
                raise ValueError(f"solver='optim' is not available: {reason}; use the default "
                                 "natural-gradient solver")
            local = pvi.VariationalSolver(model, guide, self.optimizer,
                                          opt(self.local_steps, 200),
                                          opt(self.num_particles, 8), opt(self.local_tol, 1e-4))
        if local is None:
            local = NaturalGradientSolver(model, guide, S, iters, tol,
                                          extra=correction if fold_prior else None,
                                          hessian=curvature(layout) if fold_prior
                                          else "pointwise")
        return solvers.Choice(local, prior_solver, None)

    def init(self, rng_key: torch.Generator, clients: Clients,  # type: ignore[override]
             factors: Any = None, *, resume: PVIResult | None = None, runtime: Any = None,
             **model_kwargs: Any) -> RunState:
        """Check the clients, set up the local solver, the initial factors (``factors`` or
        ``resume``'s, else flat) and the clients' private guides; ``runtime`` runs the rounds.
        Keyword arguments are the model's own static keyword arguments."""
        return super().init(jax_key(rng_key), clients, factors, resume=resume,
                            runtime=runtime, **model_kwargs)


def _torch_result(state: RunState, history: dict[str, np.ndarray],
                  rejected: list[tuple[int, str, str]]) -> PVIResult:
    out = result(state, history, rejected)
    return PVIResult(guide=out.guide, q=to_torch(out.q), factors=to_torch(out.factors),
                     history=history, client_names=out.client_names, rejected=out.rejected,
                     unconverged=out.unconverged, local=to_torch(out.local),
                     prior_factor=to_torch(out.prior_factor), model=out.model)


def as_optax(optimizer: Any) -> optax.GradientTransformation:
    """The optax optimiser that runs a ``pyro.optim`` optimiser (its constructor and arguments)
    or a ``torch.optim`` class (its defaults); an optax optimiser as it is."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    cls, a = getattr(optimizer, "pt_optim_constructor", optimizer), getattr(
        optimizer, "pt_optim_args", {})
    name = getattr(cls, "__name__", None)
    if callable(a) or name not in ("Adam", "ClippedAdam", "AdamW", "SGD"):
        raise TypeError("optimizer must be an Adam, ClippedAdam, AdamW or SGD from pyro.optim "
                        "(with a dict of arguments) or torch.optim, or an optax optimiser, such "
                        f"as pyro.optim.Adam({{'lr': 1e-2}}), got {optimizer!r}")
    lr, decay = a.get("lr", 1e-3), a.get("weight_decay", 1e-2 if name == "AdamW" else 0.0)
    if name == "SGD":
        return optax.sgd(lr, a.get("momentum") or None, a.get("nesterov", False))
    clip = a.get("clip_norm", 10.0 if name == "ClippedAdam" else None)
    parts = [optax.clip(clip)] if clip is not None else []
    parts += [optax.scale_by_adam(*a.get("betas", (0.9, 0.999)), eps=a.get("eps", 1e-8))]
    if decay:  # torch's Adam adds it to the gradient; AdamW to the step
        parts.insert(len(parts) - (name != "AdamW"), optax.add_decayed_weights(decay))
    lrd = a.get("lrd", 1.0)  # ClippedAdam's learning-rate decay per step
    return optax.chain(*parts, optax.scale_by_schedule(lambda t: -lr * lrd**t))


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

    def init(self, rng_key: torch.Generator, clients: Clients | tuple,  # type: ignore[override]
             factors: Any = None, *, resume: PVIResult | None = None, **kwargs: Any
             ) -> RunState:
        pooled = (clients.pooled() if isinstance(clients, Clients)
                  else Clients.from_list([clients]) if isinstance(clients, tuple) else clients)
        return super().init(rng_key, pooled, factors, resume=resume, **kwargs)

    def run(self, rng_key: torch.Generator, clients: Clients | tuple,  # type: ignore[override]
            num_rounds: int = 1, *, progress_bar: bool = False, **kwargs: Any) -> PVIResult:
        """Fit the pooled data (keyword arguments as for :meth:`PVI.run`)."""
        return cast(PVIResult, super().run(rng_key, clients,  # type: ignore[arg-type]
                                           num_rounds, progress_bar=progress_bar, **kwargs))
