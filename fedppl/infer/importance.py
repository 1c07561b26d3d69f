"""``Importance``: check a federated posterior against the pooled one, and correct it.

Any result with a Gaussian ``q`` over a model's global sites (:class:`fedppl.PVI`,
:class:`fedppl.GlobalVI`, :class:`fedppl.EP`, :class:`fedppl.OneShot`) can be checked without a
record leaving a client: the server sends ``S`` draws of the global sites, each client sends back
its log-likelihood at each draw (``S`` numbers), and Pareto-smoothed importance sampling says how
far ``q`` is from the posterior the pooled data would give (Pareto ``k-hat``) and corrects its
moments (:mod:`fedppl.algorithms.importance` has the estimators). ``result.check(...)`` is one
round; ``result.refine(...)`` repeats the exchange with proposals adapted to the weighted draws
until ``k-hat`` is below ``khat_target`` and the effective sample size above ``ess_target``.

Reading ``k-hat`` (Vehtari et al., 2024): below 0.5 the draws' weights are well behaved and the
corrected moments are accurate (q itself is close); up to the threshold
``min(1 - 1/log10(N), 0.7)`` the correction still converges, slowly; above it the importance
estimates are unreliable and q may be far off (a warning says so): refine.

Example (a conjugate model, q exact: k-hat small, the corrected moments are q's)::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2) + rng.normal(size=200),
    ...                                        num_clients=4, seed=0)
    >>> result = fedppl.PVI(model, fedppl.PVIGuide(model, family="fullrank")).run(
    ...     jax.random.key(0), clients, num_rounds=2, progress_bar=False)
    >>> check = result.check(jax.random.key(1), clients, num_draws=500, progress_bar=False)
    >>> bool(check.khat < 0.5), check.history["messages_up"].tolist()
    (True, [4])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import validation
from fedppl.algorithms import importance as imp
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
from fedppl.infer.client_checks import check_clients
from fedppl.model_call import positional

__all__ = ["Importance", "ImportanceResult", "ImportanceLog", "khat_threshold",
           "refuse_subsampling", "set_up_on"]


def khat_threshold(num_draws: int) -> float:
    """The k-hat above which PSIS estimates from ``num_draws`` draws are unreliable:
    ``min(1 - 1 / log10(S), 0.7)`` (Vehtari et al., 2024)."""
    return float(min(1.0 - 1.0 / np.log10(num_draws), 0.7))


class ImportanceLog(NamedTuple):
    """The rounds so far, as the server keeps them (the run's accumulators,
    ``state.log.method``): the proposals and how many draws each gave, all draws ``(N, D)``,
    their log prior and the clients' log-likelihoods ``(K, N)`` (``(1, N)``, their sum over the
    clients, where the runtime gives only the sum: secure aggregation), ``variance`` ``(N,)`` (the
    summed variance of the clients' estimates at each draw; zero without local sites) and the
    next round's proposal."""

    proposals: tuple[imp.Proposal, ...]
    counts: tuple[int, ...]
    draws: np.ndarray
    log_prior: np.ndarray
    log_lik: np.ndarray
    variance: np.ndarray
    next: imp.Proposal


@dataclass(kw_only=True)
class ImportanceResult(Result):
    """Weighted draws of the pooled posterior over the global sites, and how far to trust them.

    ``khat`` (Pareto k-hat of the importance weights) and ``ess`` (their effective sample size)
    say how reliable the weights are, and ``local_sd`` (nats; 0 without local sites) how noisy
    the clients' estimates behind them were; ``mean_and_cov()`` are the corrected moments over
    the flat unconstrained vector (compare ``start_moments``, the answer that was checked);
    ``sample`` resamples draws by their weights; ``loo()`` gives each client's
    leave-one-client-out predictive density; ``history`` has one row per round with ``khat``,
    ``ess`` and ``local_sd`` besides the common columns.

    ``summed``: the server received the clients' log-likelihoods only as their sum over the
    clients (secure aggregation, :mod:`fedppl.runtime.secure`): ``log_lik`` is then one row
    ``(1, N)``, all clients together, which serves the weights and everything made from them,
    but not ``loo()``.
    """

    guide: PVIGuide
    draws: np.ndarray
    log_ratios: np.ndarray
    log_weights: np.ndarray
    log_lik: np.ndarray
    khat: float
    ess: float
    local_sd: float
    start_moments: tuple[np.ndarray, np.ndarray]
    proposals: tuple[imp.Proposal, ...] = field(default=())
    chosen: str = ""  # why refine chose the importance refinement (empty when run directly)
    summed: bool = False

    @property
    def threshold(self) -> float:
        """The k-hat above which these weights are unreliable (for this many draws)."""
        return khat_threshold(len(self.draws))

    @property
    def reliable(self) -> bool:
        return bool(self.khat <= self.threshold)

    def mean_and_cov(self) -> tuple[np.ndarray, np.ndarray]:
        """Importance-corrected mean and covariance over the flat unconstrained vector."""
        return imp.weighted_moments(self.draws, self.log_weights)

    def mcse(self) -> np.ndarray:
        """Monte Carlo standard error of each coordinate of the corrected mean:
        ``sqrt(sum_i w_i^2 (x_i - mean)^2)`` for the normalised weights (the delta method for a
        self-normalised importance estimate; meaningful while k-hat is below the threshold)."""
        w = np.exp(self.log_weights)
        w = w / w.sum()
        mean = w @ self.draws
        return np.sqrt((w**2) @ (self.draws - mean) ** 2)

    def sample(self, rng_key: Array, num_samples: int) -> dict[str, Array]:
        """Draws resampled by their weights, constrained, keyed by site name (repeats where few
        draws carry the weight: read ``ess`` beside them)."""
        idx = imp.resample(rng_key, self.log_weights, num_samples)
        return self.guide.layout_or_raise().constrain(jnp.asarray(self.draws[idx]))

    def loo(self):
        """Leave-one-client-out cross-validation as an ``arviz_stats.ELPDData``
        (``arviz_stats.compare`` takes it): ``elpd_i`` is each client's ``log p(y_k | y_-k)``
        (dimension ``client``), ``pareto_k`` its k-hat. Refused where the server received
        only the sum of the clients' log-likelihoods (``summed``)."""
        if self.summed:
            raise ValueError("leave-one-client-out needs each client's log-likelihoods at the "
                             "draws, which secure aggregation withholds: the server received "
                             "only their sum over the clients. Run the check without secure "
                             "aggregation to compare models client by client")
        import xarray as xr

        from fedppl.arviz import arviz_stats

        elpd_data = arviz_stats().ELPDData
        elpd_i, khat = imp.leave_one_out(self.log_ratios, self.log_lik)
        lppd_i = np.asarray([float(jax.scipy.special.logsumexp(jnp.asarray(self.log_weights + ll)))
                             for ll in self.log_lik])
        names = list(self.client_names)
        n, K = len(self.draws), len(elpd_i)
        bad = khat > self.threshold
        if bad.any():
            warnings.warn(f"leave-one-client-out estimates are unreliable for "
                          f"{[names[k] for k in np.nonzero(bad)[0]]} (k-hat above "
                          f"{self.threshold:.2f}): refit without those clients to compare models",
                          UserWarning, stacklevel=2)
        return elpd_data(
            kind="loo", elpd=float(elpd_i.sum()), se=float(np.sqrt(K * np.var(elpd_i))),
            p=float(lppd_i.sum() - elpd_i.sum()), n_samples=n, n_data_points=K, scale="log",
            warning=bool(bad.any()), good_k=self.threshold,
            elpd_i=xr.DataArray(elpd_i, dims=["client"], coords={"client": names},
                                name="elpd_i"),
            pareto_k=xr.DataArray(khat, dims=["client"], coords={"client": names},
                                  name="pareto_k"))

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(khat=self.khat, ess=self.ess, draws=len(self.draws), local_sd=self.local_sd)
        return out

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000):
        """An ``xarray.DataTree`` for ArviZ 1.x: ``num_samples`` draws resampled by the
        weights (4 chains), the clients' log-likelihoods at them (group ``log_likelihood``,
        variable ``clients``, dimension ``client``: ``arviz_stats.loo`` over clients; no such
        group where the server received only their sum, ``summed``, as one total would make
        ``loo`` leave every client out at once), and ``khat``/``ess`` as attributes."""
        from fedppl import arviz

        num_samples = arviz.check_num_samples(num_samples)
        key = jax.random.key(0) if rng_key is None else rng_key
        idx = imp.resample(key, self.log_weights, num_samples)
        draws = self.guide.layout_or_raise().constrain(jnp.asarray(self.draws[idx]))
        groups = {"posterior": {k: arviz.as_chains(v) for k, v in draws.items()}}
        if not self.summed:
            groups["log_likelihood"] = {"clients": arviz.as_chains(self.log_lik[:, idx].T)}
        return arviz.from_dict(
            groups, coords={"client": list(self.client_names)}, dims={"clients": ["client"]},
            attrs={"posterior": {"khat": self.khat, "ess": self.ess,
                                 "num_draws": len(self.draws), "reliable": int(self.reliable),
                                 "summed": int(self.summed)}})


