"""Secure aggregation's public settings, how a method's messages enter a secure sum, and a
simulation of the protocol in one process (no Flower needed).

* :class:`SecureSum`: the settings every party knows (the scale each entry must stay within,
  the norm bound a PVI client clips its delta to, SecAgg+'s threshold);
* :class:`SecureForm` and :func:`secure_form`: how a method's ``train`` messages enter a sum
  (FSGP, FedBNR, synchronous PVI and EP, the importance check), what the client checks before
  masking, and how the server folds the total (used by :mod:`fedppl.runtime.flower` with
  Flower's SecAgg+, and here);
* :class:`SecureAggregation`: a runtime that runs synchronous PVI's (and EP's) rounds as the
  protocol runs them, for tests and benchmarks without an engine: each client judges and clips
  its delta (:mod:`fedppl.algorithms.secure_pvi`), encodes it as SecAgg+ does (two limbs on a
  grid of ``2**22`` levels, as unsigned 32-bit integers) and adds pairwise masks that cancel in
  the sum (modulo ``2**32``); the server adds what arrived, removes the masks that a dropped
  client's partners added (SecAgg+ rebuilds them from secret shares), decodes the total and
  folds its equal shares with PVI's own server update. A round in which fewer clients answer
  than ``max(2, ceil(threshold * asked))`` halts, as SecAgg+ does: no update, every client keeps
  its factor. What it leaves out is the cryptography (key agreement, secret sharing, the
  clients' self-masks): the arithmetic, the checks and the dropouts are the protocol's.
  It runs the importance check (:class:`fedppl.Importance`, ``result.check(...,
  runtime=...)``) the same way: each client judges its log-likelihoods at the draws
  (:func:`fedppl.algorithms.importance.secure_summand`) and the server decodes their total per
  draw, which its record reads as one row, all clients (the runtime is ``summed``).

Example (Bayesian linear regression: the secure run equals the plain one within the
quantisation bound; the server received only masked integers)::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(120, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2) + rng.normal(size=120),
    ...                                        num_clients=4, seed=0)
    >>> pvi = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression),
    ...                  schedule="synchronous", line_search=False)
    >>> secure = SecureAggregation(SecureSum(scale=1e3))
    >>> masked = pvi.run(jax.random.key(0), clients, 3, progress_bar=False,
    ...                  runtime=secure.runtime)
    >>> plain = pvi.run(jax.random.key(0), clients, 3, progress_bar=False)
    >>> bool(np.allclose(masked.q.nat1, plain.q.nat1, rtol=1e-5))
    True
    >>> secure.received[-1].dtype, secure.received[-1].shape[0]
    (dtype('uint32'), 4)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import trees
from fedppl.algorithms.trio import Trio, sent
from fedppl.runtime.embedded import Runtime
from fedppl.runtime.faults import ALL_KINDS, DROPPED, corrupt_where

__all__ = ["SecureSum", "SecureForm", "secure_form", "refusal", "adds_noise",
           "SecureAggregation",
           "norm_bound", "sum_error", "QUANTIZATION"]

#: SecAgg+'s quantisation levels over [-1, 1] (each of a value's two limbs is on this grid).
QUANTIZATION = 2**22
_HALF = QUANTIZATION // 2


class SecureSum(NamedTuple):
    """Secure aggregation's public settings.

    ``scale``: a bound on every entry of what a client adds into the sum (a client whose entries
    exceed it refuses to send, naming itself); the sum's error per entry is at most
    :func:`sum_error` ``(scale, n)``. ``threshold``: the fraction of a node's neighbours (here
    every other node) whose key shares unmask the sum; the server learns one node's vector only
    if at least that many nodes collude with it, and the sum survives as long as that many nodes
    answer every stage (at least 2). ``max_norm``: the bound a PVI client clips the Euclidean
    norm of its delta's natural parameters to before masking (None: ``scale``, so that no
    clipped delta has an entry beyond the scale); it must not exceed ``scale``.
    """

    scale: float
    threshold: float = 2 / 3
    max_norm: float | None = None


def norm_bound(secure: SecureSum) -> float:
    """The norm a PVI client clips its delta to (``max_norm``, or ``scale``), checked."""
    scale, bound = float(secure.scale), secure.max_norm
    bound = scale if bound is None else float(bound)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"SecureSum.scale must be a positive number, got {secure.scale}")
    if not 0 < bound <= scale:  # also refuses NaN
        raise ValueError(f"SecureSum.max_norm must be positive and at most scale ({scale:g}), "
                         f"got {secure.max_norm}")
    return bound


def sum_error(scale: float, n: int, dtype: Any = np.float64) -> float:
    """The largest error per entry of a secure sum over ``n`` clients: ``n * scale * 2**-42``
    in float64 (two limbs, float round-off included), ``n * scale`` times four of ``dtype``'s
    machine epsilons where that is larger (float32: the encoding's own round-off).

    >>> sum_error(1e3, 3) < 1e-9, sum_error(1e3, 3, np.float32) < 2e-3
    (True, True)
    """
    return float(n) * float(scale) * max(2.0**-42, 4.0 * float(np.finfo(dtype).eps))


# -- how a method's messages enter a sum -----------------------------------------------------


class SecureForm(NamedTuple):
    """How a method's ``train`` messages enter a secure sum: ``summand(server, message) ->
    (summand, ok)`` on the client (``ok``: the server's own check of the message, made by the
    client, as the server sees only the sum: True, or a verdict > 0; ``check`` names it), and
    ``message(server, total, n)`` on the server: one of ``n`` equal messages that the method's
    server update folds as it folds the ``n`` messages whose summands add to ``total``.
    ``prepare(server, message) -> message``: what the client makes of its message before it
    keeps and sends it (PVI: the delta clipped to the norm bound; None: nothing);
    ``total_check(server, total, n) -> verdict``: the server's check of the total before it
    folds it (> 0: fold it; None: none beyond the method's own). ``reasons``: what each
    verdict code means (None: PVI's :data:`~fedppl.algorithms.pvi.REFUSALS`)."""

    summand: Callable
    message: Callable
    check: str
    prepare: Callable | None = None
    total_check: Callable | None = None
    reasons: dict[float, str] | None = None


def secure_form(method: Any, like: Any, secure: SecureSum | None = None) -> SecureForm:
    """The secure form of ``method``'s messages (shaped as ``like``) under the settings
    ``secure``; a ``ValueError`` says why a method has none: its server needs each client's
    message, not only their sum. ``method`` None: the simulation's, which sees only the
    trio (a FedBNR run, whose settings decide, is refused there)."""
    from fedppl.algorithms import dp_mechanisms, ep, fedbnr, fsgp, pvi
    from fedppl.algorithms import importance as imp

    name = getattr(method, "name", type(method).__name__)
    if isinstance(like, dp_mechanisms.NoisyMessage):  # DP-PVI's distributed noise
        if secure is None:
            raise ValueError("the secure form of DP-PVI's noisy messages needs the settings "
                             "(SecureSum: its scale)")
        return _noisy_form(float(secure.scale))
    if adds_noise(method):  # central noise (DP-PVI's distributed noise is a NoisyMessage)
        hint = ("DP-PVI's noise under secure aggregation is DPVirtualParties(..., distributed=t)"
                if getattr(method, "privacy", None) is not None else "run one or the other")
        raise ValueError(f"{name} with privacy= and secure aggregation together is not "
                         f"supported: {hint}")
    if isinstance(like, fsgp.Message):
        return SecureForm(fsgp.secure_summand, fsgp.secure_message,
                          "finite parameters, plausible statistics")
    if isinstance(like, fedbnr.KernelMessage) and method is not None:
        kernel, layer = getattr(method, "kernel", "avg"), getattr(method, "last_layer", "global")
        if kernel != "avg" or layer != "global":
            raise ValueError(f"FedBNR with kernel={kernel!r} and last_layer={layer!r}: secure "
                             "aggregation gives the server only sums, which serve the shared "
                             "'avg' kernel and the global last layer ('kd' distils each "
                             "client's kernel, 'local' keeps each client's own)")
        return SecureForm(fedbnr.secure_summand, fedbnr.secure_message, "finite parameters")
    if isinstance(like, imp.Estimates):
        if secure is None:
            raise ValueError("the check's secure form needs the settings (SecureSum: its scale)")
        return _check_form(float(secure.scale))
    if isinstance(like, (pvi.ClientMessage, ep.EPMessage)) and name in ("PVI", "EP", "NoneType"):
        if getattr(method, "schedule", "synchronous") != "synchronous":
            raise ValueError(f"secure aggregation sums a synchronous round's deltas; {name} "
                             f"with schedule={method.schedule!r} sends one client's delta at a "
                             "time: use schedule='synchronous'")
        if getattr(method, "line_search", False) is not False:
            raise ValueError("PVI under secure aggregation needs line_search=False: the line "
                             "search scores candidates on each client's expected "
                             "log-likelihood, which is not summed securely")
        if secure is None:
            raise ValueError("PVI's secure form needs the settings (SecureSum: its norm bound)")
        return _pvi_form(norm_bound(secure),
                         float(getattr(method, "max_divergence", pvi.MAX_DIVERGENCE)))
    raise ValueError(f"{name}'s server needs each client's message, not only their sum, so "
                     "secure aggregation (Task.secure) cannot serve it; it serves synchronous "
                     "PVI and EP, FSGP, FedBNR and the importance check")


@lru_cache(maxsize=16)
def _pvi_form(max_norm: float, max_divergence: float) -> SecureForm:
    """Synchronous PVI's secure form (made once per bound: its functions are compiled once)."""
    from fedppl.algorithms import secure_pvi

    def summand(server, msg):
        return secure_pvi.summand(server, msg, max_norm, max_divergence)

    def prepare(server, msg):
        return secure_pvi.prepare(server, msg, max_norm, max_divergence)

    def total_check(server, total, n):
        return secure_pvi.judge_total(server, total, n, max_norm)

    return SecureForm(summand, secure_pvi.share, secure_pvi.CHECK, prepare, total_check)


@lru_cache(maxsize=16)
def _noisy_form(scale: float) -> SecureForm:
    """DP-PVI's distributed-noise form (made once per scale): the noisy delta enters the sum as
    it is, and the server checks that the total carries the assumed noise."""
    from fedppl.algorithms import secure_pvi

    def summand(server, msg):
        return secure_pvi.noisy_summand(server, msg, scale)

    def prepare(server, msg):  # the client keeps what it sends: its delta as it is
        return msg

    return SecureForm(summand, secure_pvi.share, secure_pvi.NOISY_CHECK, prepare,
                      secure_pvi.noisy_total_check)


@lru_cache(maxsize=16)
def _check_form(scale: float) -> SecureForm:
    """The importance check's secure form (made once per scale): each client's log-likelihoods
    at the draws, judged and floored at the client (:func:`fedppl.algorithms.importance.
    secure_summand`); the server's record adds up the equal shares of their total."""
    from fedppl.algorithms import importance as imp

    def summand(server, msg):
        return imp.secure_summand(msg, scale)

    return SecureForm(summand, imp.secure_message, "finite log-likelihoods within the scale",
                      reasons=imp.REFUSALS)


def refusal(form: SecureForm, ok: Any) -> str | None:
    """Why a client withholds its summand (None: it sends it): ``form``'s check, and for a
    verdict code the form's reason (PVI's by default)."""
    from fedppl.algorithms import pvi

    value = float(np.asarray(ok))
    if value > 0:
        return None
    reasons = pvi.REFUSALS if form.reasons is None else form.reasons
    return reasons.get(value, f"it fails the server's check ({form.check})")


def adds_noise(method: Any) -> bool:
    """Whether a method adds privacy noise at its clients (DP-PVI, private statistics)."""
    config = getattr(method, "config", None)
    return (getattr(method, "privacy", None) is not None
            or getattr(config, "privacy", None) is not None)


# -- the simulation --------------------------------------------------------------------------


def _encode(flat: Array, scale: float) -> Array:
    """``flat`` (entries within ``scale``) as SecAgg+'s two limbs, each on its grid of
    :data:`QUANTIZATION` levels as an unsigned integer: ``u = flat / scale`` rounded, and the
    remainder times :data:`QUANTIZATION` rounded (``(2, size)`` uint32)."""
    u = jnp.clip(flat / scale, -1.0, 1.0)
    high = jnp.round((u + 1.0) * _HALF)
    low = (u - (high / _HALF - 1.0)) * QUANTIZATION
    return jnp.stack([high, jnp.round((low + 1.0) * _HALF)]).astype(jnp.uint32)


def _decode(total: Array, n: Array, scale: float, dtype: Any) -> Array:
    """The sum of ``n`` clients' values from the sum of their limbs (uint32, modulo ``2**32``;
    exact while ``n * 2**22 < 2**31``)."""
    signed = jax.lax.bitcast_convert_type(total - (n * _HALF).astype(jnp.uint32), jnp.int32)
    high, low = signed.astype(dtype) / _HALF
    return scale * (high + low / QUANTIZATION)


def _pair_masks(key: Array, num: int, size: int) -> Array:
    """Each client's mask ``(num, 2, size)``: for every other client ``j`` a pseudo-random
    vector that ``k`` and ``j`` share (their agreed seed), added by the lower index and
    subtracted by the higher, so that the masks of any set of clients in which every pair is
    complete cancel modulo ``2**32``."""
    idx = jnp.arange(num)

    def pair(i, j):
        lo, hi = jnp.minimum(i, j), jnp.maximum(i, j)
        return jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, lo), hi), (2, size),
                               jnp.uint32)

    def mask(k):
        shared = jax.vmap(lambda j: pair(k, j))(idx)
        sign = jnp.where(idx > k, 1, jnp.where(idx < k, -1, 0)).astype(jnp.int32)
        signed = jnp.where((sign > 0)[:, None, None], shared,
                           jnp.where((sign < 0)[:, None, None], jnp.uint32(0) - shared,
                                     jnp.uint32(0)))
        return jnp.sum(signed, axis=0, dtype=jnp.uint32)

    return jax.lax.map(mask, idx)


