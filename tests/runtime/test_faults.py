"""The server's acceptance rule against dropouts and corrupted messages (fedppl.runtime.faults):
for 1,000 rounds with 30% of the messages lost and 5% corrupted (NaN, inf, entries of 1e12, an
improper q), the server's state stays finite and positive definite in every round, every
corrupted message is refused and recorded with its reason, and the posterior is the clean run's.
"""

from __future__ import annotations

import warnings
from collections import Counter

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedppl
from fedppl.algorithms import pvi as pvi_algorithm
from fedppl.families import gaussian as g
from fedppl.models import linear_regression
from fedppl.runtime.faults import Faults

REASONS = {"nan": pvi_algorithm.REFUSALS[pvi_algorithm.NOT_FINITE],
           "inf": pvi_algorithm.REFUSALS[pvi_algorithm.NOT_FINITE],
           "huge": pvi_algorithm.REFUSALS[pvi_algorithm.IMPLAUSIBLE],
           "improper": pvi_algorithm.REFUSALS[pvi_algorithm.NOT_PD],
           "dropped": pvi_algorithm.REFUSALS[pvi_algorithm.NOT_RECEIVED]}


class Watched(Faults):
    """Faults that also check the server's state after every round."""

    def __call__(self, trio, schedule):
        inner = super().__call__(trio, schedule)
        self.sound: list[bool] = []

        def round_fn(*args):
            out = inner(*args)
            q = out[0].q
            self.sound.append(bool(g.is_finite(q)) and bool(g.is_pd(q)))
            return out

        return round_fn


@pytest.fixture(scope="module")
def diabetes():
    """scikit-learn's diabetes data: 10 standardised features and a bias, D = 11, 10 clients."""
    from sklearn.datasets import load_diabetes
    from sklearn.preprocessing import StandardScaler

    X, y = load_diabetes(return_X_y=True)
    X = np.hstack([StandardScaler().fit_transform(X), np.ones((len(X), 1))])
    return fedppl.partition.homogeneous(X, (y - y.mean()) / y.std(), num_clients=10, seed=0)


def _pvi(schedule, **kwargs):
    return fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression, family="fullrank"),
                      schedule, 0.5, elbo_samples=0, line_search=False, **kwargs)


def _run(method, clients, rounds, runtime, seed=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one warning per refused message
        return method.run(jax.random.key(seed), clients, rounds, progress_bar=False,
                          runtime=runtime)


def _gap(result, reference):
    m, c = result.mean_and_cov()
    m0, c0 = reference.mean_and_cov()
    sd, sd0 = np.sqrt(np.diag(c)), np.sqrt(np.diag(c0))
    return float(np.max(np.abs(m - m0) / sd0)), float(np.max(np.abs(sd / sd0 - 1)))


def _clean(method, clients, rounds):
    """The run without faults, through the same compiled round (a fault-free plan)."""
    return _run(method, clients, rounds, Faults())


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_thousand_faulty_rounds_leave_the_clean_posterior(diabetes, schedule):
    method = _pvi(schedule)
    clean = _clean(method, diabetes, 200)  # converged: damping 0.5 halves the gap each round
    faults = Watched(dropout=0.3, corrupt=0.05, seed=3)
    result = _run(method, diabetes, 1000, faults)
    assert all(faults.sound) and len(faults.sound) == 1000
    mean_gap, sd_gap = _gap(result, clean)
    assert mean_gap < 1e-8 and sd_gap < 1e-8, (mean_gap, sd_gap)
    # every fault is in the record, with its reason, and nothing else is
    kinds = Counter(f for _, _, f in faults.events)
    assert kinds["dropped"] > 2500 and all(kinds[k] > 40 for k in ("nan", "inf", "huge",
                                                                    "improper"))
    expected = sorted((r, diabetes.names[k], REASONS[f]) for r, k, f in faults.events)
    assert sorted(result.rejected) == expected


def test_without_the_divergence_bound_a_huge_message_wrecks_the_posterior(diabetes):
    """The same faults (entries of 1e12 only) with the bound lifted: accepted, they leave the
    server's q apart from the clients' factors for good; with it, the run is the clean one."""
    clean = _clean(_pvi("synchronous"), diabetes, 200)
    gaps = {}
    for bound in (np.inf, pvi_algorithm.MAX_DIVERGENCE):
        method = _pvi("synchronous", max_divergence=bound)
        faults = Faults(dropout=0.3, corrupt=0.05, kinds=("huge",), seed=3)
        gaps[bound] = _gap(_run(method, diabetes, 300, faults), clean)
    assert min(gaps[np.inf]) > 0.1, gaps
    assert max(gaps[pvi_algorithm.MAX_DIVERGENCE]) < 1e-8, gaps


def _logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def test_breast_cancer_d31_with_faults_equals_the_clean_run():
    """No closed form: full-rank logistic regression on all 30 features and a bias (D = 31),
    natural-gradient local steps, the line search on. The solver's draws are fixed by the run's
    seed, so the clean run's answer has no Monte Carlo noise between rounds: the faulty run
    (whose clients miss a third of the rounds) must reach the same point, to the tolerance of
    30 damped rounds."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = np.hstack([StandardScaler().fit_transform(X), np.ones((len(X), 1))])
    clients = fedppl.partition.homogeneous(X, y.astype(float), num_clients=10, seed=0)

    method = fedppl.PVI(_logistic, fedppl.PVIGuide(_logistic, family="fullrank"), "synchronous",
                        0.7, elbo_samples=0)
    clean = _clean(method, clients, 30)
    faults = Watched(dropout=0.3, corrupt=0.05, seed=5)
    result = _run(method, clients, 30, faults)
    assert all(faults.sound)
    assert max(_gap(result, clean)) < 1e-3, _gap(result, clean)
    assert {f for _, _, f in faults.events} >= {"dropped", "nan", "huge"}


def test_faults_refuses_bad_settings():
    with pytest.raises(ValueError, match="dropout"):
        Faults(dropout=1.5)
    with pytest.raises(ValueError, match="kinds"):
        Faults(kinds=("nan", "gremlins"))
    method = _pvi("loop")
    with pytest.raises(ValueError, match="loop"):
        method.init(jax.random.key(0), fedppl.partition.homogeneous(
            np.ones((20, 2)), np.ones(20), num_clients=2, seed=0), runtime=Faults())
