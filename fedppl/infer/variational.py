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

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import trees, validation
from fedppl.algorithms import conjugate, natural_gradient, polya_gamma, pvi, solvers
from fedppl.algorithms.dp_pvi import DPLocalAveraging, DPOptimisation, DPVirtualParties
from fedppl.algorithms.natural_gradient import PriorSolver
from fedppl.algorithms.trio import Trio
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.infer.base import (
    FederatedMethod,
    Plan,
    Result,
    RunState,
    StopRule,
    check_rounds,
    check_tol,
    shared,
)
from fedppl.infer.round_log import RoundRecord, report
from fedppl.model_call import positional
from fedppl.runtime.embedded import SCHEDULES

__all__ = ["PVI", "GlobalVI", "PVIResult"]

SOLVERS = ("natural-gradient", "optax")


@dataclass(kw_only=True)
class PVIResult(Result):
    """The outcome of a run: the posterior ``q``, the client factors and per-round history.

    ``history`` maps to arrays with one row per round: ``free_energy`` (rounds, K) local free
    energies, ``converged`` (rounds, K; 1, 0, or NaN for a client not in the round) whether each
    local step met its tolerance, ``local_iterations`` (rounds, K), ``kl_change`` the KL from
    the previous round's q to this round's (how far q still moves), ``elbo`` global ELBO
    estimate, ``messages_up``/``messages_down`` and ``bytes_up``/``bytes_down`` (per round),
    ``seconds``, ``step`` (rounds, K) the step each client's update was applied with (1 in
    full, less when the server shrank it, 0 when it refused it). ``rejected`` lists
    ``(round, client, reason)`` for updates the server refused; ``unconverged`` lists
    ``(round, client)`` for local steps that stopped at their cap. A private run (``privacy=``)
    adds ``epsilon`` (rounds, K): each client's cumulative epsilon after each round.
    """

    guide: PVIGuide
    q: g.Gaussian
    factors: g.Gaussian
    unconverged: list[tuple[int, str]] = field(default_factory=list)
    local: g.Conditional | None = None  # the clients' private guides, stacked (local sites)
    prior_factor: g.Gaussian | None = None  # the server's t_0 (non-Gaussian priors)
    model: Callable | None = None  # the model as run (static keyword arguments bound)
    # a private run's guarantee: per-client ``epsilon``, ``worst_epsilon``, ``delta``,
    # ``noise_multiplier`` (see fedppl.algorithms.dp_pvi); None for a non-private run
    privacy: dict[str, Any] | None = None
    # history entries (rounds, K) that to_arviz exports per client for the last round
    client_stats: ClassVar[tuple[str, ...]] = ()

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        if self.privacy is not None:  # the guarantee travels with the result's summary
            out.update(epsilon=self.privacy["worst_epsilon"], delta=self.privacy["delta"])
        return out

    @property
    def posterior(self) -> dict[str, Any]:
        """Per-site marginal distributions of the global sites (constrained space)."""
        return self.guide.posterior(self.q)

    def sample(self, rng_key: Array, num_samples: int, client: int | str | None = None
               ) -> dict[str, Array]:
        """Joint posterior draws keyed by site name, constrained: ``{name: (num_samples, ...)}``.

        ``client`` (an index or a name) adds that client's local sites, drawn from its private
        guide given each draw of the global ones."""
        local = None
        if client is not None:
            k = self._client_index(client, self.factors.nat1.shape[0])
            local = None if self.local is None else jax.tree_util.tree_map(lambda x: x[k],
                                                                           self.local)
        return self.guide.sample(rng_key, self.q, num_samples, local)

    def predictive(self, rng_key: Array, *args: Any, num_samples: int = 1000,
                   client: int | str | None = None, **kwargs: Any) -> dict[str, Array]:
        """Posterior predictive draws of the model at new inputs (numpyro's ``Predictive`` with
        this posterior's draws; ``client`` uses that client's local sites). Pass the model's
        arguments with ``y=None`` (or without the observations) to predict them."""
        from numpyro.infer import Predictive

        key_post, key_pred = jax.random.split(rng_key)
        draws = self.sample(key_post, num_samples, client)
        model = self.model if self.model is not None else self.guide.model
        return Predictive(model, posterior_samples=draws)(key_pred, *args, **kwargs)

    def mean_and_cov(self) -> tuple[Array, Array]:
        """Mean and covariance of q over the flat unconstrained vector."""
        return g.to_moments(self.q)

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000):
        """An ``xarray.DataTree`` for ArviZ 1.x (``arviz_base.from_dict``): ``num_samples``
        draws of q as 4 chains, the factors per client (see :mod:`fedppl.arviz`; needs
        ``pip install 'fedppl[arviz]'``)."""
        from fedppl.arviz import to_inference_data

        return to_inference_data(self, rng_key, num_samples)

    def check(self, rng_key: Array, clients: Clients, num_draws: int = 1000, *,
              progress_bar: bool = False, **kwargs: Any):
        """How far ``q`` is from the posterior the pooled data give, in one more round: ``S``
        draws of the global sites to every client, ``S`` log-likelihoods back; Pareto k-hat,
        effective sample size and corrected moments (:class:`fedppl.infer.importance.Importance`
        takes the other keyword arguments: ``df``, ``local_draws``, ...; the rest are the
        model's static keyword arguments, by default those the run was given). Warns when k-hat
        says the answer is unreliable. Needs ``fedppl[arviz]`` (arviz-stats' PSIS)."""
        return self._importance(rng_key, clients, 1, num_draws, progress_bar, kwargs)

    def refine(self, rng_key: Array, clients: Clients, num_rounds: int = 10,
               num_draws: int = 1000, *, progress_bar: bool = True, **kwargs: Any):
        """The check's exchange repeated (round 1 is the check), each round proposing from a t
        fitted to the weighted draws so far, until k-hat is below ``khat_target`` (0.5) and the
        ESS above ``ess_target`` (2000), or ``num_rounds``: an
        :class:`~fedppl.infer.importance.ImportanceResult` whose moments and draws converge to
        the pooled posterior's as the draws grow."""
        return self._importance(rng_key, clients, num_rounds, num_draws, progress_bar, kwargs)

    def _importance(self, rng_key, clients, num_rounds, num_draws, progress_bar, kwargs):
        from fedppl.infer.importance import SETTINGS, Importance

        if self.privacy is not None:
            raise ValueError("this run is differentially private, and the check's messages (each "
                             "client's log-likelihood at shared draws) are not privatised or "
                             "accounted for: fedppl refuses to check a private run rather than "
                             "spend privacy it has not counted")
        warn = bool(kwargs.pop("warn", True))
        settings = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTINGS}
        model_kwargs = dict(getattr(self.model, "keywords", None) or {})
        model_kwargs.update(kwargs)
        method = Importance(self.guide.model, self.guide, self.q, num_draws=num_draws,
                            **settings)
        return method.run(rng_key, clients, num_rounds, progress_bar=progress_bar,
                          local=self.local, warn=warn, **model_kwargs)


