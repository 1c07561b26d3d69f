"""The Pyro port's front: results, the server's acceptance rule, client sampling, the schedules,
the stochastic local step and the import guard."""

from __future__ import annotations

import importlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pyro.optim
import pytest
import torch

import fedppl
import fedppl.pyro as fp
from fedppl.algorithms import pvi as jpvi
from fedppl.families import gaussian as jg
from fedppl.pyro.algorithms import pvi as tpvi
from fedppl.pyro.families import gaussian as tg
from fedppl.runtime.embedded import make_round as make_round_embedded
from tests.pyro import models
from tests.pyro.conftest import key

F64 = torch.float64


@pytest.fixture(scope="module")
def logistic_run():
    pair = models.logistic(n=120, k=4)
    res = fp.PVI(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64),
                 "synchronous", 0.5, num_particles=32).run(key(), pair.clients, 3,
                                                           progress_bar=False)
    return pair, res


def test_result_has_the_numpyro_results_shape(logistic_run):
    pair, res = logistic_run
    assert set(res.history) == {"round", "seconds", "messages_up", "messages_down", "bytes_up",
                                "bytes_down", "rejected", "free_energy", "converged",
                                "local_iterations", "step", "kl_change", "exchanges", "elbo"}
    assert res.history["free_energy"].shape == (3, 4) and res.history["elbo"].shape == (3,)
    assert np.all(np.diff(res.history["elbo"]) > -0.5)  # an MC estimate that climbs
    assert res.history["bytes_up"][0] == 4 * (4 + 10) * 8  # D + D(D+1)/2 float64 numbers
    draws = res.sample(key(1), 500)
    assert {k: tuple(v.shape) for k, v in draws.items()} == {"w": (500, 3), "b": (500,)}
    mean, cov = res.mean_and_cov()
    np.testing.assert_allclose(draws["w"].mean(0).numpy(), mean[:3].numpy(),
                               atol=4 * float(cov.diagonal().max().sqrt()) / np.sqrt(500))
    assert tuple(res.posterior["b"].sample().shape) == ()
    pred = res.predictive(key(2), torch.as_tensor(pair.arrays[0][:5]), num_samples=20)
    assert tuple(pred["y"].shape) == (20, 5)
    assert res.to_json()["summary"]["rounds"] == 3


def test_to_arviz_has_a_client_dimension(logistic_run):
    pytest.importorskip("arviz_base")
    _, res = logistic_run
    idata = res.to_arviz(key(), num_samples=48)
    assert idata.posterior["w"].shape == (4, 12, 3)
    assert idata.constant_data["factor_prec"].dims == ("client", "theta", "theta_")
    assert list(idata.constant_data.coords["client"].values) == list(res.client_names)


def _gaussians(full):
    rng = np.random.default_rng(0)
    q_mean, q_cov = rng.normal(size=3), np.diag([0.5, 1.0, 2.0])
    deltas = [(np.zeros(3), 0.1 * np.eye(3)),  # fine
              (np.full(3, np.nan), np.eye(3)),  # not finite
              (np.zeros(3), -5.0 * np.eye(3)),  # q would be improper
              (np.zeros(3), 1e12 * np.eye(3))]  # implausible
    nat1 = np.stack([d[0] for d in deltas])
    prec = np.stack([d[1] if full else np.diag(d[1]) for d in deltas])
    cov = q_cov if full else np.diag(q_cov)
    jq = (jg.FullGaussian if full else jg.DiagGaussian).from_moments(q_mean, cov)
    tq = (tg.FullGaussian if full else tg.DiagGaussian).from_moments(torch.as_tensor(q_mean),
                                                                      torch.as_tensor(cov))
    jd = type(jq)(jnp.asarray(nat1), jnp.asarray(prec))
    td = type(tq)(torch.as_tensor(nat1), torch.as_tensor(prec))
    return jq, jd, tq, td


