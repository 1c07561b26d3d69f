"""``SMC``: the pooled posterior by a federated tempered SMC sampler, started from a federated
answer; and :class:`SMCResult`, its particles.

The sampler (:mod:`fedppl.algorithms.smc` makes its trio) is a plan like every method's, so it
runs on the embedded runtime (every client and every particle in one compiled round) and on
Flower. A client's local sites (random effects) stay with it: it integrates them by an
importance estimate whose normal draws are part of the particle and are kept, and refreshed, at
the client; only its log-likelihood estimates at the particles leave it.

``result.refine(rng_key, clients)`` of a :class:`~fedppl.PVIResult` (PVI, GlobalVI, EP,
OneShot) runs it where the model has local sites or the check is flagged; ``SMC`` itself takes
any Gaussian start.

Example (a conjugate model: the particles' moments are the exact posterior's, within their
stated Monte Carlo error)::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2) + rng.normal(size=200),
    ...                                        num_clients=4, seed=0)
    >>> pvi = fedppl.PVI(model, fedppl.PVIGuide(model, family="fullrank"))
    >>> start = pvi.run(jax.random.key(0), clients, num_rounds=2, progress_bar=False)
    >>> smc = fedppl.SMC(model, start.guide, start.q, num_particles=500, islands=5)
    >>> result = smc.run(jax.random.key(1), clients, progress_bar=False)
    >>> result.reached, float(result.history["beta"][-1])
    (True, 1.0)
    >>> mean, cov = result.mean_and_cov()
    >>> bool(np.all(np.abs(mean - start.mean_and_cov()[0]) < 5 * result.mcse()["mean"] + 1e-3))
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import validation
from fedppl.algorithms import importance as imp
from fedppl.algorithms import natural_gradient
from fedppl.algorithms import smc as alg
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.infer.base import (
    FederatedMethod,
    Plan,
    Result,
    RunState,
    StopRule,
    check_rounds,
    shared,
)
from fedppl.infer.importance import set_up_on
from fedppl.model_call import positional

__all__ = ["SMC", "SMCResult", "MIN_PARTICLES", "LOCAL_SD_WARN", "drift_threshold"]

#: Fewest particles per island (the islands' spread is the Monte Carlo error).
MIN_PER_ISLAND = 20
#: Fewest particles in all.
MIN_PARTICLES = 100


@dataclass(kw_only=True)
class SMCResult(Result):
    """Equally weighted particles of the pooled posterior over the global sites, and how far to
    trust them.

    ``particles`` ``(N, D)``: the flat unconstrained vectors (the guide's layout), in
    ``islands`` equal islands that were resampled separately; ``log_lik`` ``(N,)``: the clients'
    summed log-likelihood (estimate) at each. ``reached``: the run got to temperature 1;
    ``renewed``: the share of particles that moved at temperature 1. ``mcse()`` gives the Monte
    Carlo error of each reported mean and sd, from the islands' spread. ``history`` has one row
    per round: ``beta`` (the temperature after the round), ``stage``, ``ess`` (the islands' ESS
    share of the last reweighting), ``khat`` (Pareto k-hat of a reweighting's weights, NaN in
    other rounds), ``accepted`` (the share of particles moved), ``refreshed`` (the clients' mean
    share of refreshed auxiliary draws), ``unique`` (distinct particles), ``renewed`` (the share
    moved at temperature 1), ``drift`` (how far the moments moved over the last 3 rounds at
    temperature 1, in Monte Carlo errors), ``local_sd`` (with local sites: the sd, in nats, of
    the clients' summed log-likelihood estimates, from each client's median variance; above
    :data:`LOCAL_SD_WARN` the moves mix slowly and ``mcse()`` can understate the error),
    ``done``, and the common columns (``seconds``, ``bytes_up``...). ``chosen``: why
    ``refine`` chose this sampler (empty when run directly). Local sites are not in the
    result: they never left their clients."""

    guide: PVIGuide
    particles: np.ndarray
    log_lik: np.ndarray
    islands: int
    reached: bool
    renewed: float
    start_moments: tuple[np.ndarray, np.ndarray]
    model: Callable | None = None
    chosen: str = ""

    @property
    def local_sd(self) -> float:
        """The last round's ``local_sd`` (0 without local sites)."""
        return float(self.history["local_sd"][-1])

    def mean_and_cov(self) -> tuple[np.ndarray, np.ndarray]:
        """The particles' mean and covariance over the flat unconstrained vector."""
        x = np.asarray(self.particles, np.float64)
        return x.mean(0), np.atleast_2d(np.cov(x.T))

    def mcse(self) -> dict[str, np.ndarray]:
        """Monte Carlo standard errors of each coordinate's mean and sd: the spread of the
        islands' estimates over ``sqrt(islands)`` (each island was resampled on its own)."""
        x = np.asarray(self.particles, np.float64).reshape(self.islands, -1,
                                                           self.particles.shape[1])
        means, sds = x.mean(1), x.std(1, ddof=1)
        root = np.sqrt(self.islands)
        return {"mean": means.std(0, ddof=1) / root, "sd": sds.std(0, ddof=1) / root}

    def sample(self, rng_key: Array, num_samples: int) -> dict[str, Array]:
        """``num_samples`` particles drawn uniformly with replacement, constrained, keyed by
        site name (read ``mcse()`` beside them: there are ``N`` distinct draws at most)."""
        num_samples = validation.positive_int(num_samples, "num_samples")
        idx = jax.random.randint(rng_key, (num_samples,), 0, len(self.particles))
        return self.guide.layout_or_raise().constrain(jnp.asarray(self.particles)[idx])

    def predictive(self, rng_key: Array, *args: Any, num_samples: int = 1000,
                   **kwargs: Any) -> dict[str, Array]:
        """Posterior predictive draws of the model at new inputs (numpyro's ``Predictive`` with
        the particles; local sites are drawn from their prior given them)."""
        from numpyro.infer import Predictive

        key_post, key_pred = jax.random.split(rng_key)
        draws = self.sample(key_post, num_samples)
        model = self.model if self.model is not None else self.guide.model
        return Predictive(model, posterior_samples=draws)(key_pred, *args, **kwargs)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        mc = self.mcse()
        out.update(particles=len(self.particles), islands=self.islands, reached=self.reached,
                   renewed=self.renewed, worst_mcse_mean=float(np.max(mc["mean"])),
                   local_sd=self.local_sd)
        return out

    def to_arviz(self, rng_key: Array | None = None, num_samples: int | None = None):
        """An ``xarray.DataTree`` for ArviZ 1.x: the particles as draws, one chain per island
        (so ``r_hat`` compares the islands); ``sample_stats``: each particle's summed
        log-likelihood, and the per-round diagnostics on a ``round`` dimension (``beta``,
        ``ess``, ``khat``, ``accepted``, ``unique``)."""
        from fedppl import arviz

        n = len(self.particles) // self.islands
        draws = self.guide.layout_or_raise().constrain(jnp.asarray(self.particles))
        post = {k: np.asarray(v).reshape(self.islands, n, *np.shape(v)[1:])
                for k, v in draws.items()}
        tree = arviz.from_dict(
            {"posterior": post,
             "sample_stats": {"log_likelihood": np.asarray(self.log_lik).reshape(self.islands,
                                                                                  n)}},
            attrs={"posterior": {"method": "SMC", "reached": int(self.reached),
                                 "renewed": self.renewed, "islands": self.islands}})
        import xarray as xr

        stats = tree["sample_stats"].to_dataset()
        rounds = np.asarray(self.history["round"])
        for key in ("beta", "ess", "khat", "accepted", "unique", "refreshed", "local_sd"):
            if key in self.history:
                stats[key] = xr.DataArray(np.asarray(self.history[key], float), dims=["round"],
                                          coords={"round": rounds})
        tree["sample_stats"] = xr.DataTree(stats)
        return tree


class SMC(FederatedMethod):
    """Federated tempered SMC from a Gaussian ``start`` over a model's global sites (see
    :mod:`fedppl.infer.smc` and :mod:`fedppl.algorithms.smc`).

    :param model: the NumPyro model (its static keyword arguments go to :meth:`run`).
    :param guide: the :class:`~fedppl.guides.PVIGuide` the start was fitted with (its layout
        names the global and local sites, and gives the prior).
    :param start: a Gaussian over the flat unconstrained global vector: the reference the
        particles are drawn from (PVI's, EP's ``q``; the prior's base).
    :param local: the clients' private guides (stacked, as ``PVIResult.local``): where each
        client's Laplace fit of its local sites starts (default: its previous fit).
    :param num_particles: ``N`` (at least 100, a multiple of ``islands``).
    :param islands: independent islands (at least 2; 20 particles each at least).
    :param local_draws: draws of each client's importance estimate over its local sites per
        particle (even; more: less noise, in proportion to the work).
    :param newton_steps: Newton steps of each local Laplace fit.
    :param refreshes: refreshes of a client's auxiliary draws per round.
    :param ess_target: the share of particles each temperature step keeps (0.5).
    :param renew: the share of particles that must have moved at a temperature before the next.
    :param final_renew: at temperature 1, the share that must have moved before the run stops,
        after ``final_moves`` moves at least, and once the particles' moments have stopped
        drifting: over the last 3 rounds no coordinate's mean or sd moved further than
        :func:`drift_threshold` of its Monte Carlo errors (a diagnostic of mixing: a cloud that
        is still spreading or travelling moves steadily, one at its target only by noise).
    :param independent: the share of proposals drawn independently of the particle (from a scale
        mixture of Gaussians fitted to the particles, covariance times each of ``scales``);
        the rest are a random walk tuned to ``rw_target`` acceptance.
    :param pool_steps: after its own proposal, each particle takes this many further
        independence steps per round, over the other independence proposals of its island
        (:func:`fedppl.algorithms.smc_kernels.pool_moves`: the clients evaluated them already, so
        these steps cost no computation at the clients and no exchange); 0 (the default):
        none. They save tempering rounds, but the stopping rule can then fire early: run past
        it (``stop=False``).
    :param gradient: the walk is kicked by the tempered target's gradient (one leapfrog step,
        preconditioned by the particles' covariance; with ``persistence=0`` a
        Metropolis-adjusted Langevin step): each client also sends its log-likelihood's
        gradient at each proposal (``N D`` more numbers a round; with local sites, the
        gradient of its Laplace approximation:
        :func:`fedppl.algorithms.importance.laplace_gradient`).
    :param persistence: the share of each particle's walk momentum kept from one round to the
        next, in ``[0, 1)`` (0, the default: a fresh momentum every round). Near 1 the walk
        travels over many rounds as one Hamiltonian trajectory would, one leapfrog step per
        round, a rejected particle turning back (generalised HMC); raise ``rw_target`` with
        it, since every rejection turns a particle back.
    :param uniform_step: each particle carries the uniform of its acceptance decisions and
        moves it by this much a round (Neal, 2020), in ``[0, 1)``; 0, the default: a fresh
        uniform each round. With a small step rejections come in runs, so a persistent walk
        turns back less often.
    :param crank_nicolson: the walk is a preconditioned Crank-Nicolson step around the particles'
        Gaussian fit, ``centre + r (theta - centre) + s L xi`` with ``r = sqrt(1 - s^2)`` and
        ``s`` tuned to ``rw_target`` (at most 1: an independence draw), instead of a random
        walk: its ratio is the target's over the fit's, so its steps stay long where the
        target is near Gaussian. Not with ``gradient`` or ``persistence``.
    :param inflate: the start's covariance is multiplied by this (default 2: a Gaussian
        answer is usually too narrow, and a start wider than the target is safer, since the
        reweighting narrows a cloud and only the moves widen it).
    :param batch_size: particles a client evaluates at once (memory ``O(batch d^2)``).
    """

    name = "SMC"
    progress: ClassVar[tuple[str, ...]] = ("beta", "ess", "accepted")
    refusal = ("message missing, or refused (not finite, or far from the client's last "
               "values): the round was void")

    def __init__(self, model: Callable, guide: PVIGuide, start: g.Gaussian, *,
                 local: g.Conditional | None = None, num_particles: int = 1000,
                 islands: int = 10, local_draws: int = 64, newton_steps: int = 3,
                 refreshes: int = 1, ess_target: float = 0.5, renew: float = 0.5,
                 final_renew: float = 0.9, final_moves: int = 3, independent: float = 0.5,
                 scales: tuple[float, ...] = (1.0, 2.0, 4.0), rw_target: float = 0.3,
                 pool_steps: int = 0, gradient: bool = False, persistence: float = 0.0,
                 uniform_step: float = 0.0, crank_nicolson: bool = False, inflate: float = 2.0,
                 batch_size: int = 256):
        if not isinstance(guide, PVIGuide):
            raise TypeError(f"guide must be the fedppl.PVIGuide the start was fitted with, got "
                            f"{type(guide).__name__}")
        if not isinstance(start, (g.FullGaussian, g.DiagGaussian)):
            raise TypeError("start must be a Gaussian over the global sites (a result's q, in "
                            f"natural parameters), got {type(start).__name__}")
        num_particles = validation.positive_int(num_particles, "num_particles")
        islands = validation.positive_int(islands, "islands")
        if num_particles < MIN_PARTICLES:
            raise ValueError(f"num_particles must be at least {MIN_PARTICLES} (the proposals "
                             f"are fitted to the particles), got {num_particles}")
        if islands < 2 or num_particles % islands or num_particles // islands < MIN_PER_ISLAND:
            raise ValueError(f"islands must be at least 2 and divide num_particles into "
                             f"islands of {MIN_PER_ISLAND} or more (their spread is the Monte "
                             f"Carlo error); got {islands} islands of {num_particles} particles")
        local_draws = validation.positive_int(local_draws, "local_draws")
        if local_draws % 2:
            raise ValueError(f"local_draws must be even (antithetic pairs), got {local_draws}")
        for name, value in (("ess_target", ess_target), ("renew", renew),
                            ("final_renew", final_renew)):
            if not 0 < value < 1 + (name != "ess_target"):
                raise ValueError(f"{name} must be in (0, 1), got {value}")
        if not 0 <= independent <= 1:
            raise ValueError(f"independent must be in [0, 1], got {independent}")
        if not 0 < rw_target < 1:
            raise ValueError(f"rw_target must be in (0, 1), got {rw_target}")
        for name, value in (("persistence", persistence), ("uniform_step", uniform_step)):
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if crank_nicolson and (gradient or persistence):
            raise ValueError("crank_nicolson is a walk of its own: it takes neither gradient nor "
                             f"persistence (got gradient={gradient}, persistence={persistence})")
        scales = tuple(float(c) for c in scales)
        if not scales or not all(c > 0 and np.isfinite(c) for c in scales):
            raise ValueError(f"scales must be positive numbers, got {scales}")
        if not (inflate > 0 and np.isfinite(inflate)):
            raise ValueError(f"inflate must be positive, got {inflate}")
        self.model, self.guide, self.start, self.local = positional(model), guide, start, local
        self.settings = alg.Settings(
            num_particles, islands, local_draws,
            validation.positive_int(newton_steps, "newton_steps"),
            validation.positive_int(refreshes, "refreshes", minimum=0), float(ess_target),
            float(renew), float(independent), scales, float(rw_target),
            validation.positive_int(batch_size, "batch_size"),
            validation.positive_int(pool_steps, "pool_steps", minimum=0), bool(gradient),
            float(persistence), float(uniform_step), bool(crank_nicolson))
        self.final_renew = float(final_renew)
        self.final_moves = validation.positive_int(final_moves, "final_moves")
        self.inflate = float(inflate)

    # -- the plan -------------------------------------------------------------------------------

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              **model_kwargs: Any) -> Plan:
        guide = _check(self.guide, self.start, self.model, clients, model_kwargs)
        layout, loc = guide.layout_or_raise(), guide.local_layout
        D, d = layout.dim, 0 if loc is None else loc.dim
        dtype = guide.prior_or_raise().nat1.dtype  # the layout's, in JAX (also a Pyro guide's)
        if self.start.nat1.dtype != dtype:
            raise ValueError(f"the start is {self.start.nat1.dtype} and the guide computes in "
                             f"{dtype}: fit the start in the same precision")
        settings = self.settings._replace(local_draws=self.settings.local_draws if d else 0)
        K = clients.num_clients
        local = self.local if d else None
        if local is not None and (jnp.shape(local.nat1) != (K, d)
                                  or jnp.shape(local.cross) != (K, d, D)):
            raise ValueError(f"local (the clients' private guides) has shape "
                             f"{jnp.shape(local.nat1)}, these {K} clients with {d} local "
                             "coordinates need (K, d): they are not the run's clients")
        q0 = g.to_full(g.scale(self.start, 1.0 / self.inflate))
        rng_key, k_init = jax.random.split(rng_key)
        server = alg.server_init(k_init, q0, K, settings)
        cstate = alg.client_init(settings.num_particles, d, None, D, dtype)
        clients_state = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (K, *x.shape)),
                                               cstate)
        if local is not None:
            clients_state = clients_state._replace(
                guide=jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), local))
        trio = shared(_trio, self.model, guide, tuple(sorted(model_kwargs.items())), settings)
        static = _Static(guide, _bound(self.model, model_kwargs), q0, settings,
                         self.final_renew, self.final_moves,
                         tuple(np.asarray(m) for m in g.to_moments(g.to_full(self.start))))
        return Plan(trio, "synchronous", server, clients_state, _record,
                    _result, log=None, rng_key=rng_key, static=static, about=guide.describe())

    def _refused(self, replies: Any, active: np.ndarray) -> np.ndarray:
        return np.asarray(replies.refused)

    def _tol_rule(self, tol: float | None) -> StopRule | None:
        def done(rows: list[dict[str, Any]]) -> str | None:
            if rows[-1]["done"]:
                return (f"temperature 1 reached, {rows[-1]['renewed']:.0%} of the particles "
                        f"moved there, and their moments moved {rows[-1]['drift']:.1f} Monte "
                        f"Carlo errors in the last {DRIFT_LAG} rounds")
            return None

        return done

    def run(self, rng_key: Array, clients: Clients, num_rounds: int = 50, *,
            progress_bar: bool = True, runtime: Any = None, warn: bool = True,
            stop: bool = True, **model_kwargs: Any) -> SMCResult:
        """``init``, then rounds until the particles have reached temperature 1 and renewed
        there, or ``num_rounds`` (default 50; all of them with ``stop=False``, to go on moving
        the particles past the stopping rule); warns when the run ended before temperature 1,
        or with noisy local estimates (``local_sd`` above :data:`LOCAL_SD_WARN`)."""
        if stop:
            result = super().run(rng_key, clients, num_rounds, progress_bar=progress_bar,
                                 runtime=runtime, **model_kwargs)
        else:
            state = self.init(rng_key, clients, runtime=runtime, **model_kwargs)
            result = self._loop(state, check_rounds(num_rounds), progress_bar, None)
        assert isinstance(result, SMCResult)
        if warn and not (result.reached and result.renewed >= self.final_renew):
            warnings.warn(
                f"SMC stopped after {result.num_rounds} rounds at temperature "
                f"{result.history['beta'][-1]:.3g} with {result.renewed:.0%} of the particles "
                f"renewed (the run stops by itself at temperature 1 once {self.final_renew:.0%} "
                "have moved there): the particles are not yet the pooled posterior. Run more "
                "rounds, or start from a closer answer", UserWarning, stacklevel=2)
        if warn and result.local_sd > LOCAL_SD_WARN:
            warnings.warn(
                f"the clients' estimates of their marginal likelihoods are noisy: their sum "
                f"has an sd of {result.local_sd:.2f} nats at the proposals (above "
                f"{LOCAL_SD_WARN:g}). Moves from a particle whose estimate came out high are "
                "rarely accepted, so the particles mix slowly and mcse() can understate their "
                "error several times over (on the hierarchical benchmark, 0.06 sd stated for "
                "0.55 sd actual). Raise local_draws (the sd falls like one over its square "
                "root), or run past the stopping rule (stop=False) and compare the moments "
                "across rounds",
                UserWarning, stacklevel=2)
        return result


