"""``result.check`` and ``result.refine`` against exact posteriors: a conjugate model where q is
exact (and where it is made too narrow on purpose), random intercepts with a weakly identified
scale against a quadrature of the exact marginal likelihood, leave-one-client-out against the
closed form, the ArviZ export, and bad input."""

from __future__ import annotations

import dataclasses
import warnings

import arviz_stats as azs
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import stats

import fedppl
from fedppl.families import gaussian as g
from fedppl.infer.base import Result
from fedppl.infer.importance import ImportanceResult, _check_messages
from tests.conftest import (
    exact_linear_posterior,
    linear_model,
    random_intercepts,
    random_intercepts_logit,
)
from tests.reference import grid_posterior

D, K = 10, 5


@pytest.fixture(scope="module")
def conjugate():
    """Ten features, five clients: PVI's q is the exact posterior after one sequential pass."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, D))
    y = X @ rng.normal(size=D) + 0.5 * rng.normal(size=300)
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
    res = fedppl.PVI(linear_model, fedppl.PVIGuide(linear_model, family="fullrank")).run(
        jax.random.key(0), clients, 2, progress_bar=False)
    mean, cov = exact_linear_posterior(X, y)
    return res, clients, mean, cov


def errors(result, mean, cov):
    m, c = result.mean_and_cov()
    sd = np.sqrt(np.diag(cov))
    return np.max(np.abs(m - mean) / sd), np.max(np.abs(np.sqrt(np.diag(c)) / sd - 1))


def test_check_of_an_exact_answer(conjugate):
    res, clients, mean, cov = conjugate
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a sound answer
        check = res.check(jax.random.key(1), clients, num_draws=1000)
    assert check.khat < 0.5 and check.reliable
    assert check.ess > 990  # q is the target: the weights are equal to rounding
    mean_err, sd_err = errors(check, mean, cov)
    # Monte Carlo error of 1000 draws: sd / sqrt(1000) = 0.032 sd per coordinate
    assert mean_err < 0.15 and sd_err < 0.1
    h = check.history
    assert h["messages_up"].tolist() == [K] and h["round"].tolist() == [1]
    assert h["bytes_up"][0] == K * 1000 * 8 and h["bytes_down"][0] == K * 1000 * D * 8
    assert check.log_lik.shape == (K, 1000)
    np.testing.assert_allclose(check.start_moments[0], res.mean_and_cov()[0])


def test_a_too_narrow_answer_is_flagged_and_refined(conjugate):
    """q with its sds halved: k-hat above 0.7 (with a warning a user can act on), and refine
    brings the moments within 0.05 sd and 5% of the exact posterior."""
    res, clients, mean, cov = conjugate
    m, c = res.mean_and_cov()
    narrow = dataclasses.replace(res, q=g.FullGaussian.from_moments(m, c / 4))
    with pytest.warns(UserWarning, match="k-hat .* is above .*refine"):
        check = narrow.check(jax.random.key(1), clients, num_draws=2000)
    assert check.khat > 0.7 and not check.reliable
    refined = narrow.refine(jax.random.key(1), clients, num_rounds=10, num_draws=2000,
                            method="importance",
                            ess_target=4000, progress_bar=False)
    assert refined.khat < 0.5 and refined.ess >= 4000
    assert refined.num_rounds <= 10
    assert refined.history["khat"][0] == check.khat  # the same key: round 1 is the check
    mean_err, sd_err = errors(refined, mean, cov)
    assert mean_err < 0.05 and sd_err < 0.05, (mean_err, sd_err)
    # the stated Monte Carlo error covers the actual one (4 se over 10 coordinates)
    se = refined.mcse()
    assert np.all(se < 0.03 * np.sqrt(np.diag(cov)))
    assert np.all(np.abs(refined.mean_and_cov()[0] - mean) < 4 * se)
    draws = refined.sample(jax.random.key(3), 500)
    assert draws["w"].shape == (500, D)


def test_a_round_a_client_missed_is_void(conjugate):
    """The check on a runtime that loses messages (:class:`fedppl.runtime.faults.Faults`): a
    round in which a client did not answer keeps none of its draws (the weights need every
    client's log-likelihood at every draw), names the client in ``rejected``, and the next round
    draws again; the rounds every client answered give the exact posterior's moments."""
    from fedppl.runtime.faults import Faults

    res, clients, mean, cov = conjugate
    faults = Faults(dropout=0.1, seed=3)
    refined = res.refine(jax.random.key(1), clients, num_rounds=4, num_draws=500,
                         method="importance", ess_target=1e9, runtime=faults,
                         progress_bar=False, warn=False)
    void = sorted({r for r, _, _ in faults.events})
    assert 0 < len(void) < 4, faults.events  # this seed loses some rounds, not all
    assert {(r, clients.names[k]) for r, k, _ in faults.events} == {
        (r, who) for r, who, _ in refined.rejected}
    khat = refined.history["khat"]
    assert np.all(np.isnan(khat[np.asarray(void) - 1]))
    assert (~np.isnan(khat)).sum() == 4 - len(void)
    assert len(refined.draws) == 500 * (4 - len(void)) == refined.log_lik.shape[1]
    mean_err, sd_err = errors(refined, mean, cov)
    assert mean_err < 0.2 and sd_err < 0.15, (mean_err, sd_err)


def test_refine_reaches_the_pooled_posterior_with_local_sites():
    """Twenty groups on ten clients, a weak group scale: PVI's Gaussian is off in the
    log-scale (it cannot carry the skew); the check flags it and refine, with each client's
    Laplace-importance marginal likelihood, lands within 0.1 sd and 10% of the quadrature."""
    rng = np.random.default_rng(3)
    J, n = 20, 4
    a = 0.3 * rng.normal(size=J)
    groups = [0.5 + a[j] + rng.normal(size=n) for j in range(J)]
    parts = [(np.repeat([0, 1], n), np.concatenate([groups[2 * k], groups[2 * k + 1]]))
             for k in range(J // 2)]
    clients = fedppl.Clients.from_list(parts)
    guide = fedppl.PVIGuide(random_intercepts, ("mu", "tau"), family="fullrank")
    res = fedppl.PVI(random_intercepts, guide).run(jax.random.key(0), clients, 10,
                                                   progress_bar=False, n_groups=2)
    mean, sd = grid_posterior(groups)
    q_mean = res.mean_and_cov()[0]
    q_err = np.max(np.abs(np.asarray(q_mean) - mean) / sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check = res.check(jax.random.key(1), clients, num_draws=1000)
    refined = res.refine(jax.random.key(2), clients, num_rounds=8, num_draws=1000,
                         method="importance",
                         progress_bar=False)
    m, c = refined.mean_and_cov()
    assert np.all(np.abs(m - mean) / sd < 0.1), (m, mean, sd)
    assert np.all(np.abs(np.sqrt(np.diag(c)) / sd - 1) < 0.1), (np.sqrt(np.diag(c)), sd)
    assert refined.khat < 0.5
    # where the answer being corrected is off by more than 0.2 sd, the check says so
    assert q_err <= 0.2 or check.khat > 0.7, (q_err, check.khat)
    # Gaussian random effects: each client's local estimate is exact, and says so
    assert refined.local_sd < 1e-5 and np.all(refined.history["local_sd"] < 1e-5)
    assert refined.history["bytes_up"][0] == 10 * 2 * 1000 * 8  # estimates and variances


def test_noisy_local_estimates_are_reported(monkeypatch):
    """Logistic random effects: the local estimates are not exact; their sd is reported and,
    above the threshold, warned about (the threshold lowered here to make it fire)."""
    import fedppl.infer.importance as front

    rng = np.random.default_rng(5)
    parts = [(np.repeat([0, 1], 6), (rng.uniform(size=12) < 0.6).astype(float))
             for _ in range(4)]
    clients = fedppl.Clients.from_list(parts)
    guide = fedppl.PVIGuide(random_intercepts_logit, ("mu", "tau"), family="fullrank")
    res = fedppl.PVI(random_intercepts_logit, guide).run(jax.random.key(0), clients, 3,
                                                         progress_bar=False, n_groups=2)
    check = res.check(jax.random.key(1), clients, num_draws=200, local_draws=8, warn=False)
    assert 0 < check.local_sd < 1.0 and check.summary()["local_sd"] == check.local_sd
    monkeypatch.setattr(front, "LOCAL_SD", 0.5 * check.local_sd)
    with pytest.warns(UserWarning, match="Raise local_draws"):
        res.check(jax.random.key(1), clients, num_draws=200, local_draws=8)


def test_leave_one_client_out_against_the_closed_form():
    """K = 5, a conjugate model: ``loo()`` matches ``p(y_k | y_-k)`` within 0.05 nats where its
    k-hat is sound; a client unlike the others is flagged; ``arviz_stats.compare`` takes it."""
    rng = np.random.default_rng(4)
    X = rng.normal(size=(100, 2))
    y = X @ np.array([1.0, -0.5]) + 0.5 * rng.normal(size=100)
    clients = fedppl.partition.homogeneous(X, y, num_clients=5, seed=0)
    guide = fedppl.PVIGuide(linear_model, family="fullrank")
    res = fedppl.PVI(linear_model, guide).run(jax.random.key(0), clients, 2, progress_bar=False)
    check = res.check(jax.random.key(0), clients, num_draws=4000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loo = check.loo()
    sound = loo.pareto_k.values < 0.7
    assert sound.sum() >= 3
    # a client whose leave-out weights are unreliable is named in a warning
    assert all(any(name in str(w.message) for w in caught)
               for name in np.asarray(clients.names)[~sound])
    for k in np.nonzero(sound)[0]:
        keep = [j for j in range(5) if j != k]
        Xr = np.concatenate([clients.client(j)[0] for j in keep])
        yr = np.concatenate([clients.client(j)[1] for j in keep])
        m, c = exact_linear_posterior(Xr, yr)
        Xk, yk = clients.client(k)
        want = stats.multivariate_normal(Xk @ m, Xk @ c @ Xk.T + 0.25 * np.eye(len(yk))
                                         ).logpdf(yk)
        assert abs(float(loo.elpd_i[k]) - want) < 0.05
    # an outlying client: its leave-out posterior is far from the pooled one
    data = [clients.client(k) for k in range(4)] + [(X[:20], y[:20] + 8.0)]
    odd = fedppl.Clients.from_list(data)
    res2 = fedppl.PVI(linear_model, guide).run(jax.random.key(0), odd, 2, progress_bar=False)
    with pytest.warns(UserWarning, match="client 4"):
        loo2 = res2.check(jax.random.key(1), odd, num_draws=1000, warn=False).loo()
    assert loo2.pareto_k.values[4] > 0.7 and loo2.warning
    with warnings.catch_warnings():  # arviz-stats 0.8's compare: pandas 3.1's Pandas4Warning
        warnings.simplefilter("ignore")
        table = azs.compare({"base": loo, "other": loo2})
    assert list(table.index) == ["base", "other"]


def test_arviz_export_and_az_loo(conjugate):
    res, clients, _, _ = conjugate
    check = res.check(jax.random.key(1), clients, num_draws=500)
    idata = check.to_arviz(jax.random.key(2), num_samples=400)
    assert idata.posterior["w"].shape == (4, 100, D)  # 4 chains of 100 draws
    assert idata.log_likelihood["clients"].dims == ("chain", "draw", "client")
    assert idata.posterior.attrs["khat"] == check.khat
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isfinite(azs.loo(idata).elpd)
    summary = check.summary()
    assert summary["draws"] == 500 and summary["rounds"] == 1


def test_check_of_global_vi_and_one_shot(conjugate):
    """A pooled answer is checked on the federated clients; so is a one-shot merge."""
    clients = conjugate[1]
    guide = fedppl.PVIGuide(linear_model, family="fullrank")
    pooled = fedppl.GlobalVI(linear_model, guide).run(jax.random.key(0), clients)
    check = pooled.check(jax.random.key(1), clients, num_draws=500)
    assert check.client_names == clients.names and check.khat < 0.5
    shot = fedppl.OneShot(linear_model, fedppl.PVIGuide(linear_model, family="fullrank"),
                          "laplace").run(jax.random.key(0), clients)
    assert shot.check(jax.random.key(1), clients, num_draws=500).khat < 0.5


def subsampled(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=10) as idx:
        numpyro.sample("y", dist.Normal(X[idx] @ w, 0.5), obs=y[idx])


def test_bad_input(conjugate):
    res, clients, _, _ = conjugate
    with pytest.raises(ValueError, match="at least 100"):
        res.check(jax.random.key(1), clients, num_draws=50)
    with pytest.raises(TypeError, match="no Gaussian q"):
        Result(history={"round": np.arange(1)}).check(jax.random.key(1), clients)
    rng = np.random.default_rng(0)
    other = fedppl.partition.homogeneous(rng.normal(size=(60, 3)), rng.normal(size=60),
                                         num_clients=K, seed=0)
    with pytest.raises(ValueError, match="not the run's clients"):
        res.check(jax.random.key(1), other)
    private = dataclasses.replace(res, privacy={"worst_epsilon": 1.0, "delta": 1e-5})
    with pytest.raises(ValueError, match="differentially private"):
        private.check(jax.random.key(1), clients)
    with pytest.raises(ValueError, match=r"odd .*NaN"):
        _check_messages(np.array([[0.0, -1.0], [np.nan, 0.0]]), ("fine", "odd"))
    with pytest.raises(ValueError, match="zero likelihood at every draw"):
        _check_messages(np.array([[-np.inf, -np.inf]]), ("odd",))
    with pytest.raises(ValueError, match="subsamples plate 'data'"):
        fedppl.Importance(subsampled, res.guide, res.q).init(jax.random.key(0), clients)
    with pytest.raises(TypeError, match=r"fedppl\.Clients"):
        res.check(jax.random.key(1), [clients.client(0)])
    assert isinstance(res.check(jax.random.key(1), clients, num_draws=100), ImportanceResult)


def keyword_linear(X, y=None, *, prior_scale=1.0):
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def test_check_of_a_model_with_keyword_only_arguments(conjugate):
    """A model whose static arguments are keyword-only, run without them, is checked (the
    names of its keyword-only parameters are not taken for bound values); run with them, the
    check binds the run's values."""
    clients = conjugate[1]
    guide = fedppl.PVIGuide(keyword_linear, family="fullrank")
    plain = fedppl.PVI(keyword_linear, guide).run(jax.random.key(0), clients, 2,
                                                  progress_bar=False)
    assert plain.check(jax.random.key(1), clients, num_draws=500).khat < 0.5
    wide = fedppl.PVI(keyword_linear, guide).run(jax.random.key(0), clients, 2,
                                                 progress_bar=False, prior_scale=3.0)
    assert wide.check(jax.random.key(1), clients, num_draws=500).khat < 0.5