def _flatten(tree: Any, dtype: Any) -> Array:
    return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in jax.tree_util.tree_leaves(tree)])


def _unflatten(flat: Array, like: Any) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(like)
    out, start = [], 0
    for x in leaves:
        part = jnp.reshape(flat[start:start + x.size], x.shape)
        start += x.size
        kind = jnp.dtype(x.dtype).kind
        out.append((jnp.round(part) if kind in "iub" else part).astype(x.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


@lru_cache(maxsize=16)
def _secure_round(trio: Trio, secure: SecureSum) -> Callable:
    """One compiled round of the simulated protocol; its last arguments are the fault plan (codes
    over :data:`~fedppl.runtime.faults.ALL_KINDS`) and whether a faulty client skips its
    check (one program for every fault setting)."""
    from fedppl.algorithms import dp_mechanisms, pvi
    from fedppl.algorithms import importance as imp

    scale = float(secure.scale)

    @jax.jit
    def round_fn(server, cstates, data, masks, keys, active, server_key, plan, hostile):
        if trio.begin_round is not None:
            server = trio.begin_round(server, server_key)
        broadcast = sent(trio, server)
        K = masks.shape[0]
        index = jnp.arange(K)
        msgs, proposed = jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0))(
            broadcast, cstates, data, masks, keys, index)
        form = secure_form(None, msgs, secure)
        if isinstance(msgs, imp.Estimates):  # the check: a sum, no server state from it
            return _sum_only(trio, form, secure, server, cstates, msgs, proposed, active,
                             server_key, plan)
        if form.prepare is None:
            raise ValueError("the simulation of secure aggregation runs synchronous PVI; FSGP "
                             "and FedBNR run it on Flower (Task.secure)")
        if (getattr(cstates, "parties", None) is not None
                and not isinstance(msgs, dp_mechanisms.NoisyMessage)):
            raise ValueError("PVI with DPVirtualParties and secure aggregation together needs "
                             "the noise distributed over the secure sum (the parties' factors "
                             "would not follow a clipped delta): DPVirtualParties(..., "
                             "distributed=t)")
        own = jax.vmap(form.prepare, (None, 0))(broadcast, msgs)  # what each client keeps
        wire = corrupt_where(own, plan, ALL_KINDS)  # a fault at the client, before its check
        summands, verdict = jax.vmap(form.summand, (None, 0))(broadcast, wire)
        faulty = plan > DROPPED
        reached = active & (plan != DROPPED)
        sends = reached & ((verdict > 0) | (hostile & faulty))
        dtype = summands.delta.nat1.dtype
        flat = jax.vmap(lambda s: _flatten(s, dtype))(summands)
        # a faulty client that skips its check sends what the encoding can carry
        bad = jnp.clip(jnp.nan_to_num(flat, nan=-scale, posinf=scale, neginf=-scale),
                       -scale, scale)
        flat = jnp.where((hostile & faulty)[:, None], bad, flat)
        received, n, total = _masked_sum(flat, sends, server_key, scale, dtype)
        halted = _halted(n, active, secure)
        total = _unflatten(total, trees.first(summands))
        verdict_total = (jnp.asarray(1.0) if form.total_check is None
                         else form.total_check(server, total, n))
        shares = trees.broadcast(form.message(server, total, n), K)
        taking = sends & ~halted & (verdict_total > 0)
        new, replies = trio.server_update(server, shares, index, taking, server_key, None)
        failed = jnp.where(halted, pvi.SUM_HALTED, verdict_total)
        replies = jnp.where(taking, replies,
                            jnp.where(sends, failed,
                                      jnp.where(reached & ~sends, verdict, pvi.NOT_RECEIVED)))
        cstates = jax.vmap(trio.acknowledge)(cstates, own, replies, proposed)
        shares = jax.tree_util.tree_map(
            lambda x: jnp.where(taking.reshape((K,) + (1,) * (x.ndim - 1)), x,
                                jnp.zeros_like(x)), shares)
        return new, cstates, shares, replies, received, sends

    return round_fn