class _Static:
    """A run's static part (``plan.static``): the guide as set up, the model as run, the
    reference, the settings, the stopping rule's thresholds and the start's moments."""

    def __init__(self, guide, model, q0, settings, final_renew, final_moves, start_moments):
        self.guide, self.model, self.q0, self.settings = guide, model, q0, settings
        self.final_renew, self.final_moves = final_renew, final_moves
        self.start_moments = start_moments


def _bound(model: Callable, model_kwargs: dict) -> Callable:
    return partial(model, **model_kwargs) if model_kwargs else model


def _trio(model: Callable, guide: PVIGuide, model_kwargs: tuple, settings: alg.Settings):
    """The sampler's trio for a model, guide and settings (made once through
    :func:`~fedppl.infer.base.shared`: one compiled round)."""
    bound = _bound(model, dict(model_kwargs))
    prior, correction = guide.prior_or_raise(), guide.prior_correction

    def log_lik(data, mask):
        ll = natural_gradient.log_lik_fn(bound, guide, data, mask)
        return lambda theta, z: ll(jnp.concatenate([theta, z]), 0)

    def log_prior(theta):
        lp = g.log_prob(prior, theta)
        return lp if correction is None else lp + correction(theta)

    d = 0 if guide.local_layout is None else guide.local_layout.dim
    return alg.make_trio(log_lik, log_prior, d, settings)