def message_bytes(msgs: Any) -> int:
    """Bytes of one client's factor update (messages stacked on the client axis)."""
    return g.num_bytes(trees.first(msgs.delta))


def broadcast_bytes(server: pvi.ServerState) -> int:
    """Bytes of what the server sends each client: q."""
    return g.num_bytes(server.q)


def refused(replies: Array, active: np.ndarray) -> np.ndarray:
    """The clients whose update the server did not accept (a step of 0 or a refusal code)."""
    return np.asarray(replies) <= 0


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
        fixed draws, or in closed form), does not drop (one more exchange of scalars per round).
        Keeps damping 1 from diverging where clients' updates over-count each other (mean-field
        guides on correlated posteriors, many small clients); accepted steps below 1 are reported
        as shrunk updates. On by default; off (and refused) with ``privacy``.
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
                 shrink_warning: float = 2.0, line_search: bool | None = None,
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
        if privacy is not None and line_search:
            raise ValueError("line_search scores candidate q on the clients' data, which a "
                             "private run does not release: leave it off with privacy=")
        self.privacy = privacy
        self.line_search = privacy is None if line_search is None else bool(line_search)
        self.max_divergence = float(max_divergence)
        self._pooled = False  # GlobalVI: one client, the prior correction in its likelihood

    def _settings(self) -> solvers.Settings:
        return solvers.Settings(self.conjugate, self.solver, self.optimizer, self.local_steps,
                                self.num_particles, self.local_tol, self.privacy, self._pooled)

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
        trio = shared(_pvi_trio, choice.local, self.damping, guide, choice.prior,
                      self.line_search, self.schedule, self.max_divergence)
        elbo = (shared(elbo_fn, choice.local, model, choice.prior, guide, self.elbo_samples)
                if self.elbo_samples > 0 else None)
        static = Static(guide, model, elbo, np.asarray(clients.sizes), choice.calibration,
                        self.privacy, self.shrink_warning)
        return Plan(trio, self.schedule, server, cstates, record, result,
                    log=start_log(clients.num_clients), rng_key=rng_key, static=static)

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
        runtime; see :class:`fedppl.infer.base.Runtime`). Other keyword arguments are the
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