def _masked_sum(flat: Array, sends: Array, server_key: Array, scale: float, dtype: Any
                ) -> tuple[Array, Array, Array]:
    """The protocol's arithmetic on the clients' summands ``flat`` ``(K, size)``: what the
    server received (each sending client's encoding plus its pairwise masks; zero rows for the
    others), how many sent, and the decoded sum: the sum of what arrived, less the masks that no
    partner cancelled (a dropped client's pairs, which SecAgg+ rebuilds from the survivors'
    shares)."""
    K, size = flat.shape
    key = jax.random.fold_in(server_key, 0x5EC)
    masked = jax.vmap(_encode, (0, None))(flat, scale) + _pair_masks(key, K, size)
    received = jnp.where(sends[:, None, None], masked, jnp.uint32(0))
    n = jnp.sum(sends)
    total = _decode(jnp.sum(received, axis=0, dtype=jnp.uint32)
                    - _uncancelled(key, sends, K, size), n, scale, dtype)
    return received, n, total


def _halted(n: Array, active: Array, secure: SecureSum) -> Array:
    """Whether SecAgg+ halts: fewer than ``max(2, ceil(threshold * asked))`` clients sent."""
    return (n < 2) | (n < jnp.ceil(secure.threshold * jnp.sum(active)))


def _sum_only(trio: Trio, form: SecureForm, secure: SecureSum, server: Any, cstates: Any,
              msgs: Any, proposed: Any, active: Array, server_key: Array, plan: Array
              ) -> tuple:
    """A round of a method whose server needs only the messages' sum and keeps no state made
    from it (the importance check): each client judges its own message (a fault enters
    before its check) and sends its summand or nothing; every client that the sum covers gets an
    equal share of the decoded total, the others none (a halted sum covers none). Replies: 1
    for a share, the client's verdict where it withheld, 0 where nothing arrived."""
    K = active.shape[0]
    wire = corrupt_where(msgs, plan, ALL_KINDS)
    summands, verdict = jax.vmap(form.summand, (None, 0))(sent(trio, server), wire)
    reached = active & (plan != DROPPED)
    sends = reached & (verdict > 0)
    dtype = jax.tree_util.tree_leaves(summands)[0].dtype
    flat = jax.vmap(lambda s: _flatten(s, dtype))(summands)
    received, n, total = _masked_sum(flat, sends, server_key, float(secure.scale), dtype)
    taking = sends & ~_halted(n, active, secure)
    share = form.message(server, _unflatten(total, trees.first(summands)), n)
    shares = jax.tree_util.tree_map(
        lambda x: jnp.where(taking.reshape((K,) + (1,) * x.ndim), x, jnp.zeros_like(x)), share)
    new, _ = trio.server_update(server, shares, jnp.arange(K), taking, server_key, None)
    replies = jnp.where(taking, 1.0, jnp.where(reached & ~sends, verdict, 0.0))
    cstates = jax.vmap(trio.acknowledge)(cstates, msgs, replies, proposed)
    return new, cstates, shares, replies, received, sends


