"""Every method's ``to_arviz()`` is an ``xarray.DataTree`` that ArviZ 1.x takes without a
warning: ``arviz_stats.summary`` (r-hat defined: independent draws as 4 chains, so near 1) and
``arviz_plots.plot_dist``; the PVI export's layout and moments; the importance check's
``log_likelihood`` group and ``loo()``; PSIS k-hat as ArviZ 0.23's ``psislw`` gave it."""

from __future__ import annotations

import warnings

import jax
import matplotlib
import numpy as np
import pytest

import fedppl
from fedppl.algorithms import importance as imp
from fedppl.arviz import arviz_plots
from fedppl.guides import PVIGuide
from fedppl.models import linear_regression as linear
from tests.conftest import linear_model
from tests.infer.test_front import METHODS as FRONT

matplotlib.use("Agg")
xr = pytest.importorskip("xarray")
azs = pytest.importorskip("arviz_stats", reason="the arviz extra is not installed")
try:  # arviz-plots 0.8 beside Matplotlib 3.11 (see arviz_plots' docstring)
    azp = arviz_plots()
except ImportError:  # pragma: no cover - depends on the environment
    pytest.skip("the arviz extra is not installed", allow_module_level=True)
import matplotlib.pyplot as plt  # noqa: E402

NUM_SAMPLES = 400  # 4 chains of 100 independent draws


def _linear_clients():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = X @ np.array([1.0, -0.5]) + 0.5 * rng.normal(size=60)
    return fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)


def _front(name):
    def run():
        method, clients, kwargs, _ = FRONT[name]()
        return method.run(jax.random.key(0), clients, 2, progress_bar=False, **kwargs)

    return run


def _ep():
    return fedppl.EP(linear, PVIGuide(linear, family="fullrank"), damping=0.5,
                     tilted="exact").run(jax.random.key(0), _linear_clients(), 3,
                                         progress_bar=False)


def _one_shot():
    return fedppl.OneShot(linear, PVIGuide(linear, family="fullrank")).run(
        jax.random.key(0), _linear_clients(), progress_bar=False)


def _importance():
    method, clients, kwargs, _ = FRONT["PVI"]()  # compiled rounds shared with the PVI case
    res = method.run(jax.random.key(0), clients, 2, progress_bar=False, **kwargs)
    return res.check(jax.random.key(1), clients, num_draws=400)


def _pyro():
    pytest.importorskip("pyro")
    import torch

    import fedppl.pyro as fp
    from tests.pyro import models

    pair = models.logistic(n=60, k=3)
    gen = torch.Generator().manual_seed(0)
    return fp.PVI(pair.pyro, fp.PVIGuide(pair.pyro, dtype=torch.float64), "synchronous", 0.5,
                  num_particles=8, local_steps=20).run(gen, pair.clients, 2, progress_bar=False)


RESULTS = {**{name: _front(name) for name in FRONT}, "EP": _ep, "OneShot": _one_shot,
           "Importance": _importance, "Pyro-PVI": _pyro}


@pytest.fixture(scope="module")
def results():
    cache: dict = {}

    def get(name):
        if name not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the runs' own warnings are not ArviZ's
                cache[name] = RESULTS[name]()
        return cache[name]

    return get


def _key(name):
    if name == "Pyro-PVI":
        import torch

        return torch.Generator().manual_seed(1)
    return jax.random.key(1)