def _check(guide: PVIGuide, start: g.Gaussian, model: Callable, clients: Clients,
           model_kwargs: dict) -> PVIGuide:
    """The guide set up on these clients, checked against the start (before anything runs)."""
    import copy

    set_up_on(guide, start, model, clients, model_kwargs, "the sampler")
    return copy.copy(guide)


def _record(before: RunState, after: RunState, msgs: Any, replies: Any, active: np.ndarray,
            rng_key: Array) -> tuple[Any, dict[str, Any]]:
    plan = after.plan
    assert plan is not None
    st: _Static = plan.static
    s = jax.device_get(after.server)
    tempered = bool(s.stage > before.server.stage)
    khat = np.nan
    if tempered:  # the Pareto k-hat of the reweighting's weights (PSIS's fit may warn on ties)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            khat = imp.psis(np.asarray(s.increment, np.float64))[1]
    at_one = float(s.beta) >= 1
    renewed = float(np.mean(s.moved)) if at_one else 0.0
    theta = np.asarray(s.theta, np.float64)
    now = _moments(theta, st.settings.islands)
    log = ((*(after.log.method or ()), now)[-(DRIFT_LAG + 1):] if at_one else ())
    drift = _drift(log[-1], log[0]) if len(log) > DRIFT_LAG else np.nan
    done = (at_one and int(s.final_moves) >= st.final_moves and renewed >= st.final_renew
            and drift <= drift_threshold(theta.shape[1]))
    var = np.asarray(msgs.variance, np.float64)[np.asarray(active, bool)]
    row = {"beta": float(s.beta), "stage": int(s.stage), "ess": float(s.ess), "khat": khat,
           "accepted": float(s.accepted), "refreshed": float(np.mean(msgs.refreshed)),
           "local_sd": float(np.sqrt(np.sum(var))) if np.all(np.isfinite(var)) else np.nan,
           "unique": len(np.unique(theta, axis=0)), "renewed": renewed, "drift": drift,
           "done": int(done)}
    return log, row


