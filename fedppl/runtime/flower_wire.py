"""Pytrees on Flower's wire: a message's leaves as an ``ArrayRecord`` and back, with the checks a
server or node makes on what a peer sent (:mod:`fedppl.runtime.flower`'s encoding); and the
transport around it (replies pulled often, Flower's log filtered)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.app import ArrayRecord, RecordDict
except ImportError as err:  # pragma: no cover - the extra is installed by make test
    raise ImportError("fedppl.runtime.flower_wire needs Flower: pip install 'fedppl[flower]'"
                      ) from err

__all__ = ["pack", "unpack"]


def pack(tree: Any) -> ArrayRecord:
    """A pytree's leaves as an ``ArrayRecord`` (keys ``"0"``, ``"1"``...; PRNG keys as their data).

    >>> import jax.numpy as jnp
    >>> record = pack({"a": jnp.ones(2), "b": jnp.zeros((1, 3))})
    >>> [a.shape for a in record.to_numpy_ndarrays()]
    [(2,), (1, 3)]
    """
    return ArrayRecord([np.asarray(jax.random.key_data(x) if is_key(x) else x)
                        for x in jax.tree_util.tree_leaves(tree)])


def unpack(record: Any, like: Any, who: str = "a peer", what: str = "message") -> Any:
    """The pytree shaped as ``like`` (arrays or ``jax.ShapeDtypeStruct``) from ``record``, after
    checking the number of leaves and each leaf's shape and dtype: a ``ValueError`` names ``who``
    and the first mismatch."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    got = record.to_numpy_ndarrays()
    if len(got) != len(leaves):
        raise ValueError(f"{who} sent a {what} with {len(got)} arrays, expected {len(leaves)}")
    out = []
    for i, (a, want) in enumerate(zip(got, leaves, strict=True)):
        if is_key(want):
            want_shape = jax.eval_shape(jax.random.key_data, want).shape
            want_dtype: Any = np.uint32
        else:
            want_shape, want_dtype = tuple(np.shape(want)), np.dtype(want.dtype)
        if tuple(a.shape) != tuple(want_shape) or a.dtype != want_dtype:
            raise ValueError(f"{who} sent a {what} whose array {i} has shape {a.shape} and dtype "
                             f"{a.dtype}, expected {tuple(want_shape)} and {np.dtype(want_dtype)}")
        out.append(jax.random.wrap_key_data(jnp.asarray(a)) if is_key(want) else jnp.asarray(a))
    return jax.tree_util.tree_unflatten(treedef, out)


def is_key(x: Any) -> bool:
    """Whether ``x`` is an array of typed PRNG keys (sent as its key data)."""
    return jnp.issubdtype(getattr(x, "dtype", np.float64), jax.dtypes.prng_key)


def shapes(tree: Any) -> Any:
    """The tree's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def unflatten(record: Any, like: Any) -> Any:
    """A pytree the server sent, structured as ``like`` (trusted: the structure is the method's
    own; shapes are not checked, as some depend on the number of clients)."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    got = record.to_numpy_ndarrays()
    if len(got) != len(leaves):
        raise ValueError(f"the server sent {len(got)} arrays, expected {len(leaves)}")
    return jax.tree_util.tree_unflatten(treedef, [
        jax.random.wrap_key_data(jnp.asarray(a)) if is_key(w) else jnp.asarray(a)
        for a, w in zip(got, leaves, strict=True)])


def record_bytes(content: RecordDict) -> int:
    """Bytes of the arrays in a Flower message's content."""
    return int(sum(a.numpy().nbytes for rec in content.array_records.values()
                   for a in rec.values()))


# -- the transport -------------------------------------------------------------------------------


@contextlib.contextmanager
def flower_log(keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """Flower's log with only the records ``keep`` accepts while the block runs."""
    logger = logging.getLogger("flwr")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def quick_object_pulls(grid: Any) -> None:
    """On the Deployment Engine, the ServerApp asks again after 0.01 s (doubling to 0.2 s), not
    Flower's 1 s (doubling to 10 s), for the parts of a node's reply that the SuperLink has not
    stored yet: a reply's message arrives before its arrays, and each round waits for the last.
    (Flower 1.42's HTTP grid takes the waits from its module's ``pull_objects``.)"""
    module = sys.modules.get(type(grid).__module__)
    pull = getattr(module, "pull_objects", None)
    if pull is not None and not isinstance(pull, functools.partial):
        module.pull_objects = functools.partial(  # type: ignore[union-attr]
            pull, initial_backoff=0.01, backoff_cap=0.2)


def send_and_receive(grid: Any, messages: list[Any], timeout: float | None,
                     poll: float = 0.01, max_poll: float = 0.1) -> list[Any]:
    """``grid.send_and_receive``, its replies pulled every ``poll`` seconds (growing to
    ``max_poll`` while none come) instead of Flower's every 3 s, the whole of a round's time on
    the Deployment Engine once the nodes' processes are warm."""
    waiting = set(grid.push_messages(messages))
    end = None if timeout is None else time.monotonic() + timeout
    replies: list[Any] = []
    wait = poll
    while waiting and (end is None or time.monotonic() < end):
        got = list(grid.pull_messages(waiting))
        replies += got
        waiting -= {m.metadata.reply_to_message_id for m in got}
        wait = poll if got else min(max_poll, 1.5 * wait)
        if waiting:
            time.sleep(wait if end is None else max(0.0, min(wait, end - time.monotonic())))
    return replies