class Importance(FederatedMethod):
    """Importance sampling of the pooled posterior from a federated answer (the front of the
    check and of the refinement): a plan on the one driver, so it runs on every runtime
    (embedded, faults, Flower) with ``init`` / ``update`` / ``run`` as every method.

    Each round the server sends ``num_draws`` draws of the global sites (its broadcast), each
    client answers with its log-likelihood at each (and, with local sites, the variance of its
    estimate); the server, on the host between rounds, forms the weights of all draws so far
    (PSIS), their k-hat and ESS, and the next round's proposal, and draws from it.

    :param model: the NumPyro model (the static keyword arguments are given to :meth:`run`).
    :param guide: the :class:`~fedppl.guides.PVIGuide` the answer was fitted with (its layout
        names the global sites and the prior).
    :param start: the answer to check: a Gaussian over the flat unconstrained global vector.
    :param local: the clients' private guides (stacked, as ``PVIResult.local``): the starting
        points of their Laplace steps (default, or with another number of clients: zero).
    :param num_draws: ``S``, the draws each round sends each client (at least 100).
    :param first_df: degrees of freedom of the first proposal, centred at ``start`` with its
        covariance as scale (default ``inf``: ``start`` itself). The first round is the check,
        and its k-hat diagnoses ``start`` only when the draws come from ``start``: the tail of
        ``pi / q`` under ``q`` is what grows heavy when ``q`` is too narrow or misplaced (Yao et
        al., 2018). Under a heavier-tailed proposal the weights stay bounded whatever ``q`` is,
        so k-hat would say that the importance estimate is sound, not that ``q`` is.
    :param df: degrees of freedom of the proposals fitted in later rounds (default 7). There
        the aim is the estimate: a t with the fitted scale matrix loses little where the fit is
        right (in many dimensions the draws' radii concentrate where the two densities agree)
        and keeps the weights bounded in the tails, where a Gaussian fit to a skewed or wider
        posterior is too light.
    :param local_draws: with local sites, each client's importance draws per global draw for its
        log marginal likelihood (Laplace proposal, antithetic pairs; even; default 64). Each
        client also sends the estimated variance of each estimate; ``local_sd`` (history and
        result) is the sd of their sum where the weight is, and above 0.5 nats the run warns.
    :param newton_steps: Newton steps to each local Laplace mode.
    :param khat_target, ess_target: :meth:`run` stops after a round whose weights have k-hat
        below ``khat_target`` (0.5) and ESS above ``ess_target`` (2000: Monte Carlo error
        about 0.02 sd in each corrected mean; with fewer effective draws the correction of an
        answer that is already close, k-hat below 0.5, can add more noise than it removes).
    :param batch_size: draws a client evaluates at once (memory ``O(batch d^2)`` with local
        sites of dimension ``d``).
    """

    name = "Importance"
    progress: ClassVar[tuple[str, ...]] = ("khat", "ess")  # the bar: the weights' k-hat and ESS
    refusal = "no log-likelihoods (the client did not answer): the round was void"

    def __init__(self, model: Callable, guide: PVIGuide, start: g.Gaussian, *,
                 local: Any = None, num_draws: int = 1000, first_df: float = np.inf,
                 df: float = 7.0, local_draws: int = 64, newton_steps: int = 10,
                 khat_target: float = 0.5, ess_target: float = 2000.0, batch_size: int = 256):
        num_draws = validation.positive_int(num_draws, "num_draws")
        if num_draws < imp.MIN_DRAWS:
            raise ValueError(f"num_draws must be at least {imp.MIN_DRAWS} (the Pareto fit of "
                             f"k-hat needs draws in the tail), got {num_draws}")
        for name, value in (("first_df", first_df), ("df", df)):
            if not value > 0:
                raise ValueError(f"{name} must be positive (inf for a Gaussian proposal), got "
                                 f"{value}")
        local_draws = validation.positive_int(local_draws, "local_draws")
        if local_draws % 2:
            raise ValueError(f"local_draws must be even (antithetic pairs), got {local_draws}")
        self.model, self.guide, self.start = positional(model), guide, start
        self.local = local
        self.num_draws, self.local_draws = num_draws, local_draws
        self.first_df, self.df = float(first_df), float(df)
        self.newton_steps = validation.positive_int(newton_steps, "newton_steps")
        self.khat_target, self.ess_target = float(khat_target), float(ess_target)
        self.batch_size = validation.positive_int(batch_size, "batch_size")

    # -- the plan -------------------------------------------------------------------------------

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              **model_kwargs: Any) -> Plan:
        """The answer's guide set up on the clients and checked against it; the first round's
        draws from ``start`` (or, with ``first_df``, the t with its mean and covariance as
        scale)."""
        layout = set_up_on(self.guide, self.start, self.model, clients, model_kwargs,
                           "the check")
        trio, log_prior = shared(_exchange, self.model, self.guide, self.guide.signature,
                                 tuple(sorted(model_kwargs.items())), self.local_draws,
                                 self.newton_steps, self.batch_size)
        first = imp.from_gaussian(self.start, self.first_df)
        K = clients.num_clients
        local = self.local
        if local is not None and jax.tree_util.tree_leaves(local)[0].shape[0] != K:
            local = None  # a pooled answer's guide: start each Laplace step at zero instead
        D = layout.dim
        log = ImportanceLog((), (), np.zeros((0, D), first.mean.dtype), np.zeros(0),
                            np.zeros((K, 0)), np.zeros(0), first)
        static = _Static(self.guide, log_prior, self.num_draws, self.df,
                         tuple(np.asarray(m) for m in g.to_moments(g.to_full(self.start))))
        return Plan(trio, "synchronous", _draws(rng_key, first, self.num_draws),
                    local, _record, _result, log=log, rng_key=rng_key, static=static,
                    next_server=_next_server)

    def _round_inputs(self, state: RunState) -> tuple[Array, Array, Array, Array, Array]:
        # the key that drew this round's draws (_draws) is also the server's
        K = state.masks.shape[0]
        rng_key, k_draw, k_clients = _round_keys(state.rng_key)
        return rng_key, jax.random.split(k_clients, K), jnp.ones(K, bool), k_draw, k_draw

    def _refused(self, replies: Any, active: np.ndarray) -> np.ndarray:
        # replies: whether each message arrived (or, under secure aggregation, 1 for a share of
        # the total, a client's refusal code below 0, 0 where nothing arrived)
        return np.asarray(replies) <= 0

    def _tol_rule(self, tol: float | None) -> StopRule | None:
        give_up = tol

        def rule(rows: list[dict[str, Any]]) -> str | None:
            khat, n_eff = rows[-1]["khat"], rows[-1]["ess"]
            if khat < self.khat_target and n_eff >= self.ess_target:
                return (f"k-hat {khat:.2f} < khat_target {self.khat_target:g} and ESS "
                        f"{n_eff:.0f} >= ess_target {self.ess_target:g}")
            if give_up is not None and khat > give_up:
                return f"k-hat {khat:.2f} > {give_up:.2f}"
            return None

        return rule

    def run(self, rng_key: Array, clients: Clients, num_rounds: int = 1, *,
            progress_bar: bool = True, runtime: Any = None, warn: bool = True,
            give_up: float | None = None, **model_kwargs: Any) -> ImportanceResult:
        """Up to ``num_rounds`` exchanges, stopping once k-hat is below ``khat_target`` and the
        ESS above ``ess_target``; warns when the final k-hat is above the reliability
        threshold. ``give_up``: stop after a round whose k-hat is above this (``refine`` then
        turns to the sampler), without the warning. ``runtime`` runs the rounds (None: the
        embedded runtime; see :class:`fedppl.runtime.Runtime`)."""
        num_rounds = check_rounds(num_rounds)
        state = self.init(rng_key, clients, runtime=runtime, **model_kwargs)
        result = self._loop(state, num_rounds, progress_bar, self._tol_rule(give_up))
        assert isinstance(result, ImportanceResult)
        if give_up is not None and result.history["khat"][-1] > give_up:
            warn = False
        if warn and not result.reliable:
            warnings.warn(_advice(result, num_rounds), UserWarning, stacklevel=2)
        if warn and result.local_sd > LOCAL_SD:
            warnings.warn(
                f"the clients' estimates of their log marginal likelihoods over their local "
                f"sites are noisy: sd {result.local_sd:.2f} nats per draw where the weight is "
                f"(above {LOCAL_SD}). The noise distorts the weights and k-hat, and the "
                "estimates' downward bias changes with the global parameters, so the corrected "
                "moments can be off by more than k-hat and the ESS say. Raise local_draws",
                UserWarning, stacklevel=2)
        return result