#: rounds at temperature 1 over which the particles' moments must have stopped drifting
DRIFT_LAG = 3
#: nats: above this sd of the clients' summed log-likelihood estimates, ``run`` warns
LOCAL_SD_WARN = 1.0


def drift_threshold(dim: int) -> float:
    """The drift below which ``2 dim`` moments (each coordinate's mean and sd) count as still:
    the 5% Bonferroni quantile of the largest of ``2 dim`` normals with variance 2 (the
    difference of two estimates of one moment, each with the stated Monte Carlo error)."""
    from scipy.stats import norm

    return float(np.sqrt(2.0) * norm.ppf(1 - 0.05 / (4 * dim)))


def _moments(theta: np.ndarray, islands: int) -> tuple[np.ndarray, ...]:
    """The particles' mean and sd per coordinate, and the islands' Monte Carlo errors of both."""
    x = theta.reshape(islands, -1, theta.shape[1])
    root = np.sqrt(islands)
    return (theta.mean(0), theta.std(0, ddof=1), x.mean(1).std(0, ddof=1) / root,
            x.std(1, ddof=1).std(0, ddof=1) / root)


def _drift(now: tuple[np.ndarray, ...], then: tuple[np.ndarray, ...]) -> float:
    """How far the moments moved between two rounds, in Monte Carlo errors (the worst)."""
    tiny = 1e-12 * (1 + np.abs(now[1]))
    return float(max(np.max(np.abs(now[0] - then[0]) / np.maximum(now[2], tiny)),
                     np.max(np.abs(now[1] - then[1]) / np.maximum(now[3], tiny))))


def _result(state: RunState, history: dict[str, np.ndarray],
            rejected: list[tuple[int, str, str]]) -> SMCResult:
    plan = state.plan
    assert plan is not None
    st: _Static = plan.static
    s = jax.device_get(state.server)
    reached = float(s.beta) >= 1
    return SMCResult(guide=st.guide, particles=np.asarray(s.theta), log_lik=np.asarray(s.log_lik),
                     islands=st.settings.islands, reached=reached,
                     renewed=float(np.mean(s.moved)) if reached else 0.0,
                     start_moments=st.start_moments, model=st.model, history=history,
                     client_names=plan.names, rejected=rejected)
