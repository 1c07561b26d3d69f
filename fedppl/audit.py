"""Audit what leaves a client: run a federated method and inspect every message it sends.

:func:`audit_messages` runs any fedppl method (the common front: ``init`` / ``update``) on a set
of clients, reads each round's messages as they left the clients (stacked on the client axis,
in the run's state: ``state.log.last_messages``) and reports two kinds of leak:

* **raw records**: a client's input row (all ``D`` features of one record, bit for bit) anywhere
  in its messages, or one of its real-valued targets; integer-valued data (labels, counts, task
  indices) count when a run of ``min(N, 8)`` consecutive values appears, since single small
  integers occur in any message by chance;
* **sizes**: a message whose shape changes when the clients hold fewer records (the method is
  run a second time on the first ``shrink`` share of each client's rows), which would reveal
  how many records a client has.

It is a test of the implementation, not a privacy guarantee: a message can reveal a record
without copying it (differential privacy bounds that). Two things it knows about the DPO sparse
GP: with ``pseudo_init="data"`` its pseudo-inputs start at the client's own inputs and move in
the first local step, so they are no exact copies yet stay near the records
(``pseudo_init="prior"`` avoids that); and it sends ``pseudo_fraction * N_k`` pseudo-observations
(the paper's rule), padded to the largest client's count, so the size check flags its
``pseudo`` fields.

Example::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import logistic_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2)); y = (X[:, 0] > 0) * 1.0
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    >>> pvi = fedppl.PVI(model, fedppl.PVIGuide(model), local_steps=5, num_particles=8)
    >>> report = audit_messages(pvi, jax.random.key(0), clients)
    >>> report.clean, report.findings
    (True, ())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedppl.clients import Clients

__all__ = ["Finding", "AuditReport", "audit_messages", "last_messages", "raw_records_in",
           "size_changes"]

RUN = 8  # consecutive integer values that count as a copy of a client's data


class Finding(NamedTuple):
    client: str  # the client's name ("every client" for a size leak)
    round: int
    kind: str  # "input row", "target value", "integer run" or "size"
    leaf: str  # the message field, as a pytree path
    detail: str


class AuditReport(NamedTuple):
    findings: tuple[Finding, ...]
    rounds: int
    fields: tuple[str, ...]  # every message field that was inspected

    @property
    def clean(self) -> bool:
        return not self.findings


def _fields(msgs: Any, num_clients: int) -> list[tuple[str, np.ndarray]]:
    """The message leaves with a leading client axis, by path."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(msgs):
        a = np.asarray(leaf)
        if a.ndim >= 1 and a.shape[0] == num_clients and np.issubdtype(a.dtype, np.number):
            out.append((jax.tree_util.keystr(path), a))
    return out


def _integer_valued(a: np.ndarray) -> bool:
    return bool(np.all(a == np.round(a)))


def raw_records_in(fields: Sequence[tuple[str, np.ndarray]], arrays: Sequence[np.ndarray]
                   ) -> list[tuple[str, str, str]]:
    """``(kind, field, detail)`` for every raw record of ``arrays`` (one client's data) found
    in ``fields`` (that client's message leaves, without the client axis)."""
    found = []
    for i, data in enumerate(arrays):
        data = np.asarray(data)
        if data.size == 0 or not np.issubdtype(data.dtype, np.number):
            continue
        rows = data.reshape(data.shape[0], -1)
        width = rows.shape[1]
        for name, leaf in fields:
            flat = np.asarray(leaf)
            if flat.size == 0:
                continue
            as_data = rows.astype(flat.dtype)  # compare in the message's precision
            if width > 1:  # whole input rows, on the message's last axis
                if flat.ndim == 0 or flat.shape[-1] != width:
                    continue
                sent = {r.tobytes() for r in flat.reshape(-1, width)}
                hits = [n for n, r in enumerate(as_data) if r.tobytes() in sent]
                if hits:
                    found.append(("input row", name, f"array {i}, rows {hits[:5]}"))
                continue
            values = as_data[:, 0]
            if _integer_valued(values):
                w = min(len(values), RUN)
                if flat.size < w:
                    continue
                windows = np.lib.stride_tricks.sliding_window_view(flat.ravel(), w)
                sent = {r.tobytes() for r in windows}
                own = np.lib.stride_tricks.sliding_window_view(values, w)
                hits = [n for n, r in enumerate(own) if r.tobytes() in sent]
                if hits:
                    found.append(("integer run", name, f"array {i}, {w} values from row "
                                                        f"{hits[0]}"))
            else:
                real = values != np.round(values)
                copied = np.nonzero(real & np.isin(values, flat.ravel()))[0]
                if copied.size:
                    found.append(("target value", name, f"array {i}, rows "
                                                         f"{copied[:5].tolist()}"))
    return found


