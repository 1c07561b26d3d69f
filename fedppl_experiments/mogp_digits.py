"""Few-shot mixed-task study on scikit-learn's ``load_digits`` (8x8 images, 1797 samples).

Tasks on every image ``x`` (pixels scaled to [0, 1], 64 inputs) with digit ``d``:

* regression: ``(d - 4.5) / 2.87`` (the digit value, standardised);
* classification: ``d >= 5`` (binary, 0/1).

The two are correlated the way the paper's Dogcat construction is (a label and a noisy numeric
proxy of it). Clients: images are shuffled (seeded) and dealt out; each client gets ``shots``
regression images and ``shots`` other classification images, plus ``test_per_client`` held-out
images on which both tasks are scored. Settings follow the paper's few-shot grid
(10 shots/20 clients, 20/15, 50/10). The model: two latent GPs with RBF base kernels on a small
tanh MLP feature map (64 -> 16 -> 4), ``variant="network"`` (only the MLP is global, kernels, W
and noise are personal), as in the paper's real-data protocol.

Metrics: accuracy, classification ECE (:func:`fedppl.metrics.classification_ece`), regression
MSE (on the standardised scale), and test accuracy per round (the convergence curve).

Example::

    >>> res = run("pfed-mul", shots=10, rounds=20, seed=0)
    >>> res["accuracy"], res["mse"], res["ece"], res["acc_curve"]
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from fedppl import metrics
from fedppl.algorithms import pfedmul as pm
from fedppl.models import mogp

__all__ = ["SETTINGS", "load", "make_clients", "run", "METHODS"]

SETTINGS = {10: 20, 20: 15, 50: 10}  # shots -> clients (paper's few-shot grid)
KINDS = ("regression", "classification")
METHODS = ("pfed-mul", "pfed-st", "gaussian-vi")
HIDDEN = (16, 4)


def load() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs (N, 64) in [0, 1], regression targets, binary labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    digit = d.target.astype(float)
    return d.data / 16.0, (digit - 4.5) / 2.87, (digit >= 5).astype(float)


def make_clients(shots: int, num_clients: int, seed: int = 0, test_per_client: int = 30):
    """Per client: training ``Data`` and test arrays ``(X, y_reg, y_cls)``."""
    X, yr, yc = load()
    need = num_clients * (2 * shots + test_per_client)
    if need > len(X):
        raise ValueError(f"{num_clients} clients x ({2 * shots} shots + {test_per_client} test) "
                         f"needs {need} images, digits has {len(X)}")
    perm = np.random.default_rng(seed).permutation(len(X))
    spec, datas, tests, pos = mogp.MOGPSpec(KINDS), [], [], 0
    for c in range(num_clients):
        r, k, te = (perm[pos:pos + shots], perm[pos + shots:pos + 2 * shots],
                    perm[pos + 2 * shots:pos + 2 * shots + test_per_client])
        pos += 2 * shots + test_per_client
        datas.append(mogp.client_data([X[r], X[k]], [yr[r], yc[k]], spec, client=c))
        tests.append((X[te], yr[te], yc[te]))
    return datas, tests


def _prob(m, v, order: int = 20):
    x, w = np.polynomial.hermite_e.hermegauss(order)
    f = np.asarray(m)[:, None] + np.sqrt(np.asarray(v))[:, None] * x[None]
    return (1 / (1 + np.exp(-f))) @ w / np.sqrt(2 * np.pi)


def _predict(models, X):
    """``models[t] = (spec, state, task_index)`` -> regression mean and class probability."""
    out = []
    for spec, st, t in models:
        m, v = mogp.predict(spec, st.hyper, st.Z, st.q, jnp.asarray(X), t)
        out.append((np.asarray(m), np.asarray(v)))
    return out[0][0], _prob(*out[1])


def _scores(per_client_models, tests):
    ys, ps, se = [], [], []
    for models, (X, yr, yc) in zip(per_client_models, tests):
        mean, prob = _predict(models, X)
        se.append((mean - yr) ** 2)
        ys.append(yc)
        ps.append(np.clip(prob, 0.0, 1.0))
    y, p = np.concatenate(ys), np.concatenate(ps)
    return {"accuracy": metrics.accuracy(y, p), "ece": metrics.classification_ece(y, p),
            "mse": float(np.mean(np.concatenate(se)))}


def _hyper(spec, key):
    return mogp.init_hyper(spec, 64, key, hidden=HIDDEN, phi0=1.0, phi1=0.5,
                           W=jnp.eye(len(spec.kinds), spec.num_latent) + 0.5, noise=0.1)


def run(method: str = "pfed-mul", shots: int = 10, num_clients: int | None = None,
        rounds: int = 20, seed: int = 0, variant: str = "network", num_inducing: int = 10,
        server_lr: float = 0.02, fraction: float = 1.0, progress=None) -> dict:
    """One method on one few-shot setting; ``progress(round)`` is called after every round."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    num_clients = SETTINGS.get(shots, 10) if num_clients is None else num_clients
    datas, tests = make_clients(shots, num_clients, seed)
    base = pm.Config(spec=mogp.MOGPSpec(KINDS, 2), method="pfed-mul" if method == "pfed-st"
                     else method, variant=variant, server_lr=server_lr, local_lr=0.02,
                     num_inducing=num_inducing, fraction=fraction)
    key = jax.random.PRNGKey(seed)
    if method == "pfed-st":
        feds = []
        for t in range(len(KINDS)):
            cfg = pm.single_task_config(base, t)
            td = [pm.task_data(d, t) for d in datas]
            h = _hyper(cfg.spec, jax.random.PRNGKey(seed))
            feds.append((cfg, td, *pm.init(cfg, h, td, jax.random.fold_in(key, t))))
    else:
        h = _hyper(base.spec, jax.random.PRNGKey(seed))
        feds = [(base, datas, *pm.init(base, h, datas, key))]
    curve, secs = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        for i, (cfg, td, server, clients) in enumerate(feds):
            server, clients, _ = pm.run_round(cfg, server, clients, td,
                                              jax.random.fold_in(key, 1000 * i + r))
            feds[i] = (cfg, td, server, clients)
        jax.block_until_ready(feds[-1][2].hyper)
        secs.append(time.perf_counter() - t0)
        models = [[(f[0].spec, f[3][z], 0 if len(feds) > 1 else t)
                   for t, f in enumerate(feds if len(feds) > 1 else feds * 2)]
                  for z in range(num_clients)]
        curve.append(_scores(models, tests)["accuracy"])
        if progress is not None:
            progress(r)
    res = {"method": method, "shots": shots, "clients": num_clients, "seed": seed,
           "rounds": rounds, "acc_curve": curve,
           "seconds_per_round": float(np.median(secs[1:] if rounds > 1 else secs))}
    res.update(_scores(models, tests))
    return res
