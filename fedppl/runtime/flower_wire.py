"""Pytrees on Flower's wire: each of a message's trees as one ``bytes`` value (its leaves' dtypes
and shapes, then their data), all of them with the message's settings in one ``ConfigRecord``;
the checks a server or node makes on what a peer sent (:mod:`fedppl.runtime.flower`'s
encoding); and the transport around it (replies pulled often, Flower's log filtered).

Flower stores and sends a message as a tree of objects (the message, its ``RecordDict``, each
record, each array of an ``ArrayRecord`` and each array's chunks), each pushed and pulled in a
request of its own through the SuperLink; a message as one record is three objects, whatever
its trees. With an ``ArrayRecord`` per tree, a PVI run at K = 10 cost the SuperLink 36 object
requests per message; as one record, 13 (``benchmarks/flower_overhead.py`` counts them)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.app import ConfigRecord, RecordDict
except ImportError as err:  # pragma: no cover - the extra is installed by make test
    raise ImportError("fedppl.runtime.flower_wire needs Flower: pip install 'fedppl[flower]'"
                      ) from err

__all__ = ["pack", "unpack", "content", "fields", "RECORD"]

#: The record of a fedppl message's content: its trees (``bytes``) and settings.
RECORD = "fedppl"
_KINDS = "biufc"  # the dtypes a peer may send: booleans and numbers


def pack(tree: Any) -> bytes:
    """A pytree's leaves as bytes: a header (each leaf's dtype and shape) and their data, in
    order (PRNG keys as their key data).

    >>> import jax.numpy as jnp
    >>> data = pack({"a": jnp.ones(2), "b": jnp.zeros((1, 3))})
    >>> [a.shape for a in arrays(data)]
    [(2,), (1, 3)]
    """
    leaves = [np.asarray(jax.random.key_data(x) if is_key(x) else x)
              for x in jax.tree_util.tree_leaves(tree)]
    header = json.dumps([[a.dtype.str, list(a.shape)] for a in leaves]).encode()
    return b"".join([len(header).to_bytes(4, "little"), header, *(a.tobytes() for a in leaves)])


def arrays(data: Any, who: str = "a peer", what: str = "message") -> list[np.ndarray]:
    """The arrays :func:`pack` wrote into ``data``; a ``ValueError`` names ``who`` when they
    are not that (a header that does not parse, a dtype that is not a number, a length that
    does not match)."""
    if not isinstance(data, bytes):
        raise ValueError(f"{who} sent a {what} that is not bytes ({type(data).__name__})")
    try:
        n = int.from_bytes(data[:4], "little")
        header = json.loads(data[4:4 + n].decode())
        specs = [(np.dtype(str(t)), tuple(int(d) for d in shape)) for t, shape in header]
    except (ValueError, TypeError, UnicodeDecodeError) as err:
        raise ValueError(f"{who} sent a {what} whose header does not parse: {err}") from None
    out, at = [], 4 + n
    for i, (dtype, shape) in enumerate(specs):
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if dtype.kind not in _KINDS or min(shape, default=0) < 0 or at + size > len(data):
            raise ValueError(f"{who} sent a {what} whose array {i} ({dtype}, {shape}) is not "
                             "a number array that fits the message")
        out.append(np.frombuffer(data, dtype, int(np.prod(shape, dtype=np.int64)),
                                 at).reshape(shape))
        at += size
    if at != len(data):
        raise ValueError(f"{who} sent a {what} of {len(data)} bytes, its arrays take {at}")
    return out


def unpack(data: Any, like: Any, who: str = "a peer", what: str = "message") -> Any:
    """The pytree shaped as ``like`` (arrays or ``jax.ShapeDtypeStruct``) from ``data``
    (:func:`pack`'s), after checking the number of leaves and each leaf's shape and dtype: a
    ``ValueError`` names ``who`` and the first mismatch.

    >>> import jax.numpy as jnp
    >>> unpack(pack({"a": jnp.ones(2)}), {"a": jnp.ones(2), "b": jnp.ones(1)}, "client 4")
    Traceback (most recent call last):
    ...
    ValueError: client 4 sent a message with 1 arrays, expected 2
    """
    leaves, treedef = jax.tree_util.tree_flatten(like)
    got = arrays(data, who, what)
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


def unflatten(data: Any, like: Any) -> Any:
    """A pytree the server sent, structured as ``like`` (trusted: the structure is the method's
    own; shapes are not checked, as some depend on the number of clients)."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    got = arrays(data, "the server")
    if len(got) != len(leaves):
        raise ValueError(f"the server sent {len(got)} arrays, expected {len(leaves)}")
    return jax.tree_util.tree_unflatten(treedef, [
        jax.random.wrap_key_data(jnp.asarray(a)) if is_key(w) else jnp.asarray(a)
        for a, w in zip(got, leaves, strict=True)])


def content(values: Mapping[str, Any] | None = None, **trees: Any) -> RecordDict:
    """A message's content: one ``ConfigRecord`` (:data:`RECORD`) with the settings ``values``
    (numbers, strings, lists of them) and each of ``trees`` packed (:func:`pack`)."""
    return RecordDict({RECORD: ConfigRecord({**dict(values or {}),
                                             **{k: pack(t) for k, t in trees.items()}})})


def fields(content: RecordDict, who: str = "a peer") -> ConfigRecord:
    """The record :func:`content` wrote (a ``ValueError`` names ``who`` when there is none)."""
    if RECORD not in content.config_records:
        raise ValueError(f"{who} sent a message without fedppl's record")
    return content.config_records[RECORD]


def record_bytes(content: RecordDict) -> int:
    """Bytes of a Flower message's content: its arrays, and the bytes in its config records
    (fedppl's trees travel there, as SecAgg+'s keys, shares and masked vectors do)."""
    arrays_ = sum(a.numpy().nbytes for rec in content.array_records.values()
                  for a in rec.values())
    raw = sum(len(b) for rec in content.config_records.values() for v in rec.values()
              for b in (v if isinstance(v, list) else [v]) if isinstance(b, bytes))
    return int(arrays_ + raw)


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
