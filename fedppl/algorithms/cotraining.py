"""Private co-training of GPs by exchanging predictions (thesis Ch. 4), as a trio of host functions.

Each party holds private labelled data in its own view and its view of a shared unlabelled pool
(the same rows for every party). In every round each party picks the unqueried pool point where
its own predictive variance is largest (uncertainty sampling) and sends a :class:`Query` with
that index; every other party answers with a :class:`Response`: its predictive mean (released
with differential privacy when asked), and by choice nothing, the marginal variance, or the
covariance with the points it answered that querier before (``uncertainty`` =
``"none"``/``"marginal"``/``"full"``), plus its prior kernel on the queried points for the
combinations that need it. The querying party folds the answers into its model by one of three
combinations (from party 1's side, with ``V`` the reported uncertainty):

* ``"blocky"`` (Eq. 4.6): covariance ``blockdiag(K_1(tr, tr) + s_1^2 I, K_2(q, q) + V)``,
  predicting with ``k_1`` (inconsistent across blocks; a baseline);
* ``"noisy"`` (Eq. 4.8): the answers are heteroscedastic pseudo-observations,
  covariance ``K_1([tr; q], [tr; q]) + blockdiag(s_1^2 I, V)``;
* ``"hybrid"`` (Eq. 4.10): the co-training kernel of view 1 over all points (training, queried,
  prediction: transductive) and the other party's ``K_2(q, q) + V`` on the queried points.
  Since that extra precision sits only on observed points, it drops out of the conditional of
  the prediction points given the observed ones: Hybrid predicts like view 1's GP with the
  answers as ordinary noisy observations, whatever ``V`` and ``K_2`` are (they would matter only
  to a refit of the hyperparameters).

The protocol as a :class:`~fedppl.algorithms.trio.Trio` (:func:`make_trio`): the server is a
relay, and one co-training round is two exchanges, since an answer can only be asked for once
the question has reached the server. In the *ask* exchange every party's ``client_update``
returns its :class:`Query`, and the server keeps them (:class:`Relay`). In the *answer* exchange
the relay broadcasts them, every party's ``client_update`` returns :class:`Answers` (its
:class:`Response` to each other party), ``server_update`` routes each response to its querier,
and ``acknowledge`` folds them into the querier's state. The functions are host-side NumPy
(``Trio(jit=False)``, the embedded runtime's ``"loop"`` schedule).

Decisions where the thesis is silent: hyperparameters are fitted once by type-II ML on each
party's private data and kept; a responder answers from its private-data model (so no answer
echoes the querier's own information back); one round is one query by every party; the reported
variance includes the DP noise's variance (the mechanism is public, so this costs no privacy)
unless ``inflate_variance=False``. A party draws the DP noise of each release from its own key
(see :func:`answer`); every release is recorded by its noise multiplier and composed by
:class:`fedppl.privacy.PrivacyAccountant` (:func:`epsilon_spent`).

Example (two parties, one round by hand; :class:`fedppl.infer.CoTraining` runs it)::

    >>> import jax, numpy as np, optax
    >>> rng = np.random.default_rng(0)
    >>> X = [rng.normal(size=(12, 1)) for _ in range(2)]
    >>> y = [np.sin(x[:, 0]) for x in X]
    >>> pool = [rng.normal(size=(6, 1)) for _ in range(2)]
    >>> settings = Settings("noisy", "full")
    >>> a, b = (init_party(v, 2, X[v], y[v], pool[v], optax.adam(0.05), steps=20)
    ...         for v in range(2))
    >>> q = make_query(a, X[0], y[0], settings)
    >>> answers, b = answer(b, X[1], y[1], [q], settings, jax.random.key(0))
    >>> a = receive(a, answers.responses, settings)
    >>> a.got_index.shape, int(a.got_index[1, 0]) == q.pool_index
    ((2, 1), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import optax
import scipy.linalg
from jax import Array

from fedppl import privacy, trees, validation
from fedppl.algorithms.trio import Trio
from fedppl.models import gp
from fedppl.models.cotraining import cotraining_kernel
from fedppl.optimise import minimise

__all__ = ["COMBINATIONS", "UNCERTAINTIES", "SENSITIVITIES", "DPSettings", "Settings", "Query",
           "Response", "Answers", "Relay", "PartyState", "check_settings", "fit_hyperparameters",
           "init_party", "make_query", "respond", "answer", "receive", "predict",
           "epsilon_spent", "make_trio", "unstack"]

Data = Array | np.ndarray  # inputs and labels: JAX or NumPy arrays
COMBINATIONS = ("blocky", "noisy", "hybrid")
UNCERTAINTIES = ("none", "marginal", "full")
SENSITIVITIES = ("smith", "rkhs")
JITTER = 1e-6


class DPSettings(NamedTuple):
    """GP-prior-sample mechanism: epsilon, delta, the largest change ``d`` of one label, the
    multiplier rule (see :func:`fedppl.privacy.c_delta`), whether the reported variance
    includes the added noise, and the sensitivity bound (``"smith"``: Smith et al., valid for
    kernels bounded by 1; ``"rkhs"``: exact for any kernel scale)."""

    epsilon: float
    delta: float
    d: float = 1.0
    rule: str = "hall"
    inflate_variance: bool = True
    sensitivity: str = "smith"


class Settings(NamedTuple):
    combination: str = "noisy"
    uncertainty: str = "full"
    dp: DPSettings | None = None


# -- messages and states -----------------------------------------------------------------------

class Query(NamedTuple):
    """Sent by ``sender``: "what do you predict at pool point ``pool_index``?"."""

    sender: int
    pool_index: int


class Response(NamedTuple):
    """Sent by ``sender`` to ``querier`` in answer to its query; everything a responder releases.

    ``cov_row``: covariance of this prediction with the responder's earlier answers to the same
    querier, in answer order, ending with the variance (None for ``"none"``; length 1 for
    ``"marginal"``). ``prior_row``: the responder's prior kernel between this point and its earlier
    answers, ending with ``k(x, x)`` (only for blocky and hybrid). ``dp_noise_std``: standard
    deviation of the noise added to ``mean`` (0 without DP).
    """

    sender: int
    querier: int
    pool_index: int
    mean: float
    cov_row: np.ndarray | None
    prior_row: np.ndarray | None
    dp_noise_std: float


class Answers(NamedTuple):
    """A party's message in the answer exchange (its responses, in querier order), and the
    relay's reply to a querier (the responses addressed to it, in responder order)."""

    responses: tuple[Response, ...]


