"""``Clients``: the data of K clients, ragged and in padded, masked, stacked form.

Each client holds a tuple of arrays (the positional arguments of the model, e.g. ``(X_k, y_k)``)
with a common number of rows ``N_k``. The stacked form pads every client to ``N_max`` rows (zeros)
and adds a boolean mask, so that all clients run through one compiled function under ``vmap``.

Example::

    >>> import numpy as np
    >>> clients = Clients.from_list([(np.ones((3, 2)), np.ones(3)), (np.ones((5, 2)), np.ones(5))])
    >>> clients.num_clients, clients.sizes.tolist()
    (2, [3, 5])
    >>> X_pad, y_pad = clients.stacked            # padded with zeros to N_max rows
    >>> X_pad.shape, y_pad.shape
    ((2, 5, 2), (2, 5))
    >>> clients.mask.sum(axis=1).tolist()         # (2, N_max) booleans: True at real rows
    [3, 5]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

__all__ = ["Clients"]


@dataclass(frozen=True)
class Clients:
    """Validated per-client data; build with :meth:`from_list` or :mod:`fedppl.partition`.

    ``pad_to``: the padded size when it must be more than the largest client's (a Flower node,
    which holds one client, pads its data to the size the server set up)."""

    data: tuple[tuple[np.ndarray, ...], ...]
    names: tuple[str, ...] = field(default=())
    pad_to: int = 0

    def __post_init__(self):
        if len(self.data) == 0:
            raise ValueError("there are no clients")
        if not self.names:
            object.__setattr__(self, "names", tuple(f"client {k}" for k in range(len(self.data))))
        self.check()

    def check(self) -> None:
        """Every client's arrays: one arity, one number of rows, numbers, finite, client 0's
        trailing shapes; a ``ValueError`` or ``TypeError`` naming the client otherwise. Run at
        construction and again when a run starts (arrays can be changed in place after
        partitioning)."""
        arity = len(self.data[0])
        for k, arrays in enumerate(self.data):
            who = self.names[k]
            if len(arrays) != arity:
                raise ValueError(f"{who} has {len(arrays)} arrays, client 0 has {arity}")
            lengths = {np.shape(a)[0] if np.ndim(a) else None for a in arrays}
            if None in lengths:
                raise ValueError(f"{who}: every array needs a leading data axis")
            if len(lengths) != 1:
                shapes = [np.shape(a) for a in arrays]
                raise ValueError(f"{who}: arrays have different numbers of rows {shapes}")
            if lengths == {0}:
                raise ValueError(f"{who} has no data")
            for i, a in enumerate(arrays):
                kind = np.asarray(a).dtype
                if not (np.issubdtype(kind, np.number) or np.issubdtype(kind, np.bool_)):
                    raise TypeError(f"{who}: array {i} has dtype {kind}; the model's data must "
                                    "be numbers (encode labels or categories as integers)")
                if np.issubdtype(kind, np.number):
                    bad = ~np.isfinite(np.asarray(a, dtype=float))
                    if bad.any():
                        rows = np.unique(np.nonzero(bad)[0])[:5].tolist()
                        raise ValueError(
                            f"{who}: array {i} has NaN or infinite values (rows {rows}...)"
                        )
            trailing = [np.shape(a)[1:] for a in arrays]
            ref = [np.shape(a)[1:] for a in self.data[0]]
            if trailing != ref:
                raise ValueError(f"{who}: array shapes {trailing} differ from client 0's {ref}")

    @classmethod
    def from_list(cls, data: Sequence[Sequence[np.ndarray]], names: Sequence[str] = (),
                  pad_to: int = 0) -> Clients:
        """One entry per client, each a tuple of arrays with a common leading length."""
        return cls(tuple(tuple(np.asarray(a) for a in d) for d in data), tuple(names), pad_to)

    def with_data(self, data: Sequence[Sequence[np.ndarray]]) -> Clients:
        """The same clients (names, padding) holding ``data`` instead (checked, cast arrays)."""
        return Clients.from_list(data, self.names, self.pad_to)

    @property
    def num_clients(self) -> int:
        return len(self.data)

    @property
    def sizes(self) -> np.ndarray:
        return np.array([np.shape(d[0])[0] for d in self.data])

    @property
    def max_size(self) -> int:
        """The padded size: the largest client's rows, or ``pad_to`` if more."""
        return max(int(self.sizes.max()), self.pad_to)

    @property
    def stacked(self) -> tuple[jnp.ndarray, ...]:
        """Arrays padded with zeros to ``N_max`` rows and stacked: ``(K, N_max, ...)`` each."""
        n = self.max_size
        rows = [self._padded(k, n)[0] for k in range(self.num_clients)]
        return tuple(jnp.asarray(np.stack(parts)) for parts in zip(*rows, strict=True))

    @property
    def mask(self) -> jnp.ndarray:
        """``(K, N_max)`` booleans, True at each client's real rows."""
        return jnp.asarray(np.arange(self.max_size)[None, :] < self.sizes[:, None])

    def padded(self, k: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """Client ``k``'s arrays padded with zeros to ``N_max`` rows, and its mask: entry ``k``
        of :attr:`stacked` and :attr:`mask`, on the host (indexing the stacked arrays compiles
        a program per shape)."""
        return self._padded(k, self.max_size)

    def _padded(self, k: int, n: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        rows = np.shape(self.data[k][0])[0]
        arrays = tuple(np.pad(a, [(0, n - rows)] + [(0, 0)] * (a.ndim - 1))
                       for a in map(np.asarray, self.data[k]))
        return arrays, np.arange(n) < rows

    def client(self, k: int) -> tuple[np.ndarray, ...]:
        """Client ``k``'s arrays, unpadded."""
        return self.data[k]

    def pooled(self) -> Clients:
        """All data on one client (the centralised reference)."""
        arrays = tuple(np.concatenate([d[i] for d in self.data]) for i in range(len(self.data[0])))
        return Clients((arrays,), ("pooled",))

    def subset(self, indices: Sequence[int]) -> Clients:
        return Clients(tuple(self.data[k] for k in indices), tuple(self.names[k] for k in indices))
