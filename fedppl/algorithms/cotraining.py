"""Private co-training of GPs by exchanging predictions (thesis Ch. 4), as explicit messages.

Each party holds private labelled data in its own view and its view of a shared unlabelled pool
(the same rows for every party). In turn, a party picks the unqueried pool point where its own
predictive variance is largest (uncertainty sampling), sends a :class:`Query` with that index to
every other party, and each replies with a :class:`Response`: its predictive mean (released with
differential privacy when asked), and by choice nothing, the marginal variance, or the covariance
with the points it answered before (``uncertainty`` = ``"none"``/``"marginal"``/``"full"``),
plus its prior kernel on the queried points for the combinations that need it. The querying party
folds the answers into its model by one of three combinations (from party 1's side, with
``V`` the reported uncertainty):

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

Decisions where the thesis is silent: hyperparameters are fitted once by type-II ML on each
party's private data and kept; a responder answers from its private-data model (so no answer
echoes the querier's own information back); one round is one query by every party in turn; the
reported variance includes the DP noise's variance (the mechanism is public, so this costs no
privacy) unless ``inflate_variance=False``.

Example::

    >>> parties = [init_party(v, X_lab[v], y_lab[v], pool[v]) for v in range(2)]
    >>> q = make_query(parties[0])
    >>> r = respond(parties[1], q, settings, rng)
    >>> parties[0] = receive(parties[0], r, settings)
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jax import Array

from fedppl import privacy
from fedppl.models import gp
from fedppl.models.cotraining import cotraining_kernel

__all__ = ["COMBINATIONS", "UNCERTAINTIES", "DPSettings", "Settings", "Query", "Response",
           "Received", "PartyState", "init_party", "make_query", "respond", "receive",
           "predict"]

COMBINATIONS = ("blocky", "noisy", "hybrid")
UNCERTAINTIES = ("none", "marginal", "full")
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


class Query(NamedTuple):
    """Sent by ``sender``: "what do you predict at pool point ``pool_index``?"."""

    sender: int
    pool_index: int


class Response(NamedTuple):
    """Sent by ``sender`` in answer to a query; everything a responder ever releases.

    ``cov_row``: covariance of this prediction with the responder's earlier answers to the same
    querier, in answer order, ending with the variance (None for ``"none"``; length 1 for
    ``"marginal"``). ``prior_row``: the responder's prior kernel between this point and its earlier
    answers, ending with ``k(x, x)`` (only for blocky and hybrid). ``dp_noise_std``: standard
    deviation of the noise added to ``mean`` (0 without DP).
    """

    sender: int
    pool_index: int
    mean: float
    cov_row: Array | None
    prior_row: Array | None
    dp_noise_std: float


class Received(NamedTuple):
    """What a party has been told by one responder: pool indices, means, V and the prior block."""

    pool_index: np.ndarray
    mean: np.ndarray
    V: np.ndarray
    prior: np.ndarray


class PartyState(NamedTuple):
    party: int
    X: Array  # private labelled inputs in this party's view
    y: Array
    pool: Array  # this party's view of the shared pool
    params: gp.GPParams
    received: dict  # responder -> Received
    answered: dict  # querier -> list of pool indices answered (in order)
    accountant: privacy.PrivacyAccountant | None


def init_party(party: int, X: Array, y: Array, pool: Array, fit_steps: int = 300,
               dp: DPSettings | None = None) -> PartyState:
    """Fit the party's GP on its private data (type-II ML) and start with no exchanges."""
    X, y, pool = (jnp.asarray(a, dtype=float) for a in (X, y, pool))
    if X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(f"party {party}: {X.shape[0]} inputs and {y.shape[0]} labels")
    if pool.ndim != 2 or pool.shape[1] != X.shape[1]:
        raise ValueError(f"party {party}: its pool view has shape {pool.shape}, its inputs "
                         f"{X.shape[1]} columns")
    params = gp.fit(X, y, steps=fit_steps)
    accountant = privacy.PrivacyAccountant() if dp is not None else None
    return PartyState(party, X, y, pool, params, {}, {}, accountant)


def _queried(state: PartyState) -> np.ndarray:
    parts = [r.pool_index for r in state.received.values()]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, int)


def make_query(state: PartyState, settings: Settings = Settings()) -> Query:
    """Uncertainty sampling: the unqueried pool point of largest predictive variance."""
    _, var = predict(state, state.pool, settings)
    var = np.array(var)
    var[_queried(state)] = -np.inf
    if np.all(np.isinf(var)):
        raise ValueError(f"party {state.party} has queried every pool point")
    return Query(state.party, int(np.argmax(var)))