class Relay(NamedTuple):
    """The server's state: the round's queries (stacked over parties) while it relays them;
    ``None`` when the next exchange collects queries."""

    queries: Query | None = None


class PartyState(NamedTuple):
    """One party's state, host NumPy arrays; every field has the same shape for every party,
    so the runtime stacks them on the client axis. Rows indexed by another party ``b`` hold
    what passed between the two (this party's own row is unused: ``-1`` indices, zeros)."""

    party: np.ndarray  # () int: this party's index
    params: gp.GPParams  # hyperparameters fitted on its private data (type-II ML), then kept
    pool: np.ndarray  # (n_pool, D): its view of the shared pool
    got_index: np.ndarray  # (K, m) int: pool points party b answered for it, in order
    got_mean: np.ndarray  # (K, m): the released means
    got_cov: np.ndarray  # (K, m, m): V, the covariance b reported (zeros where none was)
    got_prior: np.ndarray  # (K, m, m): b's prior kernel on those points (zeros for "noisy")
    gave: np.ndarray  # (K, m) int: pool points it answered for party b, in order
    dp_multipliers: np.ndarray  # (releases,): the noise multiplier of each DP release made


def check_settings(settings: Settings) -> Settings:
    """The settings, or a clear error naming the bad field."""
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be a cotraining.Settings, got {type(settings).__name__}")
    validation.one_of(settings.combination, COMBINATIONS, "combination")
    validation.one_of(settings.uncertainty, UNCERTAINTIES, "uncertainty")
    dp = settings.dp
    if dp is None:
        return settings
    if not isinstance(dp, DPSettings):
        raise TypeError(f"dp must be a cotraining.DPSettings or None, got {type(dp).__name__}")
    validation.positive(dp.epsilon, "dp.epsilon")
    validation.positive(dp.d, "dp.d")
    if validation.positive(dp.delta, "dp.delta") >= 1:
        raise ValueError(f"dp.delta must lie in (0, 1), got {dp.delta!r}")
    validation.one_of(dp.rule, privacy.RULES, "dp.rule")
    validation.one_of(dp.sensitivity, SENSITIVITIES, "dp.sensitivity")
    if not isinstance(dp.inflate_variance, (bool, np.bool_)):
        raise TypeError(f"dp.inflate_variance must be True or False, got "
                        f"{dp.inflate_variance!r}")
    return settings


