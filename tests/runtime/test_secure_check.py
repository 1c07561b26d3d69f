"""The importance check under secure aggregation, simulated in one process
(:class:`fedppl.runtime.secure.SecureAggregation`).

Bayesian linear regression (conjugate, four clients), checked against a Gaussian twice as wide
as the exact posterior (so the weights are not constant): the server receives each draw's
log-likelihood only as the sum over the clients, and the check's k-hat, ESS and corrected
moments equal the plain check's (same key, same draws) within the quantisation bound; what the
server received is masked; leave-one-client-out is refused; a client whose log-likelihoods are
NaN refuses to send, naming itself; a round that SecAgg+ halts is void.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedppl
from fedppl.algorithms import importance as imp
from fedppl.families import gaussian as g
from fedppl.models import linear_regression
from fedppl.runtime.faults import ALL_KINDS, DROPPED
from fedppl.runtime.secure import QUANTIZATION, SecureAggregation, SecureSum, sum_error

SCALE, K, S = 1e3, 4, 200
SECURE = SecureSum(SCALE)  # threshold 2/3: three of four clients keep the sum


def _clients(dtype=np.float64):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 2)).astype(dtype)
    y = (X @ np.array([1.0, -0.5]) + 0.3 + rng.normal(size=120)).astype(dtype)
    return fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)


def _method(clients, dtype=np.float64):
    """The check of a Gaussian with the exact posterior's mean and twice its covariance."""
    X, y = (np.concatenate([np.asarray(a, float) for a in arrays])
            for arrays in zip(*(clients.client(k) for k in range(K)), strict=True))
    Xb = np.hstack([X, np.ones((len(X), 1))])
    start = g.FullGaussian(jnp.asarray(0.5 * Xb.T @ y, dtype),
                           jnp.asarray(0.5 * (np.eye(3) + Xb.T @ Xb), dtype))
    guide = fedppl.PVIGuide(linear_regression, family="fullrank")
    return fedppl.Importance(linear_regression, guide, start, num_draws=S)


class _Plan:
    """Faults fixed in advance (duck-typed :class:`~fedppl.runtime.faults.Faults`):
    ``{round: {client: fault}}``, a fault ``"dropped"`` or one of ``kinds``."""

    def __init__(self, plan, kinds=ALL_KINDS):
        self.plan, self.kinds = plan, tuple(kinds)
        self.restart()

    def restart(self):
        self.round = 0

    def draw(self, active):
        self.round += 1
        codes = np.zeros(np.shape(active), int)
        for k, fault in self.plan.get(self.round, {}).items():
            codes[k] = DROPPED if fault == "dropped" else DROPPED + 1 + self.kinds.index(fault)
        return codes


