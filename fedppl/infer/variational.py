"""``PVI`` and ``GlobalVI``: run federated (or pooled) variational inference on a NumPyro model.

Example (logistic regression on 4 clients, against the pooled fit it converges to)::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import logistic_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 2))
    >>> y = (rng.uniform(size=200) < 1 / (1 + np.exp(-X @ np.array([1.5, -1.0])))) * 1.0
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=4, seed=0)
    >>> pvi = fedppl.PVI(model, fedppl.PVIGuide(model), schedule="synchronous",
    ...                  num_particles=32, elbo_samples=0)
    >>> result = pvi.run(jax.random.key(0), clients, num_rounds=8, progress_bar=False)
    >>> samples = result.sample(jax.random.key(1), 1000)
    >>> samples["w"].shape
    (1000, 2)
    >>> reference = fedppl.GlobalVI(model, fedppl.PVIGuide(model), num_particles=32,
    ...                             elbo_samples=0).run(jax.random.key(0), clients)
    >>> bool(np.allclose(result.mean_and_cov()[0], reference.mean_and_cov()[0], atol=1e-3))
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, ClassVar, cast

import numpy as np
import optax
from jax import Array

from fedppl import validation
from fedppl.algorithms import pvi, solvers
from fedppl.algorithms.dp_pvi import DPLocalAveraging, DPOptimisation, DPVirtualParties
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.infer.base import (
    FederatedMethod,
    Plan,
    RunState,
    StopRule,
    check_rounds,
    check_tol,
    shared,
)
from fedppl.infer.pvi_plan import (
    SOLVERS,
    Static,
    broadcast_bytes,
    check_line_search,
    elbo_fn,
    flat_factors,
    initial_states,
    kl_tol_rule,
    line_search_for,
    message_bytes,
    pvi_trio,
    record,
    refused,
    result,
    set_up,
    start_log,
)
from fedppl.infer.pvi_result import PVIResult
from fedppl.model_call import positional
from fedppl.runtime.embedded import SCHEDULES, Runtime

__all__ = ["PVI", "GlobalVI", "PVIResult"]


class PVI(FederatedMethod):
    """Partitioned variational inference over the global sites of a NumPyro model.

    :param model: an ordinary NumPyro model, called as ``model(*client_arrays, **model_kwargs)``
        (static keyword arguments are given to :meth:`run`); per-datum observations must sit in
        a plate over the data (``numpyro.plate("data", N)``, which may subsample). Any prior
        with a bijection to an unconstrained space enters exactly, through a prior factor the
        server refines (:func:`fedppl.sites.prior_correction`).
    :param guide: a :class:`~fedppl.guides.PVIGuide` for the model; its local sites (if any) get
        a private guide at each client.
    :param schedule: ``"sequential"`` (clients in turn), ``"synchronous"`` (all at once, vmapped)
        or ``"loop"`` (synchronous with a Python loop: for benchmarks).
    :param damping: ``rho`` in (0, 1]: a factor moves ``rho`` of the way to its new value.
    :param solver: the local step for models without a closed form: ``"natural-gradient"``
        (default; solves the local problem to ``local_tol``, see
        :mod:`fedppl.algorithms.natural_gradient`) or ``"optax"`` (``local_steps`` constant-step
        updates of ``optimizer``; its noise stays in the factors).
    :param optimizer: optax optimiser for ``solver="optax"`` (default ``adam(1e-2)``).
    :param local_steps: cap on the local step's iterations (natural-gradient: 100; Polya-Gamma
        CAVI sweeps: 200) or, for ``"optax"``, its number of steps (200).
    :param num_particles: Monte Carlo draws of the local objective: the fixed base draws of the
        natural-gradient step (128, even) or fresh draws per optax step (8).
    :param local_tol: the local step's convergence tolerance (natural-gradient: ``KL`` between
        successive iterates, 1e-10; optax: ``KL`` over the last tenth of the steps, 1e-4;
        Polya-Gamma: relative change of the variational parameters, 1e-10).
    :param conjugate: ``"auto"`` uses the closed-form update when the likelihood is Gaussian and
        affine in the global sites; ``True`` requires it; ``False`` never uses it;
        ``"polya-gamma"`` uses closed-form Polya-Gamma CAVI updates for Bernoulli-logit models
        (the Jaakkola-Jordan bound), see :mod:`fedppl.algorithms.polya_gamma`.
    :param elbo_samples: Monte Carlo samples for the per-round global ELBO (0 to skip it).
    :param clients_per_round: if given, that many clients, drawn at random each round, take part;
        the others send nothing and keep their factors (client sampling, or clients that dropped
        out of the round).
    :param line_search: with the natural-gradient or conjugate solver, the server of a synchronous
        round scales the combined update down (halving, as far as 2^-10) until the global ELBO,
        summed from the clients' expected log-likelihoods at the candidate q (with the solver's
        fixed draws, or in closed form), does not drop (one more exchange of scalars per round
        on a deployment). Keeps damping 1 from diverging where clients' updates over-count each
        other (mean-field guides on correlated posteriors, heavy-tailed likelihoods on many small
        clients); accepted steps below 1 are reported as shrunk updates. ``True``: every round;
        ``"adaptive"``: only in rounds whose full step would leave q not positive definite or
        move it further than the last round did (:func:`fedppl.algorithms.pvi.server_update`);
        ``False``: never. None (default): ``True`` where the runtime's server holds the data
        (the embedded runtime: scoring sends nothing), ``"adaptive"`` on a deployment (Flower:
        mostly one exchange a round), off with ``privacy`` (where any other value is refused).
    :param shrink_warning: warn (once per run, naming the clients whose updates shrink q most)
        when, in any round after the run's first, a marginal sd of q, or the geometric mean of
        its sds (q's entropy per dimension), falls by more than this factor.
    :param privacy: :class:`~fedppl.DPOptimisation` (DP-SGD local steps),
        :class:`~fedppl.DPLocalAveraging` or :class:`~fedppl.DPVirtualParties` (noised global
        updates): differentially private
        messages, accounted per client (:mod:`fedppl.algorithms.dp_pvi`); the local step is then
        ``local_steps`` (200) optax steps of ``optimizer`` with ``num_particles`` (8) draws, the
        line search and the ELBO history are off.
    :param max_divergence: the server refuses (and records, naming the client) a message that
        alone would change q by more than this Jeffreys divergence in nats per dimension
        (:func:`fedppl.algorithms.pvi.verdicts`; also refused: non-finite messages and messages
        with which q would not be positive definite).
    """

    name = "PVI"
    # the bar: the global ELBO (when estimated), how far q moved, a private run's worst epsilon
    progress: ClassVar[tuple[str, ...]] = ("elbo", "kl_change", "epsilon:max")
    tol_objective: ClassVar[str | None] = "kl_change"

    def __init__(self, model: Callable, guide: PVIGuide, schedule: str = "sequential",
                 damping: float = 1.0, *, solver: str = "natural-gradient",
                 optimizer: optax.GradientTransformation | None = None,
                 local_steps: int | None = None, num_particles: int | None = None,
                 local_tol: float | None = None, conjugate: bool | str = "auto",
                 elbo_samples: int = 64, clients_per_round: int | None = None,
                 shrink_warning: float = 2.0, line_search: bool | str | None = None,
                 max_divergence: float = pvi.MAX_DIVERGENCE,
                 privacy: DPOptimisation | DPLocalAveraging | DPVirtualParties | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        validation.pvi_settings(damping, conjugate, solver, SOLVERS, local_steps, num_particles,
                                local_tol, shrink_warning, max_divergence)
        if (optimizer is not None and solver != "optax" and conjugate != "polya-gamma"
                and privacy is None):
            warnings.warn("optimizer is used only by solver='optax'; the default "
                          "natural-gradient local step needs no optimiser and ignores it",
                          UserWarning, stacklevel=2)
        self.model = positional(model)  # data arguments may be keyword-only
        self.guide = guide
        self.schedule = schedule
        self.damping = float(damping)
        self.solver = solver
        self.optimizer = (solvers.DEFAULT_OPTIMIZER if optimizer is None
                          else validation.optimizer(optimizer))
        self.local_steps = None if local_steps is None else int(local_steps)
        self.num_particles = None if num_particles is None else int(num_particles)
        self.local_tol = local_tol
        self.conjugate = conjugate
        self.elbo_samples = int(elbo_samples)
        if clients_per_round is not None and clients_per_round < 1:
            raise ValueError(f"clients_per_round must be positive, got {clients_per_round}")
        self.clients_per_round = clients_per_round
        self.shrink_warning = float(shrink_warning)
        if privacy is not None and not isinstance(
                privacy, (DPOptimisation, DPLocalAveraging, DPVirtualParties)):
            raise TypeError(f"privacy must be a fedppl.DPOptimisation, DPLocalAveraging or "
                            f"DPVirtualParties, got {type(privacy).__name__}")
        self.line_search = check_line_search(line_search, privacy)
        self.privacy = privacy
        self.max_divergence = float(max_divergence)
        self._pooled = False  # GlobalVI: one client, the prior correction in its likelihood

    def _settings(self) -> solvers.Settings:
        return solvers.Settings(self.conjugate, self.solver, self.optimizer, self.local_steps,
                                self.num_particles, self.local_tol, self.privacy, self._pooled)

    def _check_runtime(self, runtime: Runtime) -> None:
        distributed = getattr(self.privacy, "distributed", None)
        if distributed is not None and not runtime.summed:
            raise ValueError(
                f"DPVirtualParties(distributed={distributed}) adds 1/{distributed} of the noise "
                "at each client, which protects the data only where the server sees no single "
                "message: run it under secure aggregation (runtime=SecureAggregation(...)"
                ".runtime, or Task(..., secure=...) on Flower), or leave distributed unset")

    def init_factors(self, num_clients: int) -> g.Gaussian:
        """Flat factors ``t_k = 1`` for every client (q starts at the prior)."""
        return flat_factors(self.guide.prior_or_raise(), num_clients)

    # -- the plan ------------------------------------------------------------------------------

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              factors: g.Gaussian | None = None, resume: PVIResult | None = None,
              **model_kwargs: Any) -> Plan:
        model = solvers.bind(self.model, model_kwargs)
        guide = set_up(self.guide, clients, model_kwargs, polya_gamma_model=(
            model if self.conjugate == "polya-gamma" else None))
        choice = solvers.choose_solver(self._settings(), model, guide, clients)
        server, cstates = initial_states(guide, clients.num_clients, factors, resume,
                                         choice.prior is not None)
        if isinstance(self.privacy, DPVirtualParties):
            cstates = cstates._replace(parties=self.privacy.split(cstates.factor))
        line_search = line_search_for(self.line_search, self.privacy, data_at_server)
        trio = shared(pvi_trio, choice.local, self.damping, guide, choice.prior, line_search,
                      self.schedule, self.max_divergence)
        elbo = (shared(elbo_fn, choice.local, model, choice.prior, guide, self.elbo_samples)
                if self.elbo_samples > 0 else None)
        static = Static(guide, model, elbo, np.asarray(clients.sizes), choice.calibration,
                        self.privacy, self.shrink_warning, line_search=line_search)
        return Plan(trio, self.schedule, server, cstates, record, result,
                    log=start_log(clients.num_clients), rng_key=rng_key, static=static,
                    about=guide.describe())

    # what the PVI family sends and refuses (shared with EP and OneShot)
    _message_bytes = staticmethod(message_bytes)
    _broadcast_bytes = staticmethod(broadcast_bytes)
    _refused = staticmethod(refused)

    # -- running -------------------------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, factors: g.Gaussian | None = None, *,
             resume: PVIResult | None = None, runtime: Any = None,
             **model_kwargs: Any) -> RunState:
        """Set up the run: the local solver, the initial factors (``factors`` or ``resume``'s, else
        flat) and the clients' private guides. Keyword arguments are the model's own static
        keyword arguments (``n_groups=...``); ``runtime`` runs the rounds (None: embedded)."""
        return super().init(rng_key, clients, runtime=runtime, factors=factors, resume=resume,
                            **model_kwargs)

    def update(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        privacy = self._started(state).static.privacy
        if privacy is not None:  # the target's rounds are a budget
            privacy.check_rounds(state.round, 1)
        return super().update(state)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, *, progress_bar: bool = True,
            factors: g.Gaussian | None = None, tol: float | None = None,
            resume: PVIResult | None = None, runtime: Any = None,
            **model_kwargs: Any) -> PVIResult:
        """Run up to ``num_rounds`` rounds of PVI; ``factors`` resumes from earlier client factors
        (``resume`` from an earlier result: its factors, prior factor and local guides).

        ``tol`` stops early, after the first round in which q moved by ``KL(q_new || q_old) <=
        tol`` (the ``kl_change`` history entry; the run then writes one line saying so and
        keeps it as ``result.stopped``). ``runtime`` runs the rounds (None: the embedded
        runtime; see :class:`fedppl.runtime.Runtime`). Other keyword arguments are the
        model's own static keyword arguments (``n_groups=...``), passed to every call of the
        model.
        """
        num_rounds = check_rounds(num_rounds)
        stop = kl_tol_rule(check_tol(tol, self.name, self.tol_objective is not None))
        if self.privacy is not None:
            self.privacy.check_rounds(0, num_rounds)
        state = self.init(rng_key, clients, factors, resume=resume, runtime=runtime,
                          **model_kwargs)
        return cast(PVIResult, self._loop(state, num_rounds, progress_bar, stop))

    def _tol_rule(self, tol: float | None) -> StopRule | None:
        return kl_tol_rule(tol)



class GlobalVI(PVI):
    """The same guide family fitted to the pooled data: the answer PVI converges to.

    PVI with one client holding all the data (its cavity is the prior's Gaussian base, and a
    prior correction, if any, is part of its likelihood, so its local free energy is the global
    ELBO), with the same local solver. With the default natural-gradient solver and the same
    ``num_particles``, PVI's fixed point is exactly this one (the same fixed draws; see
    :mod:`fedppl.algorithms.natural_gradient`). ``init`` and ``run`` pool the :class:`Clients`
    (or take the model's arrays as a tuple); one round solves the pooled problem to ``tol``, so
    ``num_rounds`` defaults to 1.

    :param num_steps: the solver's cap (natural-gradient iterations, or optax steps).
    :param local_tol: the solver's convergence tolerance (as for :class:`PVI`).
    :param tol: deprecated: the old name of ``local_tol``. As for every method, ``tol`` is now
        an argument of :meth:`run` (stop once q moves by ``KL <= tol`` in a round).
    """

    name = "GlobalVI"

    def __init__(self, model: Callable, guide: PVIGuide,
                 optimizer: optax.GradientTransformation | None = None, num_steps: int = 2000,
                 num_particles: int | None = None, conjugate: bool | str = "auto",
                 elbo_samples: int = 64, solver: str = "natural-gradient",
                 tol: float | None = None, *, local_tol: float | None = None):
        if tol is not None:
            if local_tol is not None:
                raise TypeError("give local_tol (the solver's tolerance) only; tol is its "
                                "deprecated name")
            warnings.warn("GlobalVI(tol=...) is deprecated: it is the local solver's tolerance, "
                          "now local_tol=...; tol is an argument of run(), as for every method "
                          "(stop once q moves by KL <= tol in a round)", DeprecationWarning,
                          stacklevel=2)
            local_tol = tol
        super().__init__(model, guide, "sequential", 1.0, solver=solver, optimizer=optimizer,
                         local_steps=num_steps, num_particles=num_particles,
                         local_tol=local_tol, conjugate=conjugate, elbo_samples=elbo_samples)
        self._pooled = True

    def init(self, rng_key: Array, clients: Clients | tuple, factors: g.Gaussian | None = None,
             *, resume: PVIResult | None = None, **model_kwargs: Any) -> RunState:
        pooled = (clients.pooled() if isinstance(clients, Clients)
                  else Clients.from_list([clients]) if isinstance(clients, tuple) else clients)
        return super().init(rng_key, pooled, factors, resume=resume, **model_kwargs)

    def run(self, rng_key: Array, clients: Clients | tuple, num_rounds: int = 1, *,
            progress_bar: bool = True, **kwargs: Any) -> PVIResult:
        """Fit the pooled data (keyword arguments as for :meth:`PVI.run`: ``tol``...)."""
        return super().run(rng_key, clients, num_rounds, progress_bar=progress_bar, **kwargs)