# -- a party's own model -----------------------------------------------------------------------

def fit_hyperparameters(X: Data, y: Data, optimizer: optax.GradientTransformation,
                        steps: int) -> gp.GPParams:
    """Type-II maximum likelihood of the SE-ARD hyperparameters: ``steps`` full-batch steps of
    ``optimizer`` on ``-log p(y | X)`` from :func:`fedppl.models.gp.init_params`."""
    X, y = jnp.asarray(X, dtype=float), jnp.asarray(y, dtype=float)
    return _fit(gp.init_params(X.shape[1]), X, y, optimizer, steps)


@partial(jax.jit, static_argnames=("optimizer", "steps"))
def _fit(params: gp.GPParams, X: Array, y: Array, optimizer: optax.GradientTransformation,
         steps: int) -> gp.GPParams:
    params = minimise(lambda p, _: gp.neg_log_marginal(p, X, y), params, optimizer, steps).params
    return params


def init_party(party: int, num_parties: int, X: Data, y: Data, pool: Data,
               optimizer: optax.GradientTransformation, steps: int = 300) -> PartyState:
    """Fit the party's GP on its private data and start with nothing exchanged."""
    params = jax.device_get(fit_hyperparameters(X, y, optimizer, steps))
    K = num_parties
    return PartyState(np.asarray(party), params, np.asarray(pool, dtype=float),
                      np.full((K, 0), -1), np.zeros((K, 0)), np.zeros((K, 0, 0)),
                      np.zeros((K, 0, 0)), np.full((K, 0), -1), np.zeros(0))


def _others(state: PartyState) -> list[int]:
    me = int(state.party)
    return [b for b in range(state.got_index.shape[0]) if b != me]


def predict(state: PartyState, X: Data, y: Data, X_test: Data, settings: Settings
            ) -> tuple[Array, Array]:
    """The party's combined predictive mean and variance at ``X_test`` (its own view), given its
    private data ``(X, y)`` and the answers it has received."""
    X, y, X_test = jnp.asarray(X), jnp.asarray(y), jnp.asarray(X_test, dtype=float)
    p = state.params
    if state.got_index.shape[1] == 0:
        return gp.predict(p, X, y, X_test)
    others = _others(state)
    Xq = state.pool[np.concatenate([state.got_index[b] for b in others])]
    y_q = np.concatenate([state.got_mean[b] for b in others])
    V = scipy.linalg.block_diag(*[state.got_cov[b] for b in others])
    P = (None if settings.combination == "noisy"
         else scipy.linalg.block_diag(*[state.got_prior[b] for b in others]))
    return _combined(p, X, y, jnp.asarray(Xq), jnp.asarray(y_q), jnp.asarray(V),
                     None if P is None else jnp.asarray(P), X_test, settings.combination)