@pytest.mark.parametrize("full", [True, False], ids=["full", "diag"])
def test_the_acceptance_rule_is_the_numpyro_cores(full):
    jq, jd, tq, td = _gaussians(full)
    codes = tpvi.verdicts(tq, td)
    np.testing.assert_array_equal(codes.numpy(), np.asarray(jpvi.verdicts(jq, jd)))
    assert codes.tolist() == [1.0, tpvi.NOT_FINITE, tpvi.NOT_PD, tpvi.IMPLAUSIBLE]
    assert tpvi.REFUSALS == jpvi.REFUSALS
    n = np.zeros(4)
    jmsg = jpvi.ClientMessage(jd, n, n > 0, n == 0, n)
    tmsg = tpvi.ClientMessage(td, *(torch.as_tensor(x) for x in (n, n > 0, n == 0, n)))
    js, jr = jpvi.server_update(jpvi.ServerState(jq, jnp.asarray(0)), jmsg)
    ts, tr = tpvi.server_update(tpvi.ServerState(tq, 0), tmsg)
    np.testing.assert_array_equal(tr.numpy(), np.asarray(jr))
    np.testing.assert_allclose(ts.q.prec.numpy(), np.asarray(js.q.prec), rtol=1e-14)
    assert bool(tg.is_pd(ts.q)) and bool(tg.is_finite(ts.q))


@pytest.mark.xfail(strict=True, reason="the port's torch server, which symmetrised every stored "
                   "precision, is gone: the port runs the core's server (fedppl.algorithms.pvi), "
                   "which keeps a symmetric precision symmetric but does not repair an ulp of "
                   "asymmetry in its input")
def test_precisions_stay_exactly_symmetric():
    """An ulp of asymmetry in a sum over clients would grow by ``K rho - 1`` a round (the
    benchmark's K = 100 full-rank run diverged from it): the server and clients symmetrise."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 3, 3))
    prec = torch.as_tensor(a @ a.transpose(0, 2, 1) * 1e-3)
    prec[:, 0, 1] += 1e-16  # an ulp's asymmetry
    deltas = tg.FullGaussian(torch.zeros(5, 3), prec)
    server = tpvi.init(tg.FullGaussian(torch.zeros(3), torch.eye(3, dtype=F64)), deltas)
    n = torch.zeros(5)
    msg = tpvi.ClientMessage(deltas, n, n > 0, n == 0, n)
    new, steps = tpvi.server_update(server, msg)
    states = tpvi.acknowledge(tpvi.ClientState(deltas), msg, steps)
    for P in (server.q.prec, new.q.prec, states.factor.prec):
        assert torch.equal(P, P.transpose(-1, -2))


def _corrupting(bad):
    """A runtime whose client ``bad`` sends a NaN update (a broken client): the core's embedded
    runtime on the trio with that client's message corrupted."""

    def make_round(trio, schedule):
        def client_update(server, cstate, data, mask, rng_key, index):
            msg, proposed = trio.client_update(server, cstate, data, mask, rng_key, index)
            nat1 = jnp.where(index == bad, jnp.nan, msg.delta.nat1)
            return msg._replace(delta=msg.delta._replace(nat1=nat1)), proposed

        return make_round_embedded(trio._replace(client_update=client_update), schedule)

    return make_round


def test_one_bad_client_is_refused_by_name_and_the_rest_applied():
    pair = models.linear()
    pvi = fp.PVI(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64), "synchronous",
                 elbo_samples=0)
    with pytest.warns(RuntimeWarning, match="refused the updates of client 2"):
        res = pvi.run(key(), pair.clients, 1, progress_bar=False, runtime=_corrupting(2))
    before = tg.zeros_like(res.factors)  # the clients' factors start flat
    assert res.history["rejected"][0] == 1 and np.isnan(res.history["free_energy"]).sum() == 0
    assert res.rejected == [(1, "client 2", "message not finite")]
    assert bool(tg.is_finite(res.q)) and bool(tg.is_pd(res.q))
    np.testing.assert_array_equal(res.factors.prec[2].numpy(), before.prec[2].numpy())
    assert not torch.equal(res.factors.prec[1], before.prec[1])
    # q is the prior times the accepted factors: client 2 left out, nothing shrunk into it
    total = tg.product(pvi.guide.prior, *(tg.index(res.factors, k) for k in range(7)))
    np.testing.assert_allclose(res.q.prec.numpy(), total.prec.numpy(), rtol=1e-12)


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_client_sampling_and_the_vectorised_round_equal_a_loop_over_clients(schedule):
    """A batched local solve gives each client the answer it would get alone: the vectorised
    synchronous round equals the Python loop over clients, with 3 of 5 clients a round."""
    pair = models.logistic(n=100, k=5)
    runs = {}
    for sched in ("loop", schedule):
        pvi = fp.PVI(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64), sched,
                     0.5, num_particles=16, clients_per_round=3, elbo_samples=0)
        runs[sched] = pvi.run(key(), pair.clients, 3, progress_bar=False)
    loop, other = runs["loop"], runs[schedule]
    assert np.all(np.asarray(loop.history["messages_up"]) == 3)
    assert np.isnan(loop.history["free_energy"]).sum() == 3 * 2
    if schedule == "synchronous":
        for a, b in zip(loop.mean_and_cov(), other.mean_and_cov(), strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(np.isnan(loop.history["step"]),
                                      np.isnan(other.history["step"]))
    else:  # the same participants each round
        np.testing.assert_array_equal(np.isnan(loop.history["step"]),
                                      np.isnan(other.history["step"]))


def test_optim_local_step_lands_near_the_exact_posterior():
    """``solver="optim"``: every client's Adam runs at once on stacked parameters (a decaying
    step, so that little of the optimiser's noise stays in the factors)."""
    pair = models.linear()
    res = fp.PVI(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64), "synchronous",
                 solver="optim", optimizer=pyro.optim.ClippedAdam({"lr": 0.03, "lrd": 0.985}),
                 local_steps=400, num_particles=16,
                 conjugate=False, elbo_samples=0, line_search=False).run(
        key(), pair.clients, 2, progress_bar=False)
    exact_mean, exact_cov = models.exact_linear_posterior(*pair.arrays)
    mean, cov = res.mean_and_cov()
    sd = np.sqrt(np.diag(exact_cov))
    assert np.all(np.abs(mean.numpy() - exact_mean) < 0.1 * sd)
    assert np.all(np.abs(np.sqrt(np.diag(cov.numpy())) / sd - 1) < 0.1)


