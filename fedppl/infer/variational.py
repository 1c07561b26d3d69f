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
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import validation
from fedppl.algorithms import conjugate, natural_gradient, polya_gamma, pvi
from fedppl.algorithms.dp_pvi import DPLocalAveraging, DPOptimisation, DPVirtualParties
from fedppl.algorithms.natural_gradient import PriorSolver
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.infer.base import (
    FederatedMethod,
    Result,
    RunState,
    StopRule,
    check_rounds,
    check_tol,
)
from fedppl.infer.round_log import RoundLog
from fedppl.model_call import positional
from fedppl.runtime.embedded import SCHEDULES
from fedppl.sites import curvature

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
        self.optimizer = (optax.adam(1e-2) if optimizer is None
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
        self._compiled: dict = {}  # trio and ELBO function per solver, reused by later runs
        self._pooled = False  # GlobalVI: one client, the prior correction in its likelihood

    # -- set-up --------------------------------------------------------------------------------

    def _solver(self, clients: Clients, model: Callable, model_kwargs: dict
                ) -> tuple[pvi.LocalSolver, PriorSolver | None]:
        """The clients' local solver and (for a prior that is not Gaussian) the server's."""
        data = tuple(a[0] for a in clients.stacked)
        self.guide.setup(*clients.client(0), **model_kwargs)
        has_local = self.guide.local_layout is not None
        if self.conjugate == "polya-gamma" and self.guide.local_layout is None:
            polya_gamma.validate(model, self.guide, clients)  # its own, more specific errors
        check_clients(self.guide, clients, model_kwargs)
        correction = self.guide.prior_correction
        fold_prior = self._pooled and correction is not None

        def opt(value, default):
            return default if value is None else value

        S, iters = opt(self.num_particles, 128), opt(self.local_steps, 100)
        tol = opt(self.local_tol, 1e-10)
        prior_solver = None
        if correction is not None and not fold_prior:
            prior_solver = PriorSolver(correction, S, iters, tol,
                                       hessian=curvature(self.guide.layout))
        reason = None
        if has_local:
            reason = "the model has local latent sites"
        elif fold_prior:
            reason = "the prior is not Gaussian (GlobalVI folds it into the likelihood)"
        if self.privacy is not None and self.conjugate in (True, "polya-gamma"):
            raise ValueError(f"conjugate={self.conjugate!r} is not available with privacy=: a "
                             "private run's local step is DP optimisation")
        if self.conjugate == "polya-gamma":
            if reason:
                raise ValueError(f"conjugate='polya-gamma' is not available: {reason}")
            polya_gamma.validate(model, self.guide, clients)
            return (polya_gamma.PolyaGammaSolver(model, self.guide, opt(self.local_steps, 200),
                                                 opt(self.local_tol, 1e-10)), prior_solver)
        if self.conjugate is not False and reason is None and self.privacy is None:
            why = conjugate.check(client(model, mask=clients.mask[0]), self.guide.layout, *data)
            if why is None:
                return pvi.ConjugateSolver(model, self.guide), prior_solver
            if self.conjugate is True:
                raise ValueError(f"conjugate=True but the model is not conjugate: {why}")
        elif self.conjugate is True:
            raise ValueError(f"conjugate=True is not available: {reason}")
        if self.privacy is not None:
            if reason:
                raise ValueError(f"privacy= is not available: {reason}")
            steps, particles = opt(self.local_steps, 200), opt(self.num_particles, 8)
            self._sigma, self._dp_steps = self.privacy.calibrated(np.asarray(clients.sizes),
                                                                  steps), steps
            return (self.privacy.solver(model, self.guide, self.optimizer, steps, particles,
                                        self._sigma), prior_solver)
        if self.solver == "optax":
            if reason:
                raise ValueError(f"solver='optax' is not available: {reason}; use the default "
                                 "natural-gradient solver")
            return (pvi.VariationalSolver(model, self.guide, self.optimizer,
                                          opt(self.local_steps, 200), opt(self.num_particles, 8),
                                          opt(self.local_tol, 1e-4)), prior_solver)
        return (pvi.NaturalGradientSolver(model, self.guide, S, iters, tol,
                                          extra=correction if fold_prior else None,
                                          hessian=curvature(self.guide.layout)
                                          if fold_prior else "pointwise"), prior_solver)

    def init_factors(self, num_clients: int) -> g.Gaussian:
        """Flat factors ``t_k = 1`` for every client (q starts at the prior)."""
        zero = g.zeros_like(self.guide.prior)
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients, *x.shape)),
                                      zero)

    # -- the front's hooks ---------------------------------------------------------------------

    def _setup(self, rng_key: Array, clients: Clients, factors: g.Gaussian | None = None,
               resume: PVIResult | None = None, **model_kwargs: Any):
        model = partial(self.model, **model_kwargs) if model_kwargs else self.model
        solver, prior_solver = self._solver(clients, model, model_kwargs)
        K = clients.num_clients
        if resume is not None:
            factors = resume.factors
        factors = self.init_factors(K) if factors is None else g.strong(factors)
        want = self.init_factors(K)
        if jax.tree_util.tree_map(jnp.shape, factors) != jax.tree_util.tree_map(jnp.shape, want):
            raise ValueError(
                "the factors to resume from do not fit this model and these clients: shapes "
                f"{jax.tree_util.tree_map(jnp.shape, factors)}, expected "
                f"{jax.tree_util.tree_map(jnp.shape, want)} (a different number of clients or "
                "of features?)")
        t0 = None
        if prior_solver is not None:
            t0 = (resume.prior_factor if resume is not None and resume.prior_factor is not None
                  else g.zeros_like(self.guide.prior))
        server = pvi.init(self.guide.prior, factors, t0)
        local = self.guide.init_local()
        if local is not None:
            local = (resume.local if resume is not None and resume.local is not None else
                     jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), local))
        key = (solver, prior_solver)
        if key not in self._compiled:
            trio = pvi.make_trio(solver, self.damping, self.guide.prior,
                                 prior_solver=prior_solver, line_search=self.line_search,
                                 schedule=self.schedule, max_divergence=self.max_divergence)
            elbo = self._elbo_fn(solver, model, prior_solver) if self.elbo_samples > 0 else None
            self._compiled[key] = (trio, elbo)
        trio, self._elbo = self._compiled[key]
        self._model_as_run = model
        self._log = RoundLog(clients.names, self.shrink_warning)
        self._sizes = np.asarray(clients.sizes)
        self._dp_rounds = np.zeros(K, int)  # rounds each client took part in
        parties = (self.privacy.split(factors) if isinstance(self.privacy, DPVirtualParties)
                   else None)
        return trio, self.schedule, server, pvi.ClientState(factors, local, parties)

    def _message_bytes(self, msgs: pvi.ClientMessage) -> int:
        return g.num_bytes(jax.tree_util.tree_map(lambda x: x[0], msgs.delta))

    def _broadcast_bytes(self, server: pvi.ServerState) -> int:
        return g.num_bytes(server.q)

    def _refused(self, replies: Array, active: np.ndarray) -> np.ndarray:
        return np.asarray(replies) <= 0

    def _record(self, before, after, msgs, steps, active, rng_key) -> dict[str, Any]:
        q_old, q_new = before.server.q, after.server.q
        self._log.report(after.round - 1, np.asarray(steps), msgs, active, q_old, q_new)
        row = {"free_energy": np.where(active, np.asarray(msgs.free_energy), np.nan),
               "converged": np.where(active, np.asarray(msgs.converged, float), np.nan),
               "local_iterations": np.where(active, np.asarray(msgs.iterations, float), np.nan),
               "step": np.where(active, np.maximum(np.asarray(steps, float), 0.0), np.nan),
               "kl_change": float(_kl_change(q_new, q_old))}
        row["elbo"] = np.nan
        if self.privacy is not None:
            self._dp_rounds += np.asarray(active, bool)
            row["epsilon"] = self._epsilon()
        elif self._elbo is not None and self.data_at_server:
            row["elbo"] = float(self._elbo(after.server, after.clients, after.data, after.masks,
                                           rng_key))
        return row

    def _result(self, state, history, rejected) -> PVIResult:
        return PVIResult(guide=self.guide, q=state.server.q, factors=state.clients.factor,
                         history=history, rejected=self._log.rejected, client_names=self._names,
                         unconverged=self._log.unconverged, local=state.clients.local,
                         prior_factor=state.server.prior_factor, model=self._model_as_run,
                         privacy=self._privacy_report())

    def _epsilon(self) -> np.ndarray:
        assert self.privacy is not None
        return self.privacy.spent(self._sigma, self._dp_rounds, self._sizes, self._dp_steps)

    def _privacy_report(self) -> dict[str, Any] | None:
        if self.privacy is None:
            return None
        eps = self._epsilon()
        return {"epsilon": dict(zip(self._names, eps.tolist(), strict=True)),
                "worst_epsilon": float(eps.max()), "delta": self.privacy.delta,
                "noise_multiplier": self._sigma, "clip": self.privacy.clip}

    def _elbo_fn(self, solver: pvi.LocalSolver, model: Callable,
                 prior_solver: PriorSolver | None):
        """Jitted global ELBO ``sum_k E_q[log p(y_k, z_k | theta)] + H[q(z_k | theta)] +
        E_q[prior correction] - KL(q || p~)`` with fresh draws (in closed form for a conjugate
        model)."""
        guide, S = self.guide, self.elbo_samples

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
            total = jnp.sum(ell) - g.kl(q, guide.prior)
            if prior_solver is not None:
                theta = g.sample(jax.random.fold_in(key, 1), q, S)
                total = total + jnp.mean(jax.vmap(prior_solver.correction)(theta))
            return total

        return elbo

    # -- running -------------------------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, factors: g.Gaussian | None = None, *,
             resume: PVIResult | None = None, **model_kwargs: Any) -> RunState:
        """Set up the run: the local solver, the initial factors (``factors`` or ``resume``'s, else
        flat) and the clients' private guides. Keyword arguments are the model's own static
        keyword arguments (``n_groups=...``)."""
        state = super().init(rng_key, clients, factors=factors, resume=resume, **model_kwargs)
        return state._replace(rng_key=rng_key)  # PVI's set-up draws nothing: rounds use the key

    def update(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        if self.privacy is not None:  # the target's rounds are a budget
            self.privacy.check_rounds(state.round, 1)
        return super().update(state)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, *, progress_bar: bool = True,
            factors: g.Gaussian | None = None, tol: float | None = None,
            resume: PVIResult | None = None, **model_kwargs: Any) -> PVIResult:
        """Run up to ``num_rounds`` rounds of PVI; ``factors`` resumes from earlier client factors
        (``resume`` from an earlier result: its factors, prior factor and local guides).

        ``tol`` stops early, after the first round in which q moved by ``KL(q_new || q_old) <=
        tol`` (the ``kl_change`` history entry; the run then writes one line saying so and
        keeps it as ``result.stopped``). Other keyword arguments are the model's own static
        keyword arguments (``n_groups=...``), passed to every call of the model.
        """
        num_rounds = check_rounds(num_rounds)
        stop = self._tol_rule(check_tol(tol, self.name, self.tol_objective is not None))
        if self.privacy is not None:
            self.privacy.check_rounds(0, num_rounds)
        state = self.init(rng_key, clients, factors, resume=resume, **model_kwargs)
        return self._loop(state, num_rounds, progress_bar, stop)

    def _tol_rule(self, tol: float | None) -> StopRule | None:
        """Stop once q moves by ``KL(q_new || q_old) <= tol`` in a round."""
        if tol is None:
            return None

        def rule(rows: list[dict[str, Any]]) -> str | None:
            kl = float(rows[-1]["kl_change"])
            return f"kl_change {kl:.3g} <= tol {tol:g}" if kl <= tol else None

        return rule

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