@partial(jax.jit, static_argnames=("combination",))
def _combined(p: gp.GPParams, X: Array, y: Array, Xq: Array, y_q: Array, V: Array,
              P: Array | None, X_test: Array, combination: str) -> tuple[Array, Array]:
    """The combined predictive from the private data and the answers ``(Xq, y_q)`` with their
    covariance ``V`` (and, for blocky and hybrid, the answering parties' prior rows ``P``)."""
    y_aug = jnp.concatenate([y, y_q])
    n1, nq = X.shape[0], Xq.shape[0]
    X_aug = jnp.concatenate([X, Xq])
    if combination == "noisy":
        extra = jnp.zeros((n1 + nq, n1 + nq)).at[n1:, n1:].set(V + JITTER * jnp.eye(nq))
        return gp.predict(p, X_aug, y_aug, X_test, extra=extra)
    assert P is not None
    if combination == "blocky":
        C = jsl.block_diag(gp.kernel(p, X, X) + p.noise_var * jnp.eye(n1),
                           P + V + JITTER * jnp.eye(nq))
        Ks = gp.kernel(p, X_aug, X_test)
        chol = jnp.linalg.cholesky(C)
        mean = Ks.T @ jsl.cho_solve((chol, True), y_aug)
        half = jsl.solve_triangular(chol, Ks, lower=True)
        return mean, jnp.maximum(jnp.exp(p.log_variance) - jnp.sum(half**2, 0), 1e-12)
    # hybrid: transductive co-training kernel over [train; queried; test]
    X_all = jnp.concatenate([X_aug, X_test])
    n = X_all.shape[0]
    C1 = gp.kernel(p, X_all, X_all) + p.noise_var * jnp.eye(n)
    Kc = cotraining_kernel([(np.arange(n), C1),
                            (np.arange(n1, n1 + nq), P + V + JITTER * jnp.eye(nq))], n)
    obs, test = slice(0, n1 + nq), slice(n1 + nq, n)
    chol = jnp.linalg.cholesky(Kc[obs, obs])
    mean = Kc[test, obs] @ jsl.cho_solve((chol, True), y_aug)
    half = jsl.solve_triangular(chol, Kc[obs, test], lower=True)
    return mean, jnp.maximum(jnp.diagonal(Kc[test, test]) - jnp.sum(half**2, 0), 1e-12)


# -- the protocol's steps ----------------------------------------------------------------------

def make_query(state: PartyState, X: Data, y: Data, settings: Settings) -> Query:
    """Uncertainty sampling: the pool point of largest predictive variance not yet asked."""
    var = np.array(predict(state, X, y, state.pool, settings)[1])
    asked = np.unique(np.concatenate([state.got_index[b] for b in _others(state)]))
    var[asked] = -np.inf
    if np.all(np.isinf(var)):
        raise ValueError(f"party {int(state.party)} has queried every pool point")
    return Query(int(state.party), int(np.argmax(var)))