def _run(method, clients, runtime=None, rounds=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # k-hat advice
        return method.run(jax.random.key(1), clients, rounds, progress_bar=False,
                          runtime=runtime)


@pytest.fixture(scope="module")
def checks():
    """The plain check, the secure one and its simulation (what the server received)."""
    clients = _clients()
    method = _method(clients)
    sim = SecureAggregation(SECURE)
    return _run(method, clients), _run(method, clients, sim.runtime), sim, clients, method


def test_secure_check_equals_plain_within_the_quantisation_bound(checks):
    """Same draws; each draw's log ratio within the sum's bound; k-hat, ESS and the corrected
    moments follow (each a smooth function of the ratios, moved by at most about that much)."""
    plain, secure, *_ = checks
    bound = sum_error(SCALE, K)
    np.testing.assert_array_equal(secure.draws, plain.draws)
    gap = np.max(np.abs(secure.log_ratios - plain.log_ratios))
    assert 0 < gap <= bound + 1e-12 * np.max(np.abs(plain.log_ratios))
    assert np.isfinite(plain.khat) and abs(secure.khat - plain.khat) <= 10 * bound
    assert abs(secure.ess - plain.ess) <= 10 * bound * plain.ess
    for a, b in zip(secure.mean_and_cov(), plain.mean_and_cov(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=10 * bound)
    # the server holds one row, the total over the clients
    assert secure.summed and not plain.summed and secure.log_lik.shape == (1, S)
    np.testing.assert_allclose(secure.log_lik[0], plain.log_lik.sum(0), rtol=0,
                               atol=bound + 1e-12 * np.max(np.abs(plain.log_lik)))


def test_the_server_received_only_masked_vectors(checks):
    """One masked uint32 vector (two limbs per draw) per client; none agrees with any client's
    own quantised log-likelihoods on more than a couple of entries, and they spread over the
    32-bit range where the plain encodings sit near ``2**21``."""
    plain, _, sim, *_ = checks
    assert len(sim.received) == 1
    masked = sim.received[0]
    assert masked.dtype == np.uint32 and masked.shape == (K, 2, S)
    own = np.rint((plain.log_lik / SCALE + 1.0) * (QUANTIZATION // 2))
    assert np.all(np.abs(own - QUANTIZATION // 2) < QUANTIZATION // 4)
    for vector in masked[:, 0]:
        assert all(np.sum(vector == mine) <= 2 for mine in own)
    assert np.mean(masked[:, 0].astype(np.float64) > 2.0**24) > 0.9


def test_leave_one_client_out_is_refused(checks):
    """loo needs each client's row; to_arviz leaves out the log_likelihood group."""
    plain, secure, *_ = checks
    with pytest.raises(ValueError, match=r"leave-one-client-out needs each client's "
                                         r"log-likelihoods.*secure aggregation withholds"):
        secure.loo()
    tree = secure.to_arviz(num_samples=100)
    assert "log_likelihood" not in tree.children and tree.posterior.attrs["summed"] == 1
    assert "log_likelihood" in plain.to_arviz(num_samples=100).children


def test_a_client_with_nan_refuses_naming_itself(checks):
    """Client 1's log-likelihoods NaN: it withholds them before masking, and the check stops
    with its name and reason, as the plain check does at the server."""
    _, _, _, clients, method = checks
    sim = SecureAggregation(SECURE, faults=_Plan({1: {1: "nan"}}))
    with pytest.raises(ValueError, match="client 1: refused at the client before secure "
                                         "aggregation: log-likelihoods NaN"):
        _run(method, clients, sim.runtime)
    assert len(sim.received[0]) == K - 1  # the others' vectors arrived


def test_a_halted_sum_voids_the_round(checks):
    """Two of four clients drop out in round 1: below SecAgg+'s threshold (three), the sum
    halts and the round is void (no weights, every client named); round 2 is whole and gives
    the check from its draws alone."""
    _, _, _, clients, method = checks
    sim = SecureAggregation(SECURE, faults=_Plan({1: {0: "dropped", 2: "dropped"}}))
    result = _run(method, clients, sim.runtime, rounds=2)
    assert np.isnan(result.history["khat"][0]) and np.isfinite(result.history["khat"][1])
    assert sorted({who for r, who, _ in result.rejected if r == 1}) == list(clients.names)
    assert len(result.draws) == S and len(sim.received[0]) == 2


def test_the_client_floors_a_draw_its_data_rule_out():
    """-inf enters the sum as -scale; entries beyond the scale, NaN, and zero likelihood at
    every draw are refused with their codes."""
    ll = jnp.array([-3.0, -jnp.inf, -5.0])
    summand, ok = imp.secure_summand(imp.Estimates(ll), SCALE)
    assert float(ok) == 1.0 and summand.log_lik.tolist() == [-3.0, -SCALE, -5.0]
    for bad, code in ((ll.at[0].set(jnp.nan), imp.NOT_FINITE),
                      (ll.at[0].set(-2 * SCALE), imp.BEYOND_SCALE),
                      (jnp.full(3, -jnp.inf), imp.RULED_OUT)):
        assert float(imp.secure_summand(imp.Estimates(bad), SCALE)[1]) == code


def test_float32_secure_check_equals_plain():
    """In float32 the encoding's own round-off sets the bound (:func:`sum_error` of float32)."""
    with jax.enable_x64(False):
        clients = _clients(np.float32)
        method = _method(clients, np.float32)
        plain = _run(method, clients)
        secure = _run(method, clients, SecureAggregation(SECURE).runtime)
    bound = 2 * sum_error(SCALE, K, np.float32)
    assert np.max(np.abs(secure.log_lik[0] - plain.log_lik.sum(0))) <= bound
    assert abs(secure.khat - plain.khat) <= 0.05 and abs(secure.ess - plain.ess) <= 0.01 * S


def test_refine_under_secure_aggregation_is_the_importance_refinement():
    """refine on a runtime that gives the server only sums chooses the importance refinement
    (the sampler's server needs each client's messages) and says why; asking for the sampler
    is refused with the reason."""
    clients = _clients()
    answer = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression),
                        line_search=False).run(jax.random.key(0), clients, 2,
                                               progress_bar=False)
    sim = SecureAggregation(SECURE)
    with pytest.raises(ValueError, match=r"SMC sampler's server needs each client's.*"
                                         r"method='importance'"):
        answer.refine(jax.random.key(1), clients, 2, num_draws=S, method="smc",
                      runtime=sim.runtime, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        refined = answer.refine(jax.random.key(1), clients, 2, num_draws=S,
                                runtime=sim.runtime, progress_bar=False)
    assert refined.summed and "secure aggregation" in refined.chosen
    assert len(sim.received) == refined.num_rounds