class _Static:
    """A run's static part (``plan.static``): the guide, the server's compiled log prior, the
    draws per round, the later proposals' degrees of freedom and the start's moments."""

    def __init__(self, guide, log_prior, num_draws, df, start_moments):
        self.guide, self.log_prior, self.num_draws, self.df = guide, log_prior, num_draws, df
        self.start_moments = start_moments


def _round_keys(rng_key: Array) -> tuple[Array, Array, Array]:
    """A round's keys from the run's key: the next round's, the draws' (also the server's) and
    the clients'."""
    k_next, k_draw, k_clients = jax.random.split(rng_key, 3)
    return k_next, k_draw, k_clients


def _draws(rng_key: Array, proposal: imp.Proposal, num_draws: int) -> imp.Broadcast:
    """The broadcast of the round whose key is ``rng_key``: its draws from ``proposal``."""
    return imp.Broadcast(imp.sample(_round_keys(rng_key)[1], proposal, num_draws))


def _record(before: RunState, after: RunState, msgs: Any, replies: Any, active: np.ndarray,
            rng_key: Array) -> tuple[ImportanceLog, dict[str, Any]]:
    """The round's log-likelihoods joined to the draws so far: their weights, k-hat and ESS,
    and the next proposal (a t fitted to the weighted draws). Where the runtime gives only the
    sum (``plan.summed``), the messages are equal shares of the total: one row, all clients."""
    plan = after.plan
    assert plan is not None
    st: _Static = plan.static
    log: ImportanceLog = before.log.method
    replies, active = np.asarray(replies), np.asarray(active, bool)
    for k in np.nonzero(active & (replies < 0))[0]:  # a client withheld its summand
        raise ValueError(f"{plan.names[k]}: {imp.REFUSALS.get(float(replies[k]), 'refused')} "
                         "(of its data at the broadcast draws); nothing was kept. Check its "
                         "data and the model's likelihood at these parameter values")
    if ((replies <= 0) & active).any():
        # a client did not answer (a dropout, or secure aggregation halted; named in
        # ``rejected``): the weights need every client's log-likelihood at every draw, so the
        # round is void and the next draws again
        return log, {"khat": np.nan, "ess": np.nan, "local_sd": np.nan}
    values = np.asarray(msgs.log_lik, np.float64)
    names = plan.names
    old = log.log_lik
    if plan.summed:  # the shares add up to the total; the log keeps one row
        values = values[active].sum(0, keepdims=True)
        names, old = ("all clients",), old.sum(0, keepdims=True)
    _check_messages(values, names)  # before anything is kept
    var = (np.zeros(values.shape[1]) if msgs.variance is None
           else np.asarray(msgs.variance, np.float64)[active].sum(0))
    draws = before.server.draws
    proposals = (*log.proposals, log.next)
    counts = (*log.counts, int(draws.shape[0]))
    all_draws = np.concatenate([log.draws, np.asarray(draws)])
    log_prior = np.concatenate([log.log_prior, np.asarray(st.log_prior(draws), np.float64)])
    log_lik = np.concatenate([old, values], axis=1)
    variance = np.concatenate([log.variance, var])
    ratios = _log_ratios(proposals, counts, all_draws, log_prior, log_lik)
    lw, khat = imp.psis(ratios)
    n_eff = imp.ess(lw)
    D = all_draws.shape[1]
    S = st.num_draws
    min_ess = min(max(5.0 * D, S / 10), S / 2)
    nxt = imp.tempered_fit(all_draws, ratios, log.next, min_ess, st.df, anchor=proposals[0])
    new = ImportanceLog(proposals, counts, all_draws, log_prior, log_lik, variance, nxt)
    return new, {"khat": khat, "ess": n_eff, "local_sd": _local_sd(lw, variance)}


