"""pFed-Mul on a small multi-task problem (CAVI and Gaussian VI, every variant, client sampling,
a deeper network, the single-task pFed-St): :func:`numbers` gives the server's and every
client's hyperparameters, q, inducing points and local variables, and the ELBO history."""

from __future__ import annotations

import numpy as np

KINDS = ("regression", "classification")
SIZES = ((12, 10), (8, 14), (10, 10))

# name: (settings, rounds)
CASES = {
    "cavi-all": (dict(variant="all"), 3),
    "cavi-all-loop": (dict(variant="all", schedule="loop"), 3),
    "cavi-kernel-sampled": (dict(variant="kernel", local_steps=2, fraction=0.67), 4),
    "cavi-network-deep": (dict(variant="network", hidden=(3,)), 3),
    "gvi-all": (dict(method="gaussian-vi", variant="all"), 3),
    "gvi-kernel+W-sampled": (dict(method="gaussian-vi", variant="kernel+W", local_steps=2,
                                  fraction=0.5), 3),
    "pfed-st-classification": (dict(variant="all", single_task=1), 3),
}


def problem():
    rng = np.random.default_rng(0)
    per_client = []
    for n_reg, n_cls in SIZES:
        xr, xc = rng.uniform(0, 10, (n_reg, 1)), rng.uniform(0, 10, (n_cls, 1))
        yr = np.sin(xr[:, 0]) + 0.2 * rng.normal(size=n_reg)
        yc = (rng.uniform(size=n_cls) < 1 / (1 + np.exp(-2 * np.sin(xc[:, 0])))).astype(float)
        per_client.append(([xr, xc], [yr, yc]))
    return per_client


def _hyper(mogp, spec, hidden, single_task):
    import jax
    import jax.numpy as jnp

    if single_task is not None:
        return mogp.init_hyper(spec, 1, phi0=1.0, phi1=0.5, W=jnp.ones((1, 1)), noise=0.1)
    return mogp.init_hyper(spec, 1, jax.random.PRNGKey(3), hidden=hidden, phi0=[1.0, 0.5],
                           phi1=[0.5, 2.0], W=jnp.array([[0.8, 0.3], [0.6, -0.4]]), noise=0.1)


def _flat(tree) -> np.ndarray:
    import jax

    return np.concatenate([np.ravel(np.asarray(x, float)) for x in jax.tree_util.tree_leaves(tree)])


def _flat_hyper(hyper) -> np.ndarray:
    """Theta as one vector, the network as ``(weight (in, out), bias)`` pairs (the old layout;
    an equinox ``Linear`` stores its weight as ``(out, in)``)."""
    layers = getattr(hyper.net, "layers", None)
    net = hyper.net if layers is None else tuple((l.weight.T, l.bias) for l in layers)
    return _flat(hyper._replace(net=net))


def _client_arrays(st, n: int) -> list[np.ndarray]:
    return [_flat_hyper(st.hyper), np.asarray(st.q.mean), np.asarray(st.q.cov),
            np.asarray(st.Z), np.asarray(st.c)[:n]]


def run_new(settings: dict, rounds: int) -> dict:
    import jax

    import fedppl
    from fedppl.infer.multitask_gp import task_clients
    from fedppl.models import mogp

    s = dict(settings)
    task, hidden = s.pop("single_task", None), s.pop("hidden", ())
    spec = mogp.MOGPSpec(KINDS, 2)
    clients = mogp.multitask_clients(problem(), spec)
    method = fedppl.PFedMul(spec, _hyper(mogp, spec, hidden, None), num_inducing=6, **s)
    if task is not None:
        spec1 = spec._replace(kinds=(KINDS[task],), num_latent=1)
        method = method.single_task(task, _hyper(mogp, spec1, hidden, task))
        clients = task_clients(clients, task)
    r = method.run(jax.random.PRNGKey(11), clients, rounds, progress_bar=False)
    sizes = clients.sizes
    states = [jax.tree_util.tree_map(lambda x, k=k: x[k], r.clients) for k in range(len(sizes))]
    active = [np.flatnonzero(np.isfinite(e)).tolist() for e in r.history["client_elbo"]]
    return {"server": _flat_hyper(r.hyper),
            "clients": [_client_arrays(st, int(n)) for st, n in zip(states, sizes, strict=True)],
            "elbo": np.asarray(r.history["elbo"], float), "accepted": active,
            "rounds": np.asarray(r.history["round"]).tolist()}


def numbers() -> dict:
    return {name: run_new(dict(settings), rounds) for name, (settings, rounds) in CASES.items()}
