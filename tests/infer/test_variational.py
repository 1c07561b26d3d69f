"""PVI and GlobalVI against closed forms and each other."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import fedppl
from fedppl.guides import PVIGuide
from fedppl.infer import pvi_plan
from fedppl.infer.base import Runtime, embedded_round
from fedppl.models import logistic_regression
from tests.conftest import exact_linear_posterior, linear_model, logistic_model

UNEQUAL = [3, 40, 7, 25, 11, 19, 15]  # 7 clients, one with 3 points


@pytest.fixture
def unequal_clients(linear_data):
    X, y = linear_data
    return fedppl.partition.by_feature(X, y, 7, feature=0, sizes=UNEQUAL)


@pytest.mark.parametrize("schedule", ["sequential", "synchronous"])
@pytest.mark.parametrize("damping", [0.1, 0.5, 1.0])
def test_linear_regression_reaches_exact_posterior(linear_data, unequal_clients, schedule,
                                                   damping):
    X, y = linear_data
    rounds = {0.1: 200, 0.5: 40, 1.0: 3}[damping]
    pvi = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"), schedule=schedule,
                     damping=damping)
    result = pvi.run(jax.random.key(0), unequal_clients, rounds, progress_bar=False)
    mean, cov = result.mean_and_cov()
    exact_mean, exact_cov = exact_linear_posterior(X, y)
    np.testing.assert_allclose(mean, exact_mean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(cov, exact_cov, rtol=1e-6, atol=1e-9)
    assert result.history["free_energy"].shape == (rounds, 7)
    assert result.rejected == []


def test_meanfield_fixed_point_is_global_meanfield_vi(linear_data, unequal_clients):
    """For a Gaussian target, mean-field VI keeps the exact mean and the diagonal precision."""
    X, y = linear_data
    result = fedppl.PVI(linear_model, PVIGuide(linear_model), schedule="synchronous",
                        damping=0.5).run(jax.random.key(0), unequal_clients, 80,
                                         progress_bar=False)
    mean, var = result.mean_and_cov()
    exact_mean, exact_cov = exact_linear_posterior(X, y)
    np.testing.assert_allclose(mean, exact_mean, rtol=1e-6)
    np.testing.assert_allclose(var, 1 / np.diag(np.linalg.inv(exact_cov)), rtol=1e-6)


def test_stochastic_local_optimiser_agrees_with_closed_form(linear_data, unequal_clients):
    """With the conjugate path off, the optax (constant-step Monte Carlo) local optimiser lands
    near the exact answer."""
    X, y = linear_data
    opt = optax.adam(optax.exponential_decay(3e-2, 400, 1e-3))
    result = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"),
                        schedule="sequential", solver="optax", optimizer=opt, local_steps=400,
                        num_particles=16, conjugate=False).run(jax.random.key(0), unequal_clients,
                                                               3, progress_bar=False)
    mean, cov = result.mean_and_cov()
    exact_mean, exact_cov = exact_linear_posterior(X, y)
    sd = np.sqrt(np.diag(exact_cov))
    assert np.all(np.abs(mean - exact_mean) < 0.1 * sd)
    assert np.all(np.abs(np.sqrt(np.diag(cov)) / sd - 1) < 0.1)


def test_global_elbo_matches_closed_form_and_improves(linear_data, unequal_clients):
    result = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"),
                        damping=0.5).run(jax.random.key(0), unequal_clients, 5,
                                         progress_bar=False)
    elbo = result.history["elbo"]
    assert np.all(np.diff(elbo) > -1e-9)
    # at the exact posterior the ELBO is the log marginal likelihood
    X, y = linear_data
    exact = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank")).run(
        jax.random.key(0), unequal_clients, 2, progress_bar=False)
    cov_y = X @ X.T + 0.25 * np.eye(len(y))
    log_ml = dist.MultivariateNormal(np.zeros(len(y)), cov_y).log_prob(y)
    np.testing.assert_allclose(exact.history["elbo"][-1], log_ml, rtol=1e-10)


@pytest.fixture(scope="module")
def logistic_runs():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(500, 3))
    y = (rng.uniform(size=500) < 1 / (1 + np.exp(-(X @ np.array([1.5, -1.0, 0.5]) + 0.3))))
    clients = fedppl.partition.by_feature(X, y.astype(float), 10, feature=0)
    ref = fedppl.GlobalVI(logistic_model, PVIGuide(logistic_model, family="fullrank")).run(
        jax.random.key(0), clients)
    runs = {}
    for schedule, damping in [("sequential", 1.0), ("synchronous", 0.5)]:
        pvi = fedppl.PVI(logistic_model, PVIGuide(logistic_model, family="fullrank"),
                         schedule=schedule, damping=damping)
        runs[schedule] = pvi.run(jax.random.key(1), clients, 15, progress_bar=False)
    return ref, runs


def _close(a, b, sd, tol):
    (ma, ca), (mb, cb) = a.mean_and_cov(), b.mean_and_cov()
    assert np.all(np.abs(ma - mb) < tol * sd), (ma, mb, sd)
    assert np.all(np.abs(np.sqrt(np.diag(ca)) - np.sqrt(np.diag(cb))) < tol * sd)


# With the default natural-gradient local step both fits are deterministic functions of the same
# fixed draws, and PVI's fixed point is GlobalVI's exactly; what is left after 15 rounds is the
# damping's geometric tail (0.5^15 ~ 3e-5 at damping 0.5). The old constant-step optimiser
# missed by 0.02-0.1 sd here.
def test_logistic_pvi_fixed_point_is_global_vi(logistic_runs):
    ref, runs = logistic_runs
    sd = np.sqrt(np.diag(ref.mean_and_cov()[1]))
    for result in runs.values():
        _close(result, ref, sd, 1e-3)
        assert result.history["elbo"][-1] == pytest.approx(ref.history["elbo"][-1], abs=0.5)
        assert result.history["kl_change"][-1] < 1e-8
        assert np.all(result.history["converged"][1:] == 1)
        assert result.unconverged == [] or all(r == 1 for r, _ in result.unconverged)


def test_logistic_synchronous_equals_sequential(logistic_runs):
    ref, runs = logistic_runs
    sd = np.sqrt(np.diag(ref.mean_and_cov()[1]))
    _close(runs["synchronous"], runs["sequential"], sd, 1e-3)


def test_result_samples_posterior_and_history(logistic_runs):
    _, runs = logistic_runs
    result = runs["sequential"]
    draws = result.sample(jax.random.key(2), 50)
    assert draws["w"].shape == (50, 3) and draws["b"].shape == (50,)
    assert set(result.posterior) == {"w", "b"}
    assert result.posterior["w"].event_shape == (3,)
    h = result.history
    assert np.all(h["messages_up"] == 10) and np.all(h["messages_down"] == 10)
    # full-rank over 4 coordinates: 4 + 10 numbers of 8 bytes per message
    assert np.all(h["bytes_up"] == 10 * 14 * 8)
    assert np.all(np.isfinite(h["free_energy"]))


def test_constrained_site_with_lognormal_prior(linear_data):
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, s), obs=y)

    X, y = linear_data
    clients = fedppl.partition.homogeneous(X, y, 4, seed=0)
    result = fedppl.PVI(model, PVIGuide(model)).run(jax.random.key(0), clients, 3,
                                                    progress_bar=False)
    s = result.sample(jax.random.key(1), 2000)["s"]
    assert np.all(s > 0)
    assert 0.35 < np.median(s) < 0.7  # the data were made with noise 0.5


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_global_site_is_named(linear_data):
    X, y = linear_data
    clients = fedppl.partition.homogeneous(X, y, 3)
    pvi = fedppl.PVI(linear_model, PVIGuide(linear_model, global_sites=["w", "tau"]))
    with pytest.raises(ValueError, match=r"\['tau'\].*latent sites are \['w'\]"):
        pvi.run(jax.random.key(0), clients, 1, progress_bar=False)


def test_non_finite_update_is_rejected_and_recorded(linear_data):
    X, y = linear_data
    parts = [(X[:30], y[:30]), (X[30:60] * 1e200, y[30:60]), (X[60:], y[60:])]
    clients = fedppl.Clients.from_list(parts)
    pvi = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"),
                     schedule="synchronous")
    with pytest.warns(RuntimeWarning, match="refused the updates of client 1"):
        result = pvi.run(jax.random.key(0), clients, 2, progress_bar=False)
    assert [(r, c) for r, c, _ in result.rejected] == [(1, "client 1"), (2, "client 1")]
    # the server state is what the two good clients alone give
    good = fedppl.Clients.from_list([parts[0], parts[2]])
    ref = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank")).run(
        jax.random.key(0), good, 2, progress_bar=False)
    np.testing.assert_allclose(result.mean_and_cov()[0], ref.mean_and_cov()[0], rtol=1e-10)
    assert np.all(np.asarray(result.factors.prec[1]) == 0)


def test_argument_checks():
    guide = PVIGuide(linear_model)
    with pytest.raises(ValueError, match="damping"):
        fedppl.PVI(linear_model, guide, damping=0.0)
    with pytest.raises(ValueError, match="schedule"):
        fedppl.PVI(linear_model, guide, schedule="async").run(
            jax.random.key(0), fedppl.Clients.from_list([(np.ones((2, 1)), np.ones(2))]), 1)
    with pytest.raises(ValueError, match="family"):
        PVIGuide(linear_model, family="lowrank")
    with pytest.raises(ValueError, match="local_tol must be positive"):
        fedppl.PVI(linear_model, guide, local_tol=0.0)
    with pytest.raises(ValueError, match=r"local_steps .* must be >= 1"):
        fedppl.PVI(linear_model, guide, local_steps=0)
    with pytest.raises(ValueError, match="even"):
        fedppl.PVI(linear_model, guide, num_particles=3)
    with pytest.raises(ValueError, match="solver"):
        fedppl.PVI(linear_model, guide, solver="lbfgs")
    with pytest.warns(UserWarning, match="optimizer is used only by solver='optax'"):
        fedppl.PVI(linear_model, guide, optimizer=optax.adam(1e-2))
    clients = fedppl.Clients.from_list([(np.ones((2, 1)), np.ones(2))])
    with pytest.raises(ValueError, match="tol must be positive"):
        fedppl.PVI(linear_model, guide).run(jax.random.key(0), clients, 1, tol=-1.0)


def test_client_sampling_converges_and_counts_only_participants(linear_data, unequal_clients):
    X, y = linear_data
    pvi = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"),
                     schedule="synchronous", damping=0.5, clients_per_round=3)
    result = pvi.run(jax.random.key(0), unequal_clients, 60, progress_bar=False)
    assert np.all(result.history["messages_up"] == 3)
    assert np.all(np.sum(np.isfinite(result.history["free_energy"]), axis=1) == 3)
    assert result.rejected == []
    mean, cov = result.mean_and_cov()
    exact_mean, exact_cov = exact_linear_posterior(X, y)
    np.testing.assert_allclose(mean, exact_mean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(cov, exact_cov, rtol=1e-6, atol=1e-9)


def test_loop_schedule_matches_vmap_with_dropouts(logistic_data):
    X, y = logistic_data
    clients = fedppl.partition.homogeneous(X, y, 5)
    out = {}
    for schedule in ["synchronous", "loop"]:
        pvi = fedppl.PVI(logistic_model, PVIGuide(logistic_model), schedule=schedule,
                         damping=0.5, local_steps=20, clients_per_round=3, elbo_samples=0)
        out[schedule] = pvi.run(jax.random.key(0), clients, 3, progress_bar=False)
    np.testing.assert_allclose(out["loop"].q.nat1, out["synchronous"].q.nat1, rtol=1e-8)
    np.testing.assert_allclose(out["loop"].q.prec, out["synchronous"].q.prec, rtol=1e-8)


# -- the line search: which runs score candidates, and the exchanges a deployment makes -------

# a runtime whose server holds no data, as Flower's (fedppl.runtime.Runtime), run embedded
DEPLOYED = Runtime(embedded_round, data_at_server=False)


def test_line_search_default_follows_the_runtime(linear_data):
    """``line_search=None``: every synchronous round scored where the server holds the data,
    ``"adaptive"`` where it does not (here one exchange a round: no round flagged), off with
    privacy; a value given is used as given; the method object is never changed."""
    X, y = linear_data
    clients = fedppl.partition.homogeneous(X, y, 3, seed=0)

    def pvi(schedule="synchronous", **kwargs):
        return fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"), schedule,
                          elbo_samples=0, **kwargs)

    def exchanges(method, runtime=None):
        result = method.run(jax.random.key(0), clients, 2, progress_bar=False, runtime=runtime)
        return result.history["exchanges"].tolist(), result

    default = pvi()
    (here, a), (there, b) = exchanges(default), exchanges(default, DEPLOYED)
    assert default.line_search is None  # resolved per run, not written back
    assert here == [2, 2] and there == [1, 1]
    np.testing.assert_allclose(b.mean_and_cov()[0], exact_linear_posterior(X, y)[0], rtol=1e-9)
    np.testing.assert_allclose(a.mean_and_cov()[0], b.mean_and_cov()[0], rtol=1e-12)
    assert default.plan(jax.random.key(0), clients, runtime=DEPLOYED).trio.client_evaluate \
        is not None  # adaptive: the server can still score a flagged round
    assert exchanges(pvi(line_search=True), DEPLOYED)[0] == [2, 2]
    assert exchanges(pvi(line_search=False))[0] == [1, 1]
    assert exchanges(pvi("sequential"))[0] == [3, 3]  # one exchange per client in turn
    assert pvi_plan.line_search_for(None, object(), True) is False  # a private run's default
    with pytest.raises(ValueError, match="line_search must be"):
        pvi(line_search="sometimes")


def test_flower_node_builds_the_servers_trio(linear_data):
    """A Flower node sets the method up on its own data (``Node._set_up``), and gets the trio
    the server's set-up on a runtime without data gets (the adaptive line search), not the
    embedded one's."""
    pytest.importorskip("flwr")
    from fedppl.runtime.flower import Task
    from fedppl.runtime.flower_node import Node

    X, y = linear_data
    clients = fedppl.partition.homogeneous(X, y, 3, seed=0)
    pvi = fedppl.PVI(linear_model, PVIGuide(linear_model), "synchronous", elbo_samples=0)
    task = Task(pvi, clients.client, 3, num_rounds=2)
    node = Node._set_up(cast(Node, SimpleNamespace(task=task)), clients)
    server = pvi.plan(jax.random.key(0), clients, runtime=DEPLOYED)
    assert node["trio"] is server.trio
    assert node["trio"] is not pvi.plan(jax.random.key(0), clients).trio
    assert pvi.line_search is None


