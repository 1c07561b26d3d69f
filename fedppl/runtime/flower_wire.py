"""Pytrees on Flower's wire: a message's leaves as an ``ArrayRecord`` and back, with the checks a
server or node makes on what a peer sent (:mod:`fedppl.runtime.flower`'s encoding)."""

from __future__ import annotations

import os
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
