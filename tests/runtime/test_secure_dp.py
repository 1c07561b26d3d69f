"""DP-PVI's noise distributed over a secure sum (``DPVirtualParties(distributed=t)`` on
:class:`fedppl.runtime.secure.SecureAggregation`).

Each client adds ``1/t`` of the noise variance the accounting assumes, and its message stays
linear in its noise, so every total the server decodes (``n >= t`` clients) carries at least
the assumed noise. Shown here: the noise's variance per client and per total against Monte
Carlo; without noise the secure run equals the central DP-PVI run within the quantisation
bound; with noise the server's q is exactly the product of what the clients kept (nothing lost
in the sum); a total of fewer than ``t`` clients is refused whole, leaving the server's state as
it was; the faults of ``tests/runtime/test_faults.py`` at the clients leave every server state
proper; the accounting (the totals' epsilon as central DP-PVI's, one message's with multiplier
``sigma / sqrt(t)``); what is refused, and float32. On Flower's Simulation Engine through
SecAgg+: ``test_flower_secure_pvi.py``.
"""

from __future__ import annotations

import math
import warnings

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedppl
from fedppl import accounting
from fedppl.algorithms import pvi as pvi_algorithm
from fedppl.algorithms.dp_mechanisms import VirtualPartiesSolver
from fedppl.families import gaussian as g
from fedppl.models import linear_regression
from fedppl.runtime.faults import KINDS, Faults
from fedppl.runtime.secure import SecureAggregation, SecureSum, sum_error

SCALE, K, T, ROUNDS = 1e3, 6, 3, 3
SECURE = SecureSum(SCALE, threshold=0.5)


def _clients(dtype=np.float64):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(180, 2)).astype(dtype)
    y = (X @ np.array([1.0, -0.5]) + 0.3 + rng.normal(size=180)).astype(dtype)
    return fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)


def _pvi(noise: float, distributed: int | None = T, **dp) -> fedppl.PVI:
    privacy = fedppl.DPVirtualParties(clip=dp.pop("clip", 5.0), parties=3,
                                      distributed=distributed,
                                      **(dp or {"noise_multiplier": noise}))
    return fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression),
                      schedule="synchronous", damping=0.5, privacy=privacy, local_steps=20,
                      optimizer=optax.adam(0.05), elbo_samples=0)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the round log's refusal warnings
        return fn(*args, **kwargs)


def _gap(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                               strict=True))


def test_each_client_adds_its_share_of_the_noise():
    """The release of one client's parties (changes zero, 3 parties, 4 entries a party):
    central, the noise summed over the parties has variance ``(sigma * clip)^2``; distributed
    over ``t = 3``, a third of it, and three clients' together the whole (Monte Carlo over
    4000 releases, each variance within 6% of its target: the chi-square's sd is 2.2%)."""
    sigma, clip, parties, draws = 2.0, 0.5, 3, 4000
    zero = g.DiagGaussian(jnp.zeros((parties, 2)), jnp.zeros((parties, 2)))
    q = g.DiagGaussian(jnp.zeros(2), jnp.ones(2))

    def released(distributed, key):
        solver = VirtualPartiesSolver(None, None, None, 1, 1, clip, sigma, parties, distributed)
        noisy = solver.release(q, zero, key)
        return jnp.concatenate([noisy.nat1.sum(0), noisy.prec.sum(0)])

    keys = jax.random.split(jax.random.key(1), draws * T).reshape(draws, T)
    central = jax.vmap(lambda k: released(None, k[0]))(keys)
    shared = jax.vmap(jax.vmap(lambda k: released(T, k)))(keys)   # (draws, T clients, 4)
    target = (sigma * clip) ** 2
    np.testing.assert_allclose(np.var(central, axis=0), target, rtol=0.06)
    np.testing.assert_allclose(np.var(shared[:, 0], axis=0), target / T, rtol=0.06)
    np.testing.assert_allclose(np.var(shared.sum(1), axis=0), target, rtol=0.06)
    assert np.all(np.var(shared[:, 0], axis=0) < 0.5 * target)  # one message: far less