def respond(state: PartyState, X: Data, y: Data, query: Query, settings: Settings,
            rng_key: Array | None = None) -> tuple[Response, float | None]:
    """Answer one query from the private-data model: the :class:`Response` and, with DP, the
    release's noise multiplier (``rng_key``: this release's randomness)."""
    i, a, me = int(query.pool_index), int(query.sender), int(state.party)
    if not 0 <= i < state.pool.shape[0]:
        raise ValueError(f"party {a} asked for pool index {i}; the pool has "
                         f"{state.pool.shape[0]} points")
    if a == me or not 0 <= a < state.gave.shape[0]:
        raise ValueError(f"party {me} cannot answer a query from party {a}")
    before = [int(j) for j in state.gave[a]]
    if i in before:
        raise ValueError(f"party {a} asked again for pool index {i}, which party {me} has "
                         "already answered")
    p, X, y = state.params, jnp.asarray(X), jnp.asarray(y)
    pts = jnp.asarray(state.pool[np.array([*before, i])])
    mean, cov = gp.predict(p, X, y, pts, full_cov=True)
    cov = cov + p.noise_var * jnp.eye(len(pts))  # predictive covariance of y
    prior = gp.kernel(p, pts, pts)
    released, noise_std, multiplier = float(mean[-1]), 0.0, None
    if settings.dp is not None:
        if rng_key is None:
            raise ValueError("a DP release needs an rng_key")
        released, noise_std, multiplier = _release(p, X, released, float(prior[-1, -1]),
                                                   settings.dp, rng_key)
    cov_row = None
    if settings.uncertainty != "none":
        cov_row = np.array(cov[-1] if settings.uncertainty == "full" else cov[-1, -1:])
        if settings.dp is not None and settings.dp.inflate_variance:
            cov_row[-1] += noise_std**2
    prior_row = np.asarray(prior[-1]) if settings.combination != "noisy" else None
    return Response(me, a, i, released, cov_row, prior_row, noise_std), multiplier


def _release(params: gp.GPParams, X: Array, mean: float, prior_var: float, dp: DPSettings,
             rng_key: Array) -> tuple[float, float, float]:
    """One GP-prior-sample release (:func:`fedppl.privacy.release_mean`): the released mean,
    the added noise's standard deviation, and the release's noise multiplier."""
    K = gp.kernel(params, X, X)
    sens = privacy.gp_mean_sensitivity(np.asarray(K), float(params.noise_var), dp.d,
                                       method=dp.sensitivity)
    one = privacy.PrivacyAccountant()  # records this release's multiplier
    out = privacy.release_mean(rng_key, np.array([mean]), np.array([[prior_var]]), sens,
                               dp.epsilon, dp.delta, rule=dp.rule, accountant=one)
    return (float(out.mean[0]), float(out.noise_scale * np.sqrt(prior_var)),
            one.noise_multipliers[0])


def answer(state: PartyState, X: Data, y: Data, queries: Sequence[Query], settings: Settings,
           rng_key: Array | None = None) -> tuple[Answers, PartyState]:
    """Answer every other party's query (one each, in querier order); returns the message and
    the state that records the answers and the DP releases.

    The noise of the release to party ``a`` is drawn with NumPy from
    ``jax.random.fold_in(rng_key, a)``, by :func:`fedppl.privacy.release_mean`'s rule (a
    generator seeded with the key's raw data): each party's releases come from its own key.
    """
    theirs = sorted((q for q in queries if int(q.sender) != int(state.party)),
                    key=lambda q: int(q.sender))
    if [int(q.sender) for q in theirs] != _others(state):
        raise ValueError(f"party {int(state.party)} needs one query from each of parties "
                         f"{_others(state)}, got queries from "
                         f"{[int(q.sender) for q in queries]}")
    responses, sigmas = [], []
    for q in theirs:
        key = None if rng_key is None else jax.random.fold_in(rng_key, int(q.sender))
        r, sigma = respond(state, X, y, q, settings, key)
        responses.append(r)
        sigmas += [] if sigma is None else [sigma]
    column = np.full((state.gave.shape[0], 1), -1)
    column[[int(q.sender) for q in theirs], 0] = [int(q.pool_index) for q in theirs]
    return Answers(tuple(responses)), state._replace(
        gave=np.concatenate([state.gave, column], axis=1),
        dp_multipliers=np.append(state.dp_multipliers, sigmas))


