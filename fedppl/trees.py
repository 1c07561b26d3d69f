"""The small pytree helpers every layer uses, defined once: pick, add and stack a leading axis.

States and messages are pytrees stacked on a leading client axis (``K`` clients); these move
between one client's tree and the stacked tree. Each applies to every leaf, so it works on any
NamedTuple, dict or tuple of arrays (JAX or NumPy: :func:`index`, :func:`first` and :func:`one`
keep the leaves' array type, as does :func:`unstack`; :func:`stack` takes the array module,
``jnp`` by default).

Example::

    >>> import jax.numpy as jnp
    >>> tree = {"mean": jnp.zeros((3, 2)), "count": jnp.arange(3)}   # 3 clients
    >>> {k: v.shape for k, v in index(tree, 1).items()}               # client 1's tree
    {'count': (), 'mean': (2,)}
    >>> {k: v.shape for k, v in one(first(tree)).items()}             # a batch of one client
    {'count': (1,), 'mean': (1, 2)}
    >>> {k: v.shape for k, v in stack([first(tree), index(tree, 2)]).items()}
    {'count': (2,), 'mean': (2, 2)}
    >>> [int(t["count"]) for t in unstack(tree)]                      # the list of 3 trees
    [0, 1, 2]
    >>> {k: v.shape for k, v in broadcast(first(tree), 4).items()}   # the same tree 4 times
    {'count': (4,), 'mean': (4, 2)}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["index", "first", "one", "stack", "unstack", "broadcast", "zeros"]


def index(tree: Any, k: Any) -> Any:
    """Every leaf indexed on its leading axis: ``x[k]`` (``k`` an integer, an array of
    indices or a slice)."""
    return jax.tree_util.tree_map(lambda x: x[k], tree)


def first(tree: Any) -> Any:
    """The first entry on the leading axis, ``x[0]``: a batch of one back to a single tree."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def one(tree: Any) -> Any:
    """A leading axis of length 1, ``x[None]``: a single tree as a batch of one."""
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def stack(trees: Sequence[Any], axis: int = 0, xp: Any = jnp) -> Any:
    """Trees of one structure stacked leaf by leaf on a new ``axis`` with ``xp.stack``
    (``xp=numpy`` on the host, for values already fetched from the device)."""
    return jax.tree_util.tree_map(lambda *xs: xp.stack(xs, axis=axis), *trees)


def unstack(tree: Any) -> list:
    """A tree stacked on its leading axis as the list of its entries (the inverse of
    :func:`stack`)."""
    n = len(jax.tree_util.tree_leaves(tree)[0])
    return [index(tree, k) for k in range(n)]


def broadcast(tree: Any, n: int) -> Any:
    """The same tree ``n`` times on a new leading axis (a broadcast view, no copy)."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def zeros(shapes: Any) -> Any:
    """Zeros of the shapes and dtypes in a tree of ``jax.ShapeDtypeStruct`` (what
    ``jax.eval_shape`` returns): the blank message of a client that sent none."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