def test_resume_and_global_vi_on_arrays():
    pair = models.linear()
    guide = fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64)
    first = fp.PVI(pair.pyro, guide, elbo_samples=0).run(key(), pair.clients, 1,
                                                         progress_bar=False)
    again = fp.PVI(pair.pyro, guide, elbo_samples=0).run(key(), pair.clients, 1,
                                                         progress_bar=False, resume=first)
    pooled = fp.GlobalVI(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64),
                         elbo_samples=0).run(key(), pair.arrays)
    for a, b in zip(again.mean_and_cov(), pooled.mean_and_cov(), strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9)
    assert again.history["kl_change"][0] < 1e-20  # already at the fixed point


def test_float32_runs_in_float32_and_agrees_with_float64():
    pair = models.logistic(n=80, k=2)
    out = {}
    for dtype in (torch.float32, torch.float64):
        res = fp.PVI(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=dtype),
                     "synchronous", num_particles=16, elbo_samples=0).run(
            key(), pair.clients, 3, progress_bar=False)
        assert res.q.nat1.dtype == dtype and res.factors.prec.dtype == dtype
        out[dtype] = res.mean_and_cov()
    np.testing.assert_allclose(out[torch.float32][0].double().numpy(),
                               out[torch.float64][0].numpy(), atol=1e-4)


def test_importing_without_the_extra_names_it(monkeypatch):
    for name in [m for m in sys.modules if m == "fedppl.pyro" or m.startswith("fedppl.pyro.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyro", None)
    with pytest.raises(ImportError, match=r"pip install 'fedppl\[pyro\]'"):
        importlib.import_module("fedppl.pyro")


def test_optimizer_is_ignored_with_a_warning_by_the_natural_gradient_step():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp.PVI(models.linear_py, fp.PVIGuide(models.linear_py), optimizer=torch.optim.Adam)
    assert any("solver='optim'" in str(w.message) for w in caught)
    assert jax  # the NumPyro side is imported for the acceptance-rule comparison
    assert fedppl.pyro is fp


def test_the_bar_and_the_early_stop_line_are_the_cores(capsys):
    """The Pyro run shows the core's bar (finite values only) and, stopped by ``tol``, writes
    the core's one line that stays; with ``progress_bar=False`` nothing at all."""
    pair = models.linear()  # conjugate: round 1 lands on the fixed point, round 2 moves by ~0
    guide = fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64)
    res = fp.PVI(pair.pyro, guide, elbo_samples=0).run(key(), pair.clients, 5, tol=1e-12)
    err = capsys.readouterr().err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if "stopped after round" in ln]
    assert len(res.history["round"]) == 2 and len(lines) == 1, err[-500:]
    assert "stopped after round 2 of 5: kl_change" in lines[0] and "<= tol 1e-12" in lines[0]
    assert "kl_change=" in err and "nan" not in err.lower()
    fp.PVI(pair.pyro, guide, elbo_samples=0).run(key(), pair.clients, 5, tol=1e-12,
                                                 progress_bar=False)
    assert capsys.readouterr().err == ""