def size_changes(full: Sequence[tuple[str, np.ndarray]], fewer: Sequence[tuple[str, np.ndarray]]
                 ) -> list[tuple[str, str]]:
    """``(field, detail)`` for every message field whose per-client shape differs between a run
    on the clients and a run on fewer records per client."""
    before = {name: a.shape[1:] for name, a in full}
    after = {name: a.shape[1:] for name, a in fewer}
    out = [(name, f"shape {before[name]} with all records, {after.get(name)} with fewer")
           for name in before if before[name] != after.get(name)]
    out += [(name, "sent only with fewer records") for name in after if name not in before]
    return out


def _fewer(clients: Clients, shrink: float) -> Clients:
    keep = [max(1, int(np.ceil(shrink * n))) for n in clients.sizes]
    return Clients(tuple(tuple(np.asarray(a)[:m] for a in arrays)
                         for arrays, m in zip(clients.data, keep, strict=True)), clients.names)


def audit_messages(method: Any, rng_key: Any, clients: Clients, num_rounds: int = 1, *,
                   shrink: float = 0.6, **init_kwargs: Any) -> AuditReport:
    """Run ``num_rounds`` rounds of ``method`` on ``clients`` and audit every message sent;
    then one round on the first ``shrink`` share of each client's rows, for the size check.
    ``init_kwargs`` go to ``method.init`` (e.g. FedBNR's ``validation``)."""
    if not 0.0 < shrink < 1.0:
        raise ValueError(f"shrink must be in (0, 1), got {shrink}")
    findings: list[Finding] = []
    K = clients.num_clients
    state = method.init(rng_key, clients, **init_kwargs)
    first: list[tuple[str, np.ndarray]] = []
    names: set[str] = set()
    for r in range(1, num_rounds + 1):
        state, _ = method.update(state)
        sent, active = last_messages(method, state)
        fields = _fields(sent, K)
        first = first or fields
        names |= {n for n, _ in fields}
        for k in np.nonzero(np.asarray(active))[0]:
            own = [(n, a[k]) for n, a in fields]
            for kind, leaf, detail in raw_records_in(own, clients.client(int(k))):
                findings.append(Finding(clients.names[k], r, kind, leaf, detail))
    small, _ = method.update(method.init(rng_key, _fewer(clients, shrink), **init_kwargs))
    for leaf, detail in size_changes(first, _fields(last_messages(method, small)[0], K)):
        findings.append(Finding("every client", 1, "size", leaf, detail))
    return AuditReport(tuple(findings), num_rounds, tuple(sorted(names)))


def last_messages(method: Any, state: Any) -> tuple[Any, np.ndarray]:
    """What left the clients in the round that produced ``state`` (stacked on the client
    axis) and which clients took part: the state's record (``state.log``), or for a front that
    keeps it on itself (the Pyro port's) ``method.last_messages`` and ``method.last_active``."""
    log = getattr(state, "log", None)
    if log is not None and getattr(log, "last_messages", None) is not None:
        return log.last_messages, np.asarray(log.last_active)
    return method.last_messages, np.asarray(method.last_active)