def respond(state: PartyState, query: Query, settings: Settings, rng: np.random.Generator
            ) -> tuple[Response, PartyState]:
    """Answer a query from the private-data model; returns the message and the updated state."""
    _check_settings(settings)
    i = query.pool_index
    if not 0 <= i < state.pool.shape[0]:
        raise ValueError(f"party {query.sender} asked for pool index {i}; the pool has "
                         f"{state.pool.shape[0]} points")
    before = list(state.answered.get(query.sender, []))
    if i in before:
        raise ValueError(f"party {query.sender} asked again for pool index {i}, which party "
                         f"{state.party} has already answered")
    pts = state.pool[np.array(before + [i])]
    mean, cov = gp.predict(state.params, state.X, state.y, pts, full_cov=True)
    cov = cov + state.params.noise_var * jnp.eye(len(pts))  # predictive covariance of y
    prior = gp.kernel(state.params, pts, pts)
    released, noise_std = float(mean[-1]), 0.0
    if settings.dp is not None:
        released, noise_std = _release(state, float(mean[-1]), float(prior[-1, -1]),
                                       settings.dp, rng)
    cov_row = None
    if settings.uncertainty != "none":
        cov_row = np.asarray(cov[-1] if settings.uncertainty == "full" else cov[-1, -1:])
        if settings.dp is not None and settings.dp.inflate_variance:
            cov_row = cov_row.copy()
            cov_row[-1] += noise_std**2
    prior_row = np.asarray(prior[-1]) if settings.combination != "noisy" else None
    answered = dict(state.answered)
    answered[query.sender] = before + [i]
    return (Response(state.party, i, released, cov_row, prior_row, noise_std),
            state._replace(answered=answered))


def _release(state: PartyState, mean: float, prior_var: float, dp: DPSettings,
             rng: np.random.Generator) -> tuple[float, float]:
    K = gp.kernel(state.params, state.X, state.X)
    sens = privacy.gp_mean_sensitivity(np.asarray(K), float(state.params.noise_var), dp.d,
                                       method=dp.sensitivity)
    out = privacy.release_mean(rng, np.array([mean]), np.array([[prior_var]]), sens,
                               dp.epsilon, dp.delta, rule=dp.rule, accountant=state.accountant)
    return float(out.mean[0]), float(out.noise_scale * np.sqrt(prior_var))


def receive(state: PartyState, response: Response, settings: Settings) -> PartyState:
    """Append a response to what the party knows from that responder."""
    old = state.received.get(response.sender)
    m = 0 if old is None else len(old.mean)
    idx = np.append([] if old is None else old.pool_index, response.pool_index).astype(int)
    mean = np.append([] if old is None else old.mean, response.mean)
    V = _grow(None if old is None else old.V, response.cov_row, m, settings.uncertainty)
    P = _grow(None if old is None else old.prior, response.prior_row, m, "full")
    received = dict(state.received)
    received[response.sender] = Received(idx, mean, V, P)
    return state._replace(received=received)


def _grow(M: np.ndarray | None, row: Array | None, m: int, mode: str) -> np.ndarray:
    """Extend an m x m matrix by one row/column from ``row`` (zeros where nothing was sent)."""
    out = np.zeros((m + 1, m + 1))
    if M is not None:
        out[:m, :m] = M
    if row is None:
        return out
    row = np.asarray(row)
    if mode == "full" and len(row) == m + 1:
        out[m, :] = out[:, m] = row
    else:
        out[m, m] = row[-1]
    return out


def predict(state: PartyState, X_test: Array, settings: Settings) -> tuple[Array, Array]:
    """The party's combined predictive mean and variance at ``X_test`` (its own view)."""
    X_test = jnp.asarray(X_test, dtype=float)
    if not state.received:
        return gp.predict(state.params, state.X, state.y, X_test)
    p = state.params
    parts = list(state.received.values())
    Xq = state.pool[np.concatenate([r.pool_index for r in parts])]
    y_aug = jnp.concatenate([state.y, jnp.asarray(np.concatenate([r.mean for r in parts]))])
    V = jsl.block_diag(*[r.V for r in parts])
    n1, nq = state.X.shape[0], Xq.shape[0]
    X_aug = jnp.concatenate([state.X, Xq])
    if settings.combination == "noisy":
        extra = jnp.zeros((n1 + nq, n1 + nq)).at[n1:, n1:].set(V + JITTER * jnp.eye(nq))
        return gp.predict(p, X_aug, y_aug, X_test, extra=extra)
    P = jsl.block_diag(*[r.prior for r in parts])
    if settings.combination == "blocky":
        C = jsl.block_diag(*[gp.kernel(p, state.X, state.X) + p.noise_var * jnp.eye(n1),
                    P + V + JITTER * jnp.eye(nq)])
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


def _check_settings(settings: Settings) -> None:
    if settings.combination not in COMBINATIONS:
        raise ValueError(f"combination must be one of {COMBINATIONS}, got "
                         f"{settings.combination!r}")
    if settings.uncertainty not in UNCERTAINTIES:
        raise ValueError(f"uncertainty must be one of {UNCERTAINTIES}, got "
                         f"{settings.uncertainty!r}")
    if settings.dp is not None:
        if not settings.dp.epsilon > 0:
            raise ValueError(f"epsilon must be positive, got epsilon={settings.dp.epsilon}")
        privacy.c_delta(settings.dp.delta, settings.dp.rule)  # checks 0 < delta < 1