# -- the pieces PVI, GlobalVI, EP and OneShot share -------------------------------------------


class Static(NamedTuple):
    """The static part of a Gaussian-q plan (``plan.static``): the guide as set up for the run
    (a copy that later set-ups of the method's guide leave alone), the model as run (static
    keyword arguments bound), the compiled global ELBO (None: none), the clients' sizes, a
    private run's calibration and settings, the shrink warning's factor, EP's damping (a number
    or a function of the server's round) and a one-shot's method (``"consensus"``: the server
    merges the clients' draws)."""

    guide: PVIGuide
    model: Callable
    elbo: Callable | None
    sizes: np.ndarray
    calibration: solvers.Calibration | None
    privacy: Any
    shrink_warning: float
    rho: Any = None
    one_shot: str | None = None


class Log(NamedTuple):
    """A Gaussian-q run's accumulators (``state.log.method``): the round log's record, the
    rounds each client took part in (privacy accounting) and a consensus one-shot's merged
    draws."""

    rounds: RoundRecord
    dp_rounds: np.ndarray
    merged: Array | None = None


def start_log(num_clients: int) -> Log:
    return Log(RoundRecord(), np.zeros(num_clients, int))


def set_up(guide: PVIGuide, clients: Clients, model_kwargs: dict,
           polya_gamma_model: Callable | None = None) -> PVIGuide:
    """``guide`` set up on client 0's data, the clients checked against the model (every
    observation in its support, local sites of one shape), and a copy of the guide that the
    run keeps (later set-ups of ``guide`` on other shapes leave it alone). With
    ``polya_gamma_model``, Polya-Gamma's own checks come first (their errors say more)."""
    guide.setup(*clients.client(0), **model_kwargs)
    if polya_gamma_model is not None and guide.local_layout is None:
        polya_gamma.validate(polya_gamma_model, guide, clients)
    check_clients(guide, clients, model_kwargs)
    return copy.copy(guide)


def flat_factors(prior: g.Gaussian, num_clients: int) -> g.Gaussian:
    """Flat factors ``t_k = 1`` for ``num_clients`` clients, stacked."""
    zero = g.zeros_like(prior)
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients, *x.shape)), zero)


def initial_states(guide: PVIGuide, K: int, factors: g.Gaussian | None,
                   resume: PVIResult | None, prior_factor: bool
                   ) -> tuple[pvi.ServerState, pvi.ClientState]:
    """The server's and the clients' first states: the factors (``factors`` or ``resume``'s,
    checked against the model's shapes, else flat), the server's prior factor (``resume``'s, or
    flat) where ``prior_factor``, and the clients' private guides."""
    prior = guide.prior_or_raise()
    if resume is not None:
        factors = resume.factors
    want = flat_factors(prior, K)
    factors = want if factors is None else g.strong(factors)
    if jax.tree_util.tree_map(jnp.shape, factors) != jax.tree_util.tree_map(jnp.shape, want):
        raise ValueError(
            "the factors to resume from do not fit this model and these clients: shapes "
            f"{jax.tree_util.tree_map(jnp.shape, factors)}, expected "
            f"{jax.tree_util.tree_map(jnp.shape, want)} (a different number of clients or "
            "of features?)")
    t0 = None
    if prior_factor:
        t0 = (resume.prior_factor if resume is not None and resume.prior_factor is not None
              else g.zeros_like(prior))
    local = guide.init_local()
    if local is not None:
        local = (resume.local if resume is not None and resume.local is not None else
                 jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), local))
    return pvi.init(prior, factors, t0), pvi.ClientState(factors, local)