@pytest.fixture(scope="module")
def noiseless():
    """The central DP-PVI run (embedded) and the distributed one (secure), both without noise:
    the same clipped party changes, so the same q up to the sums' quantisation."""
    clients = _clients()
    central = _pvi(0.0, None).run(jax.random.key(0), clients, ROUNDS, progress_bar=False)
    secure = _pvi(0.0).run(jax.random.key(0), clients, ROUNDS, progress_bar=False,
                           runtime=SecureAggregation(SECURE).runtime)
    return central, secure


def test_without_noise_the_secure_run_is_the_central_one(noiseless):
    """Each client takes the whole step in both (q stays proper here), so the secure run's q,
    factors and parties' factors equal the central run's within ``ROUNDS`` sums' error, while
    one client's factor is far larger than that."""
    central, secure = noiseless
    assert np.all(central.history["step"] == 1.0) and np.all(secure.history["step"] == 1.0)
    bound = ROUNDS * sum_error(SCALE, K) + 1e-9
    assert _gap(secure.q, central.q) <= bound
    assert _gap(secure.factors, central.factors) <= bound
    assert _gap(g.quotient(secure.q, jax.tree_util.tree_map(lambda t: t[0], secure.factors)),
                secure.q) > 1e3 * bound
    assert secure.privacy["distributed"] == T and central.rejected == secure.rejected == []


def test_the_server_applies_exactly_the_sum_of_the_noisy_messages():
    """With noise, what the server folds is the total of what the clients kept: after each round
    ``q = prior * prod_k t_k`` holds to the sums' error, and every client's parties' factors
    still sum to its factor; the noise moved q (against the noiseless run) by far more."""
    clients = _clients()
    method = _pvi(1.0)
    state = method.init(jax.random.key(0), clients, runtime=SecureAggregation(SECURE).runtime)
    prior = method.guide.prior_or_raise()
    for _ in range(ROUNDS):
        state, _ = _quiet(method.update, state)
        total = jax.tree_util.tree_map(lambda t: t.sum(0), state.clients.factor)
        assert _gap(state.server.q, g.product(prior, total)) <= ROUNDS * sum_error(SCALE, K)
        parties = jax.tree_util.tree_map(lambda t: t.sum(1), state.clients.parties)
        assert _gap(parties, state.clients.factor) <= 1e-9
    clean = _pvi(0.0).run(jax.random.key(0), clients, ROUNDS, progress_bar=False,
                          runtime=SecureAggregation(SECURE).runtime)
    assert _gap(state.server.q, clean.q) > 1.0


def test_a_total_short_of_noise_is_refused_whole():
    """``distributed=K``: a total carries the assumed noise only if every client is in it. Under
    30% dropout, every round a client missed is refused whole (for each client in the sum: too
    little noise, or SecAgg+ halted for want of senders), leaving q as it was; the others are
    applied; every state stays proper."""
    faults = Faults(dropout=0.3, seed=1)
    method, clients = _pvi(1.0, K), _clients()
    state = method.init(jax.random.key(0), clients,
                        runtime=SecureAggregation(SECURE, faults).runtime)
    short = pvi_algorithm.REFUSALS[pvi_algorithm.NOISE_SHORT]
    halted = pvi_algorithm.REFUSALS[pvi_algorithm.SUM_HALTED]
    for _ in range(6):
        before = state.server.q
        state, _ = _quiet(method.update, state)
        r = int(state.server.round)
        dropped = {k for rr, k, f in faults.events if rr == r and f == "dropped"}
        assert bool(g.is_pd(state.server.q)) and bool(g.is_finite(state.server.q))
        assert (_gap(state.server.q, before) == 0.0) == bool(dropped)
        reasons = {why for rr, who, why in state.log.method.rounds.rejected if rr == r
                   and who not in {clients.names[k] for k in dropped}}
        assert reasons <= {short, halted} and bool(reasons) == bool(dropped)
    assert any(f == "dropped" for _, _, f in faults.events)
    assert any(why == short for _, _, why in state.log.method.rounds.rejected)


