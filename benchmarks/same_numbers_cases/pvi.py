"""PVI and GlobalVI on small problems: conjugate BLR, logistic regression with the
natural-gradient solver in every schedule, a HalfNormal prior refined by the server, a model with
local sites, client sampling, GlobalVI. :func:`numbers` gives q and the history of each."""

from __future__ import annotations

import numpy as np


def cases():
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    import fedppl
    from fedppl.guides import PVIGuide
    from fedppl.models import linear_regression, logistic_regression

    key = jax.random.PRNGKey(0)
    X = jax.random.normal(key, (240, 4))
    w = jnp.array([1.0, -0.5, 0.3, 0.0])
    y_lin = X @ w + 0.5 * jax.random.normal(jax.random.PRNGKey(1), (240,))
    y_bin = (jax.random.uniform(jax.random.PRNGKey(2), (240,)) < jax.nn.sigmoid(X @ w)) * 1.0
    lin = fedppl.partition.homogeneous(np.asarray(X), np.asarray(y_lin), num_clients=4, seed=0)
    log = fedppl.partition.homogeneous(np.asarray(X), np.asarray(y_bin), num_clients=4, seed=0)

    def scale_model(X, y=None):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        b = numpyro.sample("b", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ b, s), obs=y)

    g = np.repeat(np.arange(6), 40)

    def groups_model(X, g, y=None, n_groups=6):
        b = numpyro.sample("b", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("groups", n_groups):
            z = numpyro.sample("z", dist.Normal(0, 1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ b + z[g]), obs=y)

    grp = fedppl.Clients.from_list([(np.asarray(X[i::3]), g[i::3] % 6, np.asarray(y_bin[i::3]))
                                    for i in range(3)])
    k = jax.random.PRNGKey(7)
    small = dict(local_steps=30, num_particles=32, elbo_samples=16)
    out = {}
    out["blr-sync"] = fedppl.PVI(linear_regression, PVIGuide(linear_regression, family="fullrank"),
                                 "synchronous").run(k, lin, 3, progress_bar=False)
    for schedule in ("sequential", "synchronous", "loop"):
        out[f"logistic-{schedule}"] = fedppl.PVI(
            logistic_regression, PVIGuide(logistic_regression), schedule, 0.5,
            **small).run(k, log, 3, progress_bar=False)
    for schedule in ("sequential", "synchronous"):
        out[f"halfnormal-{schedule}"] = fedppl.PVI(
            scale_model, PVIGuide(scale_model), schedule, **small).run(k, lin, 3,
                                                                       progress_bar=False)
    out["local-sites"] = fedppl.PVI(
        groups_model, PVIGuide(groups_model, local_sites=["z"]), "synchronous",
        **small).run(k, grp, 2, progress_bar=False, n_groups=6)
    out["client-sampling"] = fedppl.PVI(
        logistic_regression, PVIGuide(logistic_regression), "synchronous", 0.5,
        clients_per_round=2, **small).run(k, log, 3, progress_bar=False)
    out["global-vi"] = fedppl.GlobalVI(logistic_regression, PVIGuide(logistic_regression),
                                       num_steps=50, num_particles=32,
                                       elbo_samples=16).run(k, log)
    keys = ("elbo", "free_energy", "kl_change", "bytes_up", "bytes_down", "messages_up")
    return {name: {"q": [np.asarray(x) for x in (r.q.nat1, r.q.prec)],
                   **{h: np.asarray(r.history[h], float) for h in keys}}
            for name, r in out.items()}


def numbers() -> dict:
    return cases()
