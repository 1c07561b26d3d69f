"""Secure aggregation (Flower's SecAgg+) of what a server needs only the sum of: the exact
methods' sufficient statistics (FedBNR's last layer, FSGP's and the conjugate models' ``X'X``,
``X'y``), FedAvg's totals. The server learns the sum and nothing about any one client's
contribution (extra ``flower``).

A :class:`SumTask` names the statistics each node computes on its own partition;
:func:`secure_sum` runs the SecAgg+ protocol over them on Flower's Simulation Engine and
:func:`secure_sum_apps` gives the ServerApp and ClientApp for ``flwr run`` (the node's ClientApp
carries Flower's ``secaggplus_mod``: it masks the node's vector before it leaves; the server
unmasks only the total). SecAgg+ works on integers: each entry is divided by the task's public
``scale`` (every entry of every node's statistics must lie in ``[-scale, scale]``; a node whose
do not is refused by name rather than clipped) and quantised to ``2**22`` levels, so the sum is
exact to ``num_clients * scale / 2**21`` per entry.

Example (three nodes' ``X'X`` and ``X'y``; the statistics function must be importable by the
Simulation Engine's workers, as any ClientApp's code)::

    like = exact.Stats(jax.ShapeDtypeStruct((D, D), float), jax.ShapeDtypeStruct((D,), float),
                       jax.ShapeDtypeStruct((), float))
    task = SumTask(mypackage.stats_of_partition, like, num_clients=3, scale=1e3)
    total = secure_sum(task)          # an exact.Stats: the sum over the three nodes
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

try:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, parameters_to_ndarrays
    from flwr.server import ServerApp, ServerConfig
    from flwr.server.compat import LegacyContext
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("fedppl.runtime.secagg needs Flower: pip install 'fedppl[flower]'") from err

__all__ = ["SumTask", "secure_sum", "secure_sum_apps", "QUANTIZATION"]

#: SecAgg+'s quantisation levels over [-1, 1], after the values are scaled into that range.
QUANTIZATION = 2**22


class SumTask(NamedTuple):
    """``statistics(k)``: partition ``k``'s statistics (a pytree of float arrays, computed on the
    node that holds it); ``like``: their public structure (a pytree of the same shape, arrays or
    ``jax.ShapeDtypeStruct``, for the server to put the sum back into); ``num_clients`` nodes
    take part; ``scale``: a public bound on the statistics' entries."""

    statistics: Callable[[int], Any]
    like: Any
    num_clients: int
    scale: float = 1.0
    timeout: float | None = 120.0


class _Node(NumPyClient):
    def __init__(self, task: SumTask, partition: int):
        self.task, self.partition = task, partition

    def _leaves(self) -> list[np.ndarray]:
        stats = self.task.statistics(self.partition)
        leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(stats)]
        like = jax.tree_util.tree_leaves(self.task.like)
        if [x.shape for x in leaves] != [tuple(x.shape) for x in like]:
            raise ValueError(f"partition {self.partition}: statistics of shapes "
                             f"{[x.shape for x in leaves]}, the task expects "
                             f"{[tuple(x.shape) for x in like]}")
        for i, x in enumerate(leaves):
            if not np.all(np.isfinite(x)):
                raise ValueError(f"partition {self.partition}: statistics leaf {i} is not finite")
            if np.any(np.abs(x) > self.task.scale):
                raise ValueError(f"partition {self.partition}: statistics leaf {i} reaches "
                                 f"{np.max(np.abs(x)):.4g}, beyond the task's scale "
                                 f"{self.task.scale:g}; raise the scale")
        return leaves

    def get_parameters(self, config):  # the sizes, for the server's start
        return [np.zeros(x.size) for x in self._leaves()]

    def fit(self, parameters, config):
        # sent flat: SecAgg+'s unmasking leaves a 0-d array's offset and ratio unapplied
        return [np.ravel(x) / self.task.scale for x in self._leaves()], 1, {}


class _Sum(FedAvg):
    """FedAvg over weight-1 contributions: SecAgg+ hands it the mean; it keeps the sum."""

    def __init__(self, num_clients: int):
        super().__init__(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=num_clients,
                         min_available_clients=num_clients)
        self.total: list[np.ndarray] | None = None
        self.count = 0

    def aggregate_fit(self, server_round, results, failures):
        if results:  # every result carries the same (mean) parameters after unmasking
            self.count = len(results)
            mean = parameters_to_ndarrays(results[0][1].parameters)
            self.total = [m * self.count for m in mean]
        return super().aggregate_fit(server_round, results, failures)


def secure_sum_apps(task: SumTask, done: Callable[[list[np.ndarray], int], None] | None = None
                    ) -> tuple[ServerApp, ClientApp]:
    """The ServerApp (one SecAgg+ round; ``done(total, count)`` receives the sum and how many
    nodes it covers) and the ClientApp (with ``secaggplus_mod``)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context: Context) -> None:
        strategy = _Sum(task.num_clients)
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=1), strategy=strategy)
        workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
            num_shares=task.num_clients, reconstruction_threshold=max(2, task.num_clients - 1)
            if task.num_clients > 2 else 1.0, max_weight=1.0, clipping_range=1.0,
            quantization_range=QUANTIZATION, timeout=task.timeout))
        workflow(grid, legacy)
        if strategy.total is None:
            raise RuntimeError("secure aggregation did not finish (too few nodes answered)")
        if done is not None:
            done([t * task.scale for t in strategy.total], strategy.count)

    def client_fn(context: Context):
        return _Node(task, int(context.node_config["partition-id"])).to_client()

    return server_app, ClientApp(client_fn=client_fn, mods=[secaggplus_mod])


def secure_sum(task: SumTask, *, verbose: bool = False) -> Any:
    """The sum over the ``num_clients`` nodes of their statistics (the structure of
    ``task.like``, NumPy leaves), by SecAgg+ on Flower's Simulation Engine (one node per
    partition)."""
    from flwr.simulation import run_simulation

    out: dict[str, Any] = {}
    server_app, client_app = secure_sum_apps(
        task, lambda total, count: out.update(total=total, count=count))
    run_simulation(server_app, client_app, num_supernodes=task.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 1, "include_dashboard": False,
                                                 "log_to_driver": verbose}},
                   verbose_logging=verbose)
    if "total" not in out:
        raise RuntimeError("secure aggregation did not finish; run with verbose=True to see "
                           "Flower's log")
    if out["count"] != task.num_clients:
        raise RuntimeError(f"secure aggregation covered {out['count']} of {task.num_clients} "
                           "nodes")
    leaves, tree = jax.tree_util.tree_flatten(task.like)
    return jax.tree_util.tree_unflatten(tree, [
        np.reshape(t, np.shape(x)) for t, x in zip(out["total"], leaves, strict=True)])