def record(before: RunState, after: RunState, msgs: Any, steps: Array, active: np.ndarray,
           rng_key: Array) -> tuple[Log, dict[str, Any]]:
    """A round's history columns (``free_energy``, ``converged``, ``local_iterations``,
    ``step``, ``kl_change``, ``elbo``, a private run's ``epsilon``) and the accumulators after
    it (the round log warns here, naming the clients)."""
    plan = after.plan
    assert plan is not None  # a started run's state
    st, log = plan.static, after.log.method
    q_old, q_new = before.server.q, after.server.q
    steps = np.asarray(steps)
    rounds = report(log.rounds, plan.names, st.shrink_warning, after.round - 1, steps, msgs,
                    active, q_old, q_new)
    row = {"free_energy": np.where(active, np.asarray(msgs.free_energy), np.nan),
           "converged": np.where(active, np.asarray(msgs.converged, float), np.nan),
           "local_iterations": np.where(active, np.asarray(msgs.iterations, float), np.nan),
           "step": np.where(active, np.maximum(np.asarray(steps, float), 0.0), np.nan),
           "kl_change": float(_kl_change(q_new, q_old))}
    row["elbo"] = np.nan
    dp_rounds = log.dp_rounds
    if st.privacy is not None:
        dp_rounds = dp_rounds + np.asarray(active, bool)
        row["epsilon"] = _epsilon(st, dp_rounds)
    elif st.elbo is not None and plan.data_at_server:
        row["elbo"] = float(st.elbo(after.server, after.clients, after.data, after.masks,
                                    rng_key))
    return log._replace(rounds=rounds, dp_rounds=dp_rounds), row


def result(state: RunState, history: dict[str, np.ndarray],
           rejected: list[tuple[int, str, str]]) -> PVIResult:
    """The result of a run that ended in ``state`` (the refusals are the round log's)."""
    plan = state.plan
    assert plan is not None  # a started run's state
    st, log = plan.static, state.log.method
    return PVIResult(guide=st.guide, q=state.server.q, factors=state.clients.factor,
                     history=history, rejected=list(log.rounds.rejected),
                     client_names=plan.names, unconverged=list(log.rounds.unconverged),
                     local=state.clients.local, prior_factor=state.server.prior_factor,
                     model=st.model, privacy=_privacy_report(st, log, plan.names))



def kl_tol_rule(tol: float | None) -> StopRule | None:
    """``run(..., tol=)``: stop once q moves by ``KL(q_new || q_old) <= tol`` in a round."""
    if tol is None:
        return None

    def rule(rows: list[dict[str, Any]]) -> str | None:
        kl = float(rows[-1]["kl_change"])
        return f"kl_change {kl:.3g} <= tol {tol:g}" if kl <= tol else None

    return rule


def _epsilon(st: Static, dp_rounds: np.ndarray) -> np.ndarray:
    assert st.privacy is not None and st.calibration is not None
    return st.privacy.spent(st.calibration.sigma, dp_rounds, st.sizes, st.calibration.steps)


def _privacy_report(st: Static, log: Log, names: tuple[str, ...]) -> dict[str, Any] | None:
    if st.privacy is None:
        return None
    assert st.calibration is not None  # calibrated with the solver
    eps = _epsilon(st, log.dp_rounds)
    return {"epsilon": dict(zip(names, eps.tolist(), strict=True)),
            "worst_epsilon": float(eps.max()), "delta": st.privacy.delta,
            "noise_multiplier": st.calibration.sigma, "clip": st.privacy.clip}


# -- compiled once per (model, guide, settings) ----------------------------------------------


def _pvi_trio(solver: pvi.LocalSolver, damping: float, guide: PVIGuide,
              prior_solver: PriorSolver | None, line_search: bool, schedule: str,
              max_divergence: float) -> Trio:
    """PVI's trio (made once per settings and guide through :func:`fedppl.infer.base.shared`,
    so one round, compiled once: see :func:`fedppl.infer.base.embedded_round`)."""
    return pvi.make_trio(solver, damping, guide.prior_or_raise(), prior_solver=prior_solver,
                         line_search=line_search, schedule=schedule,
                         max_divergence=max_divergence)


