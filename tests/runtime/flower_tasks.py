"""Small federated tasks that the Flower tests run on both engines and on the embedded runtime.

``task(run_config)`` builds the method and the data from the run config alone (``method``: one of
:data:`TASKS`), as every Flower process must; ``embedded(name)`` runs the same method on the
embedded runtime and returns its last server state, for the equality tests.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np

import fedppl
from fedppl.models import linear_regression
from fedppl.runtime.embedded import recording
from fedppl.runtime.faults import _CORRUPT as CORRUPTIONS
from fedppl.runtime.faults import corrupt
from fedppl.runtime.flower import Task

TASKS = ("pvi-synchronous", "pvi-sequential", "fsgp", "fedbnr", "sgp-dpo", "pfedmul",
         "smc", "check")
ROUNDS = 3


def _data(name: str):
    if name.startswith("pvi") or name in ("smc", "check"):
        rng = np.random.default_rng(0)
        X = rng.normal(size=(90, 2))
        y = X @ np.array([1.0, -0.5]) + rng.normal(size=90)
        return fedppl.partition.homogeneous(X, y, num_clients=3, seed=0), {}
    if name in ("fsgp", "sgp-dpo"):
        rng = np.random.default_rng(0)
        X = rng.uniform(-2, 2, (60, 1))
        return fedppl.partition.homogeneous(X, np.sin(2 * X[:, 0]), num_clients=3, seed=0), {}
    if name == "pfedmul":
        from fedppl.models import mogp

        rng = np.random.default_rng(0)

        def one(n):
            x = rng.uniform(0, 5, (n, 1))
            return [x, x], [np.sin(x[:, 0]), (np.sin(x[:, 0]) > 0).astype(float)]

        return mogp.multitask_clients([one(10), one(12), one(11)], _MOGP), {}
    X = np.linspace(-3, 3, 60)[:, None]
    clients = fedppl.partition.homogeneous(X, np.sin(X[:, 0]), num_clients=3, seed=0)
    return clients, {"validation": (X[::7], np.sin(X[::7, 0]))}


def _mogp_spec():
    from fedppl.models import mogp

    return mogp.MOGPSpec(("regression", "classification"), num_latent=1)


_MOGP = _mogp_spec()


def _method(name: str):
    if name == "smc":  # the sampler from the prior, a few particles in two islands
        clients, _ = _data(name)
        guide = fedppl.PVIGuide(linear_regression).setup(*clients.client(0))
        return fedppl.SMC(linear_regression, guide, guide.prior, num_particles=100, islands=2)
    if name == "check":  # the check and its refinement (importance rounds) from the prior
        clients, _ = _data(name)
        guide = fedppl.PVIGuide(linear_regression).setup(*clients.client(0))
        return fedppl.Importance(linear_regression, guide, guide.prior, num_draws=200)
    if name.startswith("pvi"):
        return fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression),
                          schedule=name.split("-")[1])
    if name == "fsgp":
        return fedppl.FSGP(num_inducing=5, local_steps=5, init_inducing="random-normal")
    if name == "sgp-dpo":
        return fedppl.FederatedSGP("dpo", num_inducing=5, local_steps=5, pseudo_init="prior")
    if name == "pfedmul":
        from fedppl.models import mogp

        return fedppl.PFedMul(_MOGP, mogp.init_hyper(_MOGP, 1, W=np.ones((2, 1))),
                              num_inducing=5)
    from fedppl.models.random_features import URKSpec

    spec = URKSpec(input_dim=1, feature_widths=(), shift_widths=(), num_samples=10)
    return fedppl.FedBNR(spec, kernel="avg", local_steps=3, eval_every=1)


def task(run_config: dict[str, Any]) -> Task:
    """The Flower task named by ``run_config["method"]``; ``faults`` (``"1:2:crash 2:2:nan"``:
    partition, round, kind: a node's fault, or a corruption of its message from
    :mod:`fedppl.runtime.faults`) injects faults; ``line-search`` (default: PVI's own default,
    the adaptive line search on a deployment; false: off) is PVI's option."""
    jax.config.update("jax_enable_x64", True)
    name = str(run_config["method"])
    clients, run_kwargs = _data(name)
    method = _method(name)
    if name.startswith("pvi") and not run_config.get("line-search", True):
        method.line_search = False
    faults = {}
    for item in str(run_config.get("faults", "")).split():
        k, r, kind = item.split(":")
        faults[(int(k), int(r))] = (partial(corrupt, kind=kind) if kind in CORRUPTIONS
                                    else kind)
    return Task(method, clients.client, clients.num_clients,
                int(run_config.get("rounds", 0)) or ROUNDS, run_kwargs=run_kwargs,
                round_timeout=run_config.get("round-timeout") or None,
                fault=(lambda k, r: faults.get((k, r))) if faults else None)


def embedded(name: str, rounds: int = ROUNDS, absent: dict | None = None,
             line_search: bool | None = None) -> tuple[Any, list[np.ndarray]]:
    """The result, and the leaves of the last server state, of the embedded runtime on the same
    task (its rounds recorded through ``run``'s ``runtime`` argument), with PVI's line search as
    on a deployment unless given (its default there: the adaptive one); ``absent[r]``: clients
    that sit round ``r`` out."""
    clients, run_kwargs = _data(name)
    method, last = _method(name), {}
    if name.startswith("pvi"):
        method.line_search = "adaptive" if line_search is None else line_search
    if absent:
        method = Absent(method, absent)

    result = method.run(jax.random.key(0), clients, rounds, progress_bar=False,
                        runtime=recording(last), **run_kwargs)
    return result, [np.asarray(x) for x in jax.tree_util.tree_leaves(last["server"])]


def Absent(method, absent: dict[int, list[int]]):
    """``method`` whose clients ``absent[r]`` sit round ``r`` out (the others all take part)."""

    class Absent(type(method)):
        def _round_inputs(self, state):
            rng_key, keys, active, server_key, spare = super()._round_inputs(state)
            active = np.ones(state.masks.shape[0], bool)
            active[absent.get(state.round + 1, [])] = False
            return rng_key, keys, jax.numpy.asarray(active), server_key, spare

    method.__class__ = Absent
    return method


def secagg_statistics(k: int):
    """Partition k's sufficient statistics of the PVI tasks' regression (features and a bias):
    what an exact method's server needs only the sum of."""
    from fedppl.algorithms import exact

    clients, _ = _data("pvi-synchronous")
    X, y = clients.client(k)
    return exact.client_stats(np.hstack([X, np.ones((len(X), 1))]), y)


SECURE_SCALE = 1e3  # a public bound on every entry of the clients' summands in these tasks


def secure_task(run_config: dict[str, Any]) -> Task:
    """:func:`task` with secure aggregation inside its rounds (``Task.secure``)."""
    from fedppl.runtime.secagg import SecureSum

    return task(run_config)._replace(secure=SecureSum(SECURE_SCALE))