def _next_server(state: RunState) -> imp.Broadcast:
    """The next round's draws, from the proposal the last round's record fitted."""
    plan = state.plan
    assert plan is not None
    return _draws(state.rng_key, state.log.method.next, plan.static.num_draws)


def _result(state: RunState, history: dict[str, np.ndarray],
            rejected: list[tuple[int, str, str]]) -> ImportanceResult:
    """The weighted draws of the rounds as a result."""
    plan = state.plan
    assert plan is not None
    st: _Static = plan.static
    log: ImportanceLog = state.log.method
    ratios = _log_ratios(log.proposals, log.counts, log.draws, log.log_prior, log.log_lik)
    lw, khat = imp.psis(ratios)
    return ImportanceResult(guide=st.guide, draws=log.draws, log_ratios=ratios,
                            log_weights=lw, log_lik=log.log_lik, khat=khat, ess=imp.ess(lw),
                            local_sd=_local_sd(lw, log.variance), history=history,
                            client_names=plan.names, rejected=rejected,
                            start_moments=st.start_moments, proposals=log.proposals,
                            summed=plan.summed)


def _local_sd(log_weights: np.ndarray, variance: np.ndarray) -> float:
    """The sd of the summed local estimates, averaged (as a variance) under the weights."""
    return float(np.sqrt(np.exp(log_weights) @ variance))


