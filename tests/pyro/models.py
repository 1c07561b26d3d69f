"""Each test model written twice, once per PPL, on the same data and the same split.

A :class:`Pair` holds the NumPyro model, the Pyro model, the data and the clients; the parity
tests run the NumPyro core on ``pair.numpyro`` and the Pyro port on ``pair.pyro`` and compare.
The two versions of a model differ only in their PPL's spelling (``numpyro.sample`` /
``pyro.sample``, ``dist`` from each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import numpyro
import numpyro.distributions as nd
import pyro
import pyro.distributions as pd

import fedppl

NOISE = 0.5
TAU, SIGMA = 0.5, 0.3


class Pair(NamedTuple):
    numpyro: Callable
    pyro: Callable
    arrays: tuple
    clients: fedppl.Clients
    kwargs: dict = {}  # noqa: RUF012 - a NamedTuple field default, never mutated


# -- Bayesian linear regression (known noise): the exact posterior is in closed form ---------------


def linear_np(X, y=None):
    w = numpyro.sample("w", nd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Normal(X @ w, NOISE), obs=y)


def linear_py(X, y=None):
    w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Normal(X @ w, NOISE), obs=y)


def exact_linear_posterior(X, y):
    prec = np.eye(X.shape[1]) + X.T @ X / NOISE**2
    cov = np.linalg.inv(prec)
    return cov @ X.T @ y / NOISE**2, cov


def linear() -> Pair:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + NOISE * rng.normal(size=120)
    clients = fedppl.partition.by_feature(X, y, 7, feature=0, sizes=[3, 40, 7, 25, 11, 19, 15])
    return Pair(linear_np, linear_py, (X, y), clients)


# -- logistic regression ---------------------------------------------------------------------------


def logistic_np(X, y=None):
    w = numpyro.sample("w", nd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", nd.Normal(0.0, 2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Bernoulli(logits=X @ w + b), obs=y)


def logistic_py(X, y=None):
    w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = pyro.sample("b", pd.Normal(0.0, 2.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Bernoulli(logits=X @ w + b), obs=y)


def logistic(n=200, k=5) -> Pair:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(n, 3))
    logits = X @ np.array([1.5, -1.0, 0.5]) + 0.3
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(float)
    return Pair(logistic_np, logistic_py, (X, y), fedppl.partition.by_feature(X, y, k, feature=0))


# -- a non-Gaussian, dependent prior: w ~ Normal(mu, tau), tau ~ HalfCauchy -----------------------


def hierarchical_np(X, y=None):
    mu = numpyro.sample("mu", nd.Normal(0.0, 2.0))
    tau = numpyro.sample("tau", nd.HalfCauchy(1.0))
    w = numpyro.sample("w", nd.Normal(mu, tau).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Normal(X @ w, 0.6), obs=y)


def hierarchical_py(X, y=None):
    mu = pyro.sample("mu", pd.Normal(0.0, 2.0))
    tau = pyro.sample("tau", pd.HalfCauchy(1.0))
    w = pyro.sample("w", pd.Normal(mu, tau).expand([X.shape[1]]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Normal(X @ w, 0.6), obs=y)


def hierarchical() -> Pair:
    rng = np.random.default_rng(3)
    n, d = 150, 3
    X = rng.normal(size=(n, d)) + np.linspace(-1, 1, n)[:, None] * 0.5
    y = X @ np.linspace(0.8, -0.5, d) + 0.6 * rng.standard_t(5, size=n)
    order = np.argsort(X[:, 0], kind="stable")
    parts = np.array_split(order, 4)
    return Pair(hierarchical_np, hierarchical_py, (X, y),
                fedppl.Clients.from_list([(X[p], y[p]) for p in parts]))


# -- local latent variables: one logistic intercept per client around a global mean -------------


def intercepts_np(X, gid, y=None, *, n_groups):
    mu = numpyro.sample("mu", nd.Normal(0.0, 2.0))
    w = numpyro.sample("w", nd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", nd.Normal(mu, TAU))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Bernoulli(logits=X @ w + a[gid]), obs=y)


def intercepts_py(X, gid, y=None, *, n_groups):
    mu = pyro.sample("mu", pd.Normal(0.0, 2.0))
    w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with pyro.plate("groups", n_groups):
        a = pyro.sample("a", pd.Normal(mu, TAU))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Bernoulli(logits=X @ w + a[gid]), obs=y)


def intercepts(K=3, D=2) -> Pair:
    rng = np.random.default_rng(0)
    parts = []
    for k in range(K):
        n = 40 + 20 * k
        X = rng.normal(size=(n, D)) + 0.3 * k
        f = X @ np.linspace(0.5, -1.0, D) + 0.8 + TAU * rng.normal()
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-f))).astype(float)
        parts.append((X, np.zeros(n, int), y))
    X = np.concatenate([p[0] for p in parts])
    return Pair(intercepts_np, intercepts_py, (X,), fedppl.Clients.from_list(parts),
                {"n_groups": 1})


# -- a model with a constrained global site, for the cavity messenger ------------------------------


def scale_np(X, y=None):
    w = numpyro.sample("w", nd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", nd.Normal(0.0, 2.0))
    s = numpyro.sample("s", nd.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Normal(X @ w + b, s), obs=y)


def scale_py(X, y=None):
    w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = pyro.sample("b", pd.Normal(0.0, 2.0))
    s = pyro.sample("s", pd.HalfNormal(1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Normal(X @ w + b, s), obs=y)


def scale() -> Pair:
    rng = np.random.default_rng(4)
    X = rng.normal(size=(30, 2))
    y = X @ np.array([0.7, -0.3]) + 0.2 + 0.4 * rng.normal(size=30)
    return Pair(scale_np, scale_py, (X, y), fedppl.partition.homogeneous(X, y, 3, seed=0))