def elbo_fn(solver: pvi.LocalSolver, model: Callable, prior_solver: PriorSolver | None,
             guide: PVIGuide, S: int) -> Callable:
    """Jitted global ELBO ``sum_k E_q[log p(y_k, z_k | theta)] + H[q(z_k | theta)] +
    E_q[prior correction] - KL(q || p~)`` with ``S`` fresh draws (in closed form for a
    conjugate model); made once per solver, model and guide through
    :func:`fedppl.infer.base.shared`."""
    prior = guide.prior_or_raise()

    if isinstance(solver, pvi.ConjugateSolver):

        def per_client(q, data_k, mask_k, local_k, key):
            lik = conjugate.likelihood_terms(client(model, mask=mask_k), guide.layout, *data_k)
            mean, cov = g.to_moments(g.to_full(q))
            return conjugate.expected_log_lik(lik, mean, cov)

    else:

        def per_client(q, data_k, mask_k, local_k, key):
            log_lik = natural_gradient.log_lik_fn(model, guide, data_k, mask_k)
            joint = q if local_k is None else g.join(q, local_k, guide.client_diag)
            phi = g.sample(key, joint, S)
            ll = jnp.mean(jax.vmap(log_lik)(phi, jnp.arange(S)))
            return ll if local_k is None else ll + g.conditional_entropy(local_k)

    @jax.jit
    def elbo(state, clients, data, masks, key):
        q = state.q
        keys = jax.random.split(key, masks.shape[0])
        ell = jax.vmap(per_client, in_axes=(None, 0, 0, 0, 0))(q, data, masks, clients.local,
                                                               keys)
        total = jnp.sum(ell) - g.kl(q, prior)
        if prior_solver is not None:
            theta = g.sample(jax.random.fold_in(key, 1), q, S)
            total = total + jnp.mean(jax.vmap(prior_solver.correction)(theta))
        return total

    return elbo


def check_clients(guide: PVIGuide, clients: Clients, model_kwargs: dict) -> None:
    """Before anything is compiled: every client's observations lie in their likelihood's
    support (Bernoulli labels in {0, 1}, counts non-negative integers...), and every client's
    model gives each local site the shape of the padded prototype."""
    from numpyro import handlers

    want = {} if guide.local_layout is None else {s.name: s.shape
                                                  for s in guide.local_layout.sites}
    if not want and clients.num_clients > 1 and _observations_in_support(
            guide.model, clients.pooled().client(0), model_kwargs):
        return  # one trace of the pooled rows; the loop below only to name a failing client
    for k in range(clients.num_clients):
        who = clients.names[k]
        try:
            tr = handlers.trace(handlers.seed(guide.model, 0)).get_trace(*clients.client(k),
                                                                         **model_kwargs)
        except Exception as err:  # the model's own error, with the client's name
            raise ValueError(f"{who}: the model fails on this client's data: {err}") from err
        for name, site in tr.items():
            if site["type"] != "sample" or not site["is_observed"]:
                continue
            inside = np.asarray(site["fn"].support(site["value"]))
            if not inside.all():
                bad = np.asarray(site["value"])[~inside] if inside.shape == np.shape(
                    site["value"]) else np.asarray(site["value"]).ravel()[:5]
                raise ValueError(f"{who}: observed site '{name}' has values outside its "
                                 f"distribution's support {site['fn'].support} (e.g. "
                                 f"{np.unique(bad)[:5].tolist()})")
        for name, shape in want.items():
            if name not in tr:
                raise ValueError(f"{who}: the model has no local site '{name}' with this "
                                 "client's data")
            got = tuple(jnp.shape(tr[name]["value"]))
            if got != shape:
                raise ValueError(
                    f"local site '{name}' has shape {got} for {who} but {shape} for "
                    f"{clients.names[0]}; every client's private guide must have one shape. Give "
                    "the model the number of groups as a static keyword argument (the largest "
                    "over clients; groups without data keep their prior)"
                )


def _observations_in_support(model: Callable, data: tuple, model_kwargs: dict) -> bool:
    """Whether the model runs on ``data`` with every observation in its likelihood's support."""
    from numpyro import handlers

    try:
        tr = handlers.trace(handlers.seed(model, 0)).get_trace(*data, **model_kwargs)
    except Exception:
        return False
    return all(bool(np.all(site["fn"].support(site["value"]))) for site in tr.values()
               if site["type"] == "sample" and site["is_observed"])


@jax.jit
def _kl_change(q_new: g.Gaussian, q_old: g.Gaussian) -> Array:
    return g.kl(q_new, q_old)


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