def _log_ratios(proposals, counts, draws, log_prior, log_lik) -> np.ndarray:
    log_g = np.asarray(imp.mixture_log_prob(list(proposals), list(counts), jnp.asarray(draws)),
                       np.float64)
    return log_prior + log_lik.sum(0) - log_g


def set_up_on(guide: PVIGuide, start: g.Gaussian, model: Callable, clients: Clients,
              model_kwargs: dict, who: str):
    """``guide`` set up on ``clients`` and checked against the answer ``start`` it fitted,
    before any client computes (the clients' shapes, their data, no subsampling plate, the
    global dimension): the guide's layout. A guide with a ``check_clients(clients,
    model_kwargs, who)`` method (the Pyro port's) checks the data and the plates itself."""
    if guide.signature is not None:
        want = [shape[1:] for shape in guide.signature[0]]
        got = [np.shape(a)[1:] for a in clients.client(0)]
        if want != got:
            raise ValueError(f"the clients' arrays have trailing shapes {got}, the answer was "
                             f"fitted on {want}: these are not the run's clients")
    guide.setup(*clients.client(0), **model_kwargs)
    own = getattr(guide, "check_clients", None)
    if own is not None:  # a guide over another PPL's model (fedppl.pyro) traces it itself
        own(clients, model_kwargs, who)
    else:
        check_clients(guide, clients, model_kwargs)
        refuse_subsampling(model, clients.client(0), model_kwargs, who)
    layout = guide.layout_or_raise()
    if layout.dim != start.nat1.shape[-1]:
        raise ValueError(f"with these clients the model has {layout.dim} global coordinates, "
                         f"the answer {start.nat1.shape[-1]}")
    return layout