@pytest.mark.parametrize("name", list(RESULTS))
def test_every_export_summarises_and_plots_without_warnings(results, name):
    result = results(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning (ArviZ's above all) fails the test
        dt = result.to_arviz(_key(name), num_samples=NUM_SAMPLES)
        assert isinstance(dt, xr.DataTree)
        post = dt.posterior
        assert post.sizes["chain"] == 4 and post.sizes["draw"] == NUM_SAMPLES // 4
        table = azs.summary(dt)
        # independent draws in 4 chains: r-hat defined and near 1, ess near the draws
        assert np.all(np.isfinite(table["r_hat"])) and table["r_hat"].max() < 1.1, table
        assert table["ess_bulk"].min() > 0.3 * NUM_SAMPLES, table
        first = next(iter(post.data_vars))  # one variable, its first few elements: a fast plot
        coords = {d: post[first][d].values[:2] for d in post[first].dims
                  if d not in ("chain", "draw")}
        pc = azp.plot_dist(dt, var_names=[first], coords=coords, backend="matplotlib")
        assert pc is not None
    plt.close("all")


def test_summary_of_pvi_matches_q(results):
    result = results("PVI")
    dt = result.to_arviz(jax.random.key(1), num_samples=4000)
    table = azs.summary(dt, var_names=["w"], kind="stats")
    draws = result.sample(jax.random.key(2), 20000)["w"]
    np.testing.assert_allclose(table["mean"].to_numpy(), np.mean(draws, 0), atol=0.02)
    np.testing.assert_allclose(table["sd"].to_numpy(), np.std(draws, 0), rtol=0.05)


def test_export_has_posterior_and_client_dimension(linear_data):
    X, y = linear_data
    clients = fedppl.partition.homogeneous(X, y, 4)
    result = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank")).run(
        jax.random.key(0), clients, 2, progress_bar=False)
    dt = result.to_arviz(jax.random.key(1), num_samples=500)
    assert dt.posterior["w"].shape == (4, 125, 3)
    assert dt.constant_data["factor_prec"].dims == ("client", "theta", "theta_")
    assert list(dt.constant_data["client"].values) == list(clients.names)
    assert dt.posterior.attrs["num_rounds"] == 2
    mean, _ = result.mean_and_cov()
    summary = azs.summary(dt, var_names=["w"], kind="stats")
    np.testing.assert_allclose(summary["mean"].to_numpy(), mean, atol=0.02)


@pytest.mark.parametrize("bad", [50, 8, 0, 2.5])
def test_num_samples_must_fill_four_chains(results, bad):
    err = TypeError if isinstance(bad, float) else ValueError
    with pytest.raises(err, match="num_samples"):
        results("PVI").to_arviz(jax.random.key(0), num_samples=bad)


def test_importance_log_likelihood_loo_and_compare(results):
    check = results("Importance")
    dt = check.to_arviz(jax.random.key(2), num_samples=NUM_SAMPLES)
    assert dt.log_likelihood["clients"].dims == ("chain", "draw", "client")
    assert dt.posterior.attrs["khat"] == check.khat
    with warnings.catch_warnings():  # a client with a high k-hat is named: not the point here
        warnings.simplefilter("ignore")
        loo = check.loo()
    assert isinstance(loo, azs.ELPDData) and loo.kind == "loo" and loo.n_data_points == 3
    assert loo.elpd_i.dims == ("client",) and loo.pareto_k.dims == ("client",)
    assert loo.elpd == pytest.approx(float(loo.elpd_i.sum()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # ArviZ's own PSIS-LOO over the clients, from the resampled draws: close to loo()
        theirs = azs.loo(dt)
    assert np.isfinite(theirs.elpd) and abs(theirs.elpd - loo.elpd) < 1.0
    with warnings.catch_warnings():  # arviz-stats 0.8's compare: pandas 3.1's Pandas4Warning
        warnings.simplefilter("ignore")
        table = azs.compare({"a": loo, "b": theirs})
    assert set(table.index) == {"a", "b"}


def test_psis_keeps_the_khat_of_arviz_0_23():
    """k-hat as ArviZ 0.23.4's ``psislw`` gave it (values recorded from it): equal where the
    two take the same number of tail draws (N <= 225 and a multiple of 5), within 0.01 where
    arviz-stats takes one draw fewer (floor rather than ceil of 3 sqrt(N)); equal ratios give
    ``-inf``, too few draws ``inf``."""
    target = lambda x: -0.5 * np.sum(np.asarray(x) ** 2, -1)  # noqa: E731
    narrow = imp.Proposal(np.zeros(2), 0.3 * np.eye(2), 7.0)
    x = imp.sample(jax.random.key(0), narrow, 200)
    lw, khat = imp.psis(target(x) - np.asarray(imp.log_prob(narrow, x)))
    assert khat == pytest.approx(0.6342773070144091, abs=1e-12)
    assert np.exp(lw).sum() == pytest.approx(1.0)
    x = imp.sample(jax.random.key(0), narrow, 2000)
    assert imp.psis(target(x) - np.asarray(imp.log_prob(narrow, x)))[1] == pytest.approx(
        0.8367489885502528, abs=0.01)
    assert imp.psis(np.full(200, -3.0))[1] == -np.inf
    lw, khat = imp.psis(np.random.default_rng(0).normal(size=20))
    assert khat == np.inf and np.exp(lw).sum() == pytest.approx(1.0)
