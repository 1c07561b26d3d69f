"""Few-shot mixed-task study on scikit-learn's ``load_digits`` (8x8 images, 1797 samples).

Tasks on every image ``x`` (pixels scaled to [0, 1], 64 inputs) with digit ``d``:

* regression: ``(d - 4.5) / 2.87`` (the digit value, standardised);
* classification: ``d >= 5`` (binary, 0/1).

The two are correlated the way the paper's Dogcat construction is (a label and a noisy numeric
proxy of it). Clients: images are shuffled (seeded) and dealt out; each client gets ``shots``
regression images and ``shots`` other classification images, plus ``test_per_client`` held-out
images on which both tasks are scored. Settings follow the paper's few-shot grid
(10 shots/20 clients, 20/15, 50/10). The model: two latent GPs with RBF base kernels, each on
its own small tanh MLP feature map (64 -> 16 -> 4, one per latent GP as in the paper's
Eq. 1c), ``variant="network"`` (only the MLPs are global, kernels, W and noise are personal), as
in the paper's real-data protocol.

Round keys come from :class:`~fedppl.infer.multitask_gp.PFedMul` (pFed-St: its ``fold_in(key,
task)``). Metrics: accuracy, classification ECE (:func:`fedppl.metrics.classification_ece`),
regression MSE (on the standardised scale), and test accuracy per round (the convergence curve).

Example::

    >>> res = run("pfed-mul", shots=5, num_clients=2, rounds=2, seed=0)
    >>> len(res["acc_curve"]), 0.0 <= res["accuracy"] <= 1.0
    (2, True)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedppl import metrics
from fedppl.clients import Clients
from fedppl.infer.multitask_gp import PFedMul, predict_latent, probability, task_clients
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


def make_clients(shots: int, num_clients: int, seed: int = 0, test_per_client: int = 30
                 ) -> tuple[Clients, list]:
    """The clients' training rows ``(X, y, task)`` and per client test arrays
    ``(X, y_reg, y_cls)``."""
    X, yr, yc = load()
    need = num_clients * (2 * shots + test_per_client)
    if need > len(X):
        raise ValueError(f"{num_clients} clients x ({2 * shots} shots + {test_per_client} test) "
                         f"needs {need} images, digits has {len(X)}")
    perm = np.random.default_rng(seed).permutation(len(X))
    per_client, tests, pos = [], [], 0
    for _ in range(num_clients):
        r, k, te = (perm[pos:pos + shots], perm[pos + shots:pos + 2 * shots],
                    perm[pos + 2 * shots:pos + 2 * shots + test_per_client])
        pos += 2 * shots + test_per_client
        per_client.append(([X[r], X[k]], [yr[r], yc[k]]))
        tests.append((X[te], yr[te], yc[te]))
    return mogp.multitask_clients(per_client, mogp.MOGPSpec(KINDS)), tests


def _scores(feds, states, tests) -> dict:
    """``feds[i] = (method, clients, key)``: one multi-task model, or one model per task."""
    ys, ps, se = [], [], []
    for z, (X, yr, yc) in enumerate(tests):
        out = []
        for t in range(len(KINDS)):
            method, state = (feds[t][0], states[t]) if len(feds) > 1 else (feds[0][0], states[0])
            mean, var = predict_latent(method.spec, state.clients, jnp.asarray(X),
                                       0 if len(feds) > 1 else t)
            out.append((np.asarray(mean[z]), np.asarray(var[z])))
        se.append((out[0][0] - yr) ** 2)
        ys.append(yc)
        ps.append(np.clip(np.asarray(probability(*out[1])), 0.0, 1.0))
    y, p = np.concatenate(ys), np.concatenate(ps)
    return {"accuracy": metrics.accuracy(y, p), "ece": metrics.classification_ece(y, p),
            "mse": float(np.mean(np.concatenate(se)))}


def _hyper(spec, key):
    return mogp.init_hyper(spec, 64, key, hidden=HIDDEN, phi0=1.0, phi1=0.5,
                           W=jnp.eye(len(spec.kinds), spec.num_latent) + 0.5, noise=0.1)


def _federations(method: str, clients: Clients, seed: int, **settings) -> list:
    spec, key = mogp.MOGPSpec(KINDS, 2), jax.random.PRNGKey(seed)
    base = PFedMul(spec, _hyper(spec, jax.random.PRNGKey(seed)),
                   method="pfed-mul" if method == "pfed-st" else method, **settings)
    if method != "pfed-st":
        return [(base, clients, key)]
    feds = []
    for t, kind in enumerate(KINDS):
        spec_t = spec._replace(kinds=(kind,), num_latent=1)
        feds.append((base.single_task(t, _hyper(spec_t, jax.random.PRNGKey(seed))),
                     task_clients(clients, t), jax.random.fold_in(key, t)))
    return feds


def run(method: str = "pfed-mul", shots: int = 10, num_clients: int | None = None,
        rounds: int = 20, seed: int = 0, variant: str = "network", num_inducing: int = 10,
        server_lr: float = 0.02, fraction: float = 1.0, progress=None) -> dict:
    """One method on one few-shot setting; ``progress(round)`` is called after every round."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    num_clients = SETTINGS.get(shots, 10) if num_clients is None else num_clients
    clients, tests = make_clients(shots, num_clients, seed)
    feds = _federations(method, clients, seed, variant=variant, num_inducing=num_inducing,
                        fraction=fraction, server_optimizer=optax.adam(server_lr),
                        optimizer=optax.adam(0.02))
    states = [m.init(k, c) for m, c, k in feds]
    curve, secs = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        states = [m.update(s)[0] for (m, _, _), s in zip(feds, states, strict=True)]
        secs.append(time.perf_counter() - t0)
        curve.append(_scores(feds, states, tests)["accuracy"])
        if progress is not None:
            progress(r)
    res = {"method": method, "shots": shots, "clients": num_clients, "seed": seed,
           "rounds": rounds, "acc_curve": curve,
           "seconds_per_round": float(np.median(secs[1:] if rounds > 1 else secs))}
    res.update(_scores(feds, states, tests))
    return res