def refuse_subsampling(model: Callable, data: tuple, model_kwargs: dict,
                       who: str = "the check") -> None:
    """A data plate that subsamples gives each client's log-likelihood at a draw only as a
    minibatch estimate: the weights (or a sampler's acceptance) would target another posterior,
    so ``who`` refuses."""
    from numpyro import handlers

    tr = handlers.trace(handlers.seed(model, 0)).get_trace(*data, **model_kwargs)
    for name, site in tr.items():
        if site["type"] == "plate" and site["args"][1] is not None \
                and site["args"][1] < site["args"][0]:
            raise ValueError(f"the model subsamples plate '{name}' ({site['args'][1]} of "
                             f"{site['args'][0]} rows): {who} needs each client's exact "
                             f"log-likelihood at every draw. Run {who} with the same model "
                             "without subsample_size")


def _check_messages(msgs: np.ndarray, names: tuple[str, ...]) -> None:
    """A log-likelihood may be -inf (a draw the data rule out), never NaN or +inf."""
    for k, row in enumerate(msgs):
        if np.isnan(row).any() or np.isposinf(row).any():
            bad = int(np.sum(np.isnan(row) | np.isposinf(row)))
            raise ValueError(f"{names[k]} returned {bad} log-likelihoods that are NaN or +inf "
                             "(of its data at the broadcast draws); nothing was kept. Check "
                             "its data and the model's likelihood at these parameter values")
        if np.isneginf(row).all():
            raise ValueError(f"{names[k]}: its data have zero likelihood at every draw; the "
                             "answer being checked cannot be right for this client")