def test_deployment_default_guards_overshooting_synchronous_steps():
    """Mean-field guide, correlated features, 10 clients, damping 1: without the line search
    the synchronous steps over-count each other and q swings further every round (the
    server's acceptance rule refuses nothing: q stays proper); the deployment default scores
    the flagged rounds only and converges."""
    rng = np.random.default_rng(0)
    C = np.linalg.cholesky(0.9 * np.ones((4, 4)) + 0.1 * np.eye(4))
    X = rng.normal(size=(200, 4)) @ C.T
    y = (rng.random(200) < 1 / (1 + np.exp(-X @ rng.normal(size=4)))).astype(float)
    clients = fedppl.partition.homogeneous(X, y, 10, seed=0)

    def run(line_search, runtime=None):
        return fedppl.PVI(logistic_regression, PVIGuide(logistic_regression), "synchronous",
                          line_search=line_search, elbo_samples=0, num_particles=16,
                          local_steps=30).run(jax.random.key(0), clients, 6,
                                              progress_bar=False, runtime=runtime)

    off, default = run(False), run(None, DEPLOYED)
    swing, moved = off.history["kl_change"], default.history["kl_change"]
    assert off.rejected == [] and np.max(swing[3:]) > 100 * swing[0], swing
    assert moved[-1] < 0.05 * moved[0] and np.all(moved[2:] < moved[1]), moved
    exchanges = default.history["exchanges"]
    assert set(exchanges.tolist()) == {1, 2}, exchanges  # scored where flagged, not every round
    assert np.all(default.history["step"][exchanges == 1] == 1.0)