def receive(state: PartyState, responses: Sequence[Response], settings: Settings) -> PartyState:
    """Fold in the answers to this party's query: one :class:`Response` from every other
    party (a querier hears from each responder once per round)."""
    by_sender = {int(r.sender): r for r in responses}
    if sorted(by_sender) != _others(state) or len(responses) != len(by_sender):
        raise ValueError(f"party {int(state.party)} expects one response from each of parties "
                         f"{_others(state)}, got {[int(r.sender) for r in responses]}")
    K, m = state.got_index.shape
    index, mean = np.full((K, m + 1), -1), np.zeros((K, m + 1))
    index[:, :m], mean[:, :m] = state.got_index, state.got_mean
    cov, prior = np.zeros((K, m + 1, m + 1)), np.zeros((K, m + 1, m + 1))
    cov[:, :m, :m], prior[:, :m, :m] = state.got_cov, state.got_prior
    for b, r in by_sender.items():
        index[b, m], mean[b, m] = int(r.pool_index), float(r.mean)
        _grow(cov[b], r.cov_row, m, settings.uncertainty)
        _grow(prior[b], r.prior_row, m, "full")
    return state._replace(got_index=index, got_mean=mean, got_cov=cov, got_prior=prior)


def _grow(M: np.ndarray, row: np.ndarray | None, m: int, mode: str) -> None:
    """Fill the new last row and column of ``M`` (in place) from ``row``, as ``mode`` says:
    the whole row (``"full"``), its last entry on the diagonal, or zeros (no row sent)."""
    if row is None:
        return
    values = np.asarray(row)
    if mode == "full" and len(values) == m + 1:
        M[m, :] = M[:, m] = values
    else:
        M[m, m] = values[-1]


def epsilon_spent(state: PartyState, delta: float) -> float:
    """The composed epsilon of every DP release the party has made, at ``delta``."""
    sigmas, counts = np.unique(np.asarray(state.dp_multipliers, dtype=float),
                               return_counts=True)
    return _composed_epsilon(tuple(zip(sigmas.tolist(), counts.tolist(), strict=True)),
                             float(delta))


@lru_cache(maxsize=1024)
def _composed_epsilon(releases: tuple[tuple[float, int], ...], delta: float) -> float:
    """Epsilon of ``count`` releases at each noise multiplier (cached: parties and runs with
    the same DP settings spend the same)."""
    accountant = privacy.PrivacyAccountant()
    for sigma, count in releases:
        for _ in range(count):
            accountant.record(sigma)
    return accountant.epsilon(delta)


# -- the trio ----------------------------------------------------------------------------------

def make_trio(settings: Settings) -> Trio:
    """Co-training as a host-side :class:`~fedppl.algorithms.trio.Trio` on (:class:`Relay`,
    :class:`PartyState`); a round of the runtime is one exchange, alternately the ask and the
    answer exchange (see the module docstring). ``data`` is each party's ``(X, y)``."""
    check_settings(settings)

    def client_update(server: Relay, state: PartyState, data, mask, rng_key, index):
        X, y = (np.asarray(a)[np.asarray(mask)] for a in data)
        if server.queries is None:
            return make_query(state, X, y, settings), state
        return answer(state, X, y, unstack(server.queries), settings, rng_key)

    def server_update(server: Relay, messages, index, received, rng_key, evaluate):
        if not np.all(received):
            raise ValueError("co-training needs every party in every exchange")
        if server.queries is None:
            return Relay(messages), None
        return Relay(None), _route(messages)

    def acknowledge(state: PartyState, message, reply: Answers | None, proposed: PartyState):
        return proposed if reply is None else receive(proposed, reply.responses, settings)

    return Trio(client_update, server_update, acknowledge, jit=False)


#: A pytree stacked on axis 0 as the list of its entries: :func:`fedppl.trees.unstack`.
unstack = trees.unstack


def _route(messages: Answers) -> Answers:
    """The relay's replies, stacked over parties: to each querier the responses addressed to
    it, in responder order."""
    responses = [r for stack in messages.responses for r in unstack(stack)]
    K = len(np.asarray(messages.responses[0].sender))
    replies = [Answers(tuple(sorted((r for r in responses if int(r.querier) == a),
                                    key=lambda r: int(r.sender)))) for a in range(K)]
    return trees.stack(replies, xp=np)