def _advice(result: ImportanceResult, rounds: int) -> str:
    return (f"Pareto k-hat {result.khat:.2f} is above {result.threshold:.2f}: the federated "
            f"answer is far from the posterior the pooled data give (after {rounds} round(s), "
            f"ESS {result.ess:.0f} of {len(result.draws)} draws), and importance estimates from "
            "it are unreliable. Run result.refine(...) with more rounds or num_draws, or a "
            "richer guide (family='fullrank', more PVI rounds), and check again")


# nats: above this sd of the summed local estimates at the weighted draws, the check warns
LOCAL_SD = 0.5

def _exchange(model: Callable, guide: PVIGuide, signature: Any, model_kwargs: tuple,
              local_draws: int, newton_steps: int, batch_size: int) -> tuple[Any, Callable]:
    """The check's trio and the server's compiled log prior for a model, guide (as set up:
    ``signature``) and settings, made once through :func:`~fedppl.infer.base.shared` (so every
    check of the same answer shares one compiled round)."""
    kwargs = dict(model_kwargs)
    bound = partial(model, **kwargs) if kwargs else model
    trio = imp.make_trio(imp.client_log_lik(bound, guide, local_draws, newton_steps, batch_size))
    prior, correction = guide.prior_or_raise(), guide.prior_correction

    @jax.jit
    def log_prior(draws):
        lp = jax.vmap(lambda th: g.log_prob(prior, th))(draws)
        return lp if correction is None else lp + jax.vmap(correction)(draws)

    return trio, log_prior


# the keyword arguments of ``PVIResult.check`` and ``refine`` that are the check's settings (the
# others are the model's)
SETTINGS = ("first_df", "df", "local_draws", "newton_steps", "khat_target", "ess_target",
            "batch_size")
