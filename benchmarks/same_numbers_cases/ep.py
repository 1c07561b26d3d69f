"""Federated EP on a small logistic regression (4 clients, NUTS tilted distributions with few
draws): Stein's and the sample estimator, synchronous and sequential. :func:`numbers` gives q
and the history of each."""

from __future__ import annotations

import numpy as np

HISTORY = ("elbo", "free_energy", "kl_change", "bytes_up", "bytes_down", "messages_up")
# name: (schedule, estimator)
CASES = {"stein-synchronous": ("synchronous", "stein"),
         "sample-synchronous": ("synchronous", "sample"),
         "stein-sequential": ("sequential", "stein")}


def numbers() -> dict:
    import jax
    import jax.numpy as jnp

    import fedppl
    from fedppl.guides import PVIGuide
    from fedppl.models import logistic_regression

    X = jax.random.normal(jax.random.PRNGKey(0), (160, 3))
    w = jnp.array([1.0, -0.5, 0.3])
    y = (jax.random.uniform(jax.random.PRNGKey(2), (160,)) < jax.nn.sigmoid(X @ w)) * 1.0
    clients = fedppl.partition.homogeneous(np.asarray(X), np.asarray(y), num_clients=4, seed=0)
    out = {}
    for name, (schedule, estimator) in CASES.items():
        guide = PVIGuide(logistic_regression, family="fullrank")
        ep = fedppl.EP(logistic_regression, guide, schedule, estimator=estimator,
                       num_warmup=50, num_samples=100, num_chains=2)
        r = ep.run(jax.random.PRNGKey(7), clients, 2, progress_bar=False)
        out[name] = {"q": [np.asarray(x) for x in (r.q.nat1, r.q.prec)],
                     **{h: np.asarray(r.history[h], float) for h in HISTORY
                        if h in r.history}}
    return out