def _uncancelled(key: Array, sends: Array, num: int, size: int) -> Array:
    """The sum over the clients that sent of their masks' parts shared with clients that did
    not: what the server subtracts (SecAgg+: rebuilt from the survivors' shares of the dropped
    clients' seeds)."""
    idx = jnp.arange(num)

    def part(k):
        def pair(j):
            lo, hi = jnp.minimum(k, j), jnp.maximum(k, j)
            r = jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, lo), hi), (2, size),
                                jnp.uint32)
            keep = sends[k] & ~sends[j] & (j != k)
            signed = jnp.where(j > k, r, jnp.uint32(0) - r)
            return jnp.where(keep, signed, jnp.uint32(0))

        return jnp.sum(jax.vmap(pair)(idx), axis=0, dtype=jnp.uint32)

    return jnp.sum(jax.lax.map(part, idx), axis=0, dtype=jnp.uint32)


class SecureAggregation:
    """Synchronous PVI's (and EP's, and the importance check's) rounds as secure aggregation
    runs them, in one process (the module docstring says what is simulated). Pass ``.runtime``
    as ``runtime=`` to ``run`` or ``init`` (a runtime whose server holds no data, as on
    Flower).

    ``secure``: the public settings (:class:`SecureSum`). ``faults``: a
    :class:`~fedppl.runtime.faults.Faults` (or any object with its ``draw(active)`` and
    ``restart()``) whose draws inject the faults at the clients: a
    dropout loses a client's masked vector (during masking, as SecAgg+ meets it); a corruption
    replaces the client's clipped message before its own check, which withholds it (refused at
    the client), or, with ``hostile=True``, the client skips its check and the corruption, cut
    to what the encoding carries (entries within ``scale``), enters the sum, where the server's
    check of the total meets it (PVI's rounds; in the check's, a NaN, infinite or out-of-scale
    message is refused at the client, and a round with a dropout is void). ``received``: per
    round, the masked vectors the server received (uint32, one row per client that sent).
    """

    def __init__(self, secure: SecureSum, faults: Any = None, hostile: bool = False):
        if not isinstance(secure, SecureSum):
            raise TypeError(f"secure must be a SecureSum, got {type(secure).__name__}")
        norm_bound(secure)
        if not 0 < float(secure.threshold) <= 1:
            raise ValueError(f"SecureSum.threshold must be in (0, 1], got {secure.threshold}")
        self.secure, self.faults, self.hostile = secure, faults, bool(hostile)
        self.received: list[np.ndarray] = []
        self.runtime = Runtime(self._make_round, data_at_server=False, summed=True)

    def _make_round(self, trio: Trio, schedule: str) -> Callable:
        if schedule != "synchronous" or not trio.jit:
            raise ValueError("secure aggregation sums a synchronous round's messages: use "
                             f"schedule='synchronous' (got {schedule!r})")
        if trio.client_evaluate is not None:
            raise ValueError("PVI under secure aggregation needs line_search=False: the line "
                             "search scores candidates on each client's expected "
                             "log-likelihood, which is not summed securely")
        faults = self.faults
        # a Faults plan's codes, renumbered over ALL_KINDS (one compiled round for any kinds)
        codes = np.arange(DROPPED + 1) if faults is None else np.array(
            [*range(DROPPED + 1), *(DROPPED + 1 + ALL_KINDS.index(k) for k in faults.kinds)])
        if faults is not None:
            faults.restart()
        self.received = []
        round_fn = _secure_round(trio, self.secure)

        def run_round(server, clients, data, masks, keys, active, server_key):
            plan = (np.zeros(np.shape(active), int) if faults is None
                    else codes[faults.draw(active)])
            new, cstates, shares, replies, received, sends = round_fn(
                server, clients, data, masks, keys, active, server_key, jnp.asarray(plan),
                jnp.asarray(self.hostile))
            self.received.append(np.asarray(received)[np.asarray(sends)])
            return new, cstates, shares, replies

        return run_round

    def __repr__(self) -> str:
        return f"SecureAggregation({self.secure}, faults={self.faults}, hostile={self.hostile})"

