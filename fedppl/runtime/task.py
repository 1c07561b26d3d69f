"""What a Flower app runs (:class:`Task`), importable without Flower: a task module builds one
on every process, and the same task runs on the embedded runtime (``method.run``) where Flower is
not installed."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["Task"]


class Task(NamedTuple):
    """What a Flower app runs, built on every process from the run's config.

    ``method``: a fedppl method (``fedppl.PVI``, ``fedppl.FSGP``...); ``load_partition(k)``: the
    arrays of partition ``k`` (called only on the node that holds it); ``num_clients``: how many
    nodes to wait for; ``num_rounds`` and ``run_kwargs`` go to ``method.run`` (with
    ``jax.random.key(seed)``); ``round_timeout``: seconds the server waits for a round's answers
    (None: until every node answers); ``connect_timeout``: seconds the server waits for
    ``num_clients`` nodes to connect.

    ``fault(partition, round)`` injects a node's faults, for drills and tests: None (no fault),
    ``"crash"`` (the ClientApp raises), ``"slow"`` (it answers after twice ``round_timeout``),
    ``"wrong_shape"`` (one array too many), or a function of the message that returns the
    message sent instead. The node keeps its true state: a fault changes only what leaves it.
    (A node that dies is a real process killed: :meth:`LocalDeployment.kill_node
    <fedppl.runtime.deployment.LocalDeployment.kill_node>`.)

    ``secure``: a :class:`~fedppl.runtime.secure.SecureSum` sends every exchange through Flower's
    SecAgg+, so the server gets only the sum of the clients' messages (synchronous PVI and EP
    without the line search, FSGP, FedBNR and the importance check, whose servers need no more;
    other methods are refused), or
    None (each message in the clear). It is part of the task, built on every process, so each
    node also refuses to send in the clear.
    """

    method: Any
    load_partition: Callable[[int], tuple]
    num_clients: int
    num_rounds: int
    seed: int = 0
    run_kwargs: Mapping[str, Any] = {}
    round_timeout: float | None = None
    connect_timeout: float = 120.0
    fault: Callable[[int, int], Any] | None = None
    secure: Any = None