def test_faults_at_the_clients_leave_the_server_proper():
    """30% dropout and 5% corrupted messages (NaN, inf, huge, improper) at the clients, with
    ``t = 3`` of 6: a non-finite message is withheld by its client; a huge one (beyond the
    scale) too; an improper one enters the total, whose step the server halves or refuses.
    Every server state stays finite and positive definite, and every client's parties still sum
    to its factor."""
    faults = Faults(dropout=0.3, corrupt=0.05, kinds=KINDS, seed=3)
    method, clients = _pvi(1.0), _clients()
    state = method.init(jax.random.key(0), clients,
                        runtime=SecureAggregation(SECURE, faults).runtime)
    for _ in range(20):
        state, _ = _quiet(method.update, state)
        assert bool(g.is_finite(state.server.q)) and bool(g.is_pd(state.server.q))
    corrupted = [(r, k, f) for r, k, f in faults.events if f != "dropped"]
    assert {f for _, _, f in corrupted} >= {"nan", "inf"}
    rejected = {(r, who): why for r, who, why in state.log.method.rounds.rejected}
    for r, k, fault in corrupted:
        if fault in ("nan", "inf"):
            assert "refused at the client" in rejected[(r, clients.names[k])]
            assert "not finite" in rejected[(r, clients.names[k])]
    parties = jax.tree_util.tree_map(lambda t: t.sum(1), state.clients.parties)
    assert _gap(parties, state.clients.factor) <= 1e-9


def test_the_accounting_of_totals_and_of_one_message():
    """The totals' epsilon is central DP-PVI's (one Gaussian mechanism of multiplier sigma a
    round); one message alone is a mechanism of multiplier ``sigma / sqrt(t)``, so a larger
    epsilon; a target epsilon calibrates the same sigma as central DP-PVI."""
    clients = _clients()
    rt = SecureAggregation(SECURE).runtime
    result = _pvi(1.0).run(jax.random.key(0), clients, 2, progress_bar=False, runtime=rt)
    p = result.privacy

    def eps(sigma):
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), 2)
        return accounting.epsilon(event, 1e-5)

    assert p["worst_epsilon"] == pytest.approx(eps(1.0), rel=1e-12)
    assert p["message_noise_multiplier"] == pytest.approx(1.0 / math.sqrt(T), rel=1e-15)
    assert p["worst_message_epsilon"] == pytest.approx(eps(1.0 / math.sqrt(T)), rel=1e-12)
    assert p["worst_message_epsilon"] > 1.5 * p["worst_epsilon"]
    assert set(p["message_epsilon"]) == set(clients.names)
    target = dict(epsilon=2.0, rounds=2)
    shared = _pvi(0.0, T, **target).init(jax.random.key(0), clients, runtime=rt)
    central = _pvi(0.0, None, **target).init(jax.random.key(0), clients)
    sigma = shared.plan.static.calibration.sigma
    assert sigma == central.plan.static.calibration.sigma
    assert eps(sigma) <= 2.0 < eps(0.99 * sigma)


def test_what_is_refused():
    """Distributed noise outside secure aggregation (each message would carry a t-th of the
    noise in the clear), central noise under it (its parties would not follow a clipped
    delta), and bad settings: each with its reason."""
    clients = _clients()
    with pytest.raises(ValueError, match="under secure aggregation"):
        _pvi(1.0).init(jax.random.key(0), clients)
    central = _pvi(1.0, None)
    state = central.init(jax.random.key(0), clients, runtime=SecureAggregation(SECURE).runtime)
    with pytest.raises(ValueError, match=r"distributed=t"):
        central.update(state)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="distributed must be a positive integer"):
            fedppl.DPVirtualParties(clip=1.0, noise_multiplier=1.0, distributed=bad)


def test_float32():
    """In float32 the noiseless secure run equals the central one within float32's sum error
    (relative to q's largest natural parameter: the solver's round-off); with noise it runs,
    every state proper."""
    with jax.enable_x64(False):
        clients, rt = _clients(np.float32), SecureAggregation(SECURE).runtime
        central = _pvi(0.0, None).run(jax.random.key(0), clients, 2, progress_bar=False)
        secure = _pvi(0.0).run(jax.random.key(0), clients, 2, progress_bar=False, runtime=rt)
        noisy = _pvi(1.0).run(jax.random.key(0), clients, 2, progress_bar=False, runtime=rt)
        assert secure.q.nat1.dtype == jnp.float32 and noisy.q.nat1.dtype == jnp.float32
        assert bool(g.is_pd(noisy.q)) and bool(g.is_finite(noisy.q))
        assert noisy.rejected == [] and _gap(noisy.q, secure.q) > 1.0
        largest = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(central.q))
        bound = 2 * sum_error(SCALE, K, np.float32) + 1e-5 * largest
        assert 0 < _gap(secure.q, central.q) <= bound

