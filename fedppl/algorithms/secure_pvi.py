"""PVI's synchronous round with only the sum of the clients' deltas reaching the server (secure
aggregation: :mod:`fedppl.runtime.secure`, Flower's SecAgg+).

PVI's server judges each delta before it multiplies it into ``q`` (:func:`fedppl.algorithms.pvi
.verdicts`). A masked delta cannot be judged, so the checks move to where they can be made:

* **the client** judges its own delta against the ``q`` it was sent, by the server's rules
  (finite; ``q * delta_k``, which is the cavity times the client's new factor, positive
  definite; a Jeffreys divergence within ``max_divergence``) and withholds it if it fails,
  naming itself (:func:`judge`); then it clips the Euclidean norm of the delta's natural
  parameters ``(nat1, prec)`` to the public ``max_norm`` (:func:`prepare`). Clipping is a power
  ``delta_k ** c`` with ``c = max_norm / ||delta_k|| < 1``: ``q * delta_k ** c`` is a convex
  combination of ``q`` and ``q * delta_k`` in natural parameters, so it stays proper, and for
  the client it is damping by ``c`` (it keeps and applies the clipped delta, so
  ``q = p prod_k t_k`` holds on both sides, and PVI's fixed points are unchanged: the bound
  costs rounds, not the answer);
* **the sum** (:func:`summand`) carries the clipped delta and the counts of repaired cavities
  and of converged local steps; the local free energy and the iteration count stay at the
  client (their history columns are NaN and 0 under secure aggregation);
* **the server** gets the total ``Delta = sum_k delta_k`` of the ``n`` clients the sum covers,
  refuses it whole if its norm exceeds ``n * max_norm`` (:func:`judge_total`: a client did not
  clip), and folds ``n`` equal shares ``Delta / n`` (:func:`share`) with PVI's own
  :func:`~fedppl.algorithms.pvi.server_update`: every share is judged (the total finite,
  ``q * Delta / n`` proper, ``Delta / n`` within ``max_divergence``), then the accepted total is
  applied with the largest step in ``1, 1/2, ...`` that keeps ``q`` proper (the deltas are
  already damped). A total that fails is refused for every client in the sum, and each keeps
  its factor; each client applies its own delta with the step it is sent.

DP-PVI's messages with distributed noise (:class:`fedppl.algorithms.dp_mechanisms.NoisyMessage`,
``DPVirtualParties(distributed=t)``) take another path, as the total must stay linear in each
client's noise: the client neither clips nor judges the plausibility of its noisy delta; it
withholds it only if it is not finite or has an entry beyond the encoding's ``scale``
(:func:`noisy_summand`), and the server refuses a total whose noise shares add up to less than
the accounting assumes (:func:`noisy_total_check`) before folding its equal shares as above.

EP's site updates (:class:`fedppl.algorithms.ep.EPMessage`, PVI's message and the sampler's
diagnostics, which stay at the client) take the same path: EP's server is PVI's.

What is lost against the plain round: the server cannot refuse one client's message and keep
the others' (a bad total costs the round), and a wrong delta that passes its own client's check
(a hostile client skips it) is bounded only by ``max_norm`` and the total's checks.

Example (one client's delta judged and clipped; a NaN one is withheld)::

    >>> import jax.numpy as jnp
    >>> from fedppl.families import gaussian as g
    >>> q = g.DiagGaussian(jnp.zeros(2), jnp.ones(2))
    >>> delta = g.DiagGaussian(jnp.array([3.0, 0.0]), jnp.array([4.0, 0.0]))
    >>> clipped, verdict = clip(q, delta, max_norm=1.0)
    >>> float(norm(clipped)), float(verdict)
    (1.0, 1.0)
    >>> float(judge(q, g.DiagGaussian(jnp.full(2, jnp.nan), jnp.ones(2)), 1.0))
    -11.0
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from fedppl import trees
from fedppl.algorithms import pvi
from fedppl.algorithms.dp_mechanisms import NoisyMessage
from fedppl.families import gaussian as g

__all__ = ["norm", "judge", "clip", "prepare", "summand", "share", "judge_total", "CHECK",
           "noisy_summand", "noisy_total_check", "NOISY_CHECK"]

#: What a client checks of its own delta before it masks it (for the error that names it).
CHECK = ("finite, q times it positive definite, within max_divergence and within the norm "
         "bound")
#: What a client checks of a message with distributed DP noise (:func:`noisy_summand`).
NOISY_CHECK = "finite, every entry within the secure sum's scale"


def norm(delta: g.Gaussian) -> Array:
    """The Euclidean norm of a delta's natural parameters ``(nat1, prec)`` (NaN if any is not
    finite)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(delta)))


def judge(q: g.Gaussian, delta: g.Gaussian, max_norm: float,
          max_divergence: float = pvi.MAX_DIVERGENCE) -> Array:
    """A client's verdict on the delta it is about to add into the secure sum: 1.0 if it may,
    else :data:`fedppl.algorithms.pvi.OWN_CHECK` plus the server's refusal code (not finite,
    ``q * delta`` not positive definite, implausible) or plus
    :data:`~fedppl.algorithms.pvi.BEYOND_NORM` (a norm above ``max_norm``, to one part in 1e6:
    a delta changed after :func:`prepare` clipped it)."""
    verdict = pvi.verdicts(q, trees.one(delta), max_divergence)[0]
    beyond = ~(norm(delta) <= max_norm * (1.0 + 1e-6))
    code = jnp.where(verdict > 0, jnp.where(beyond, pvi.BEYOND_NORM, 1.0), verdict)
    return jnp.where(code > 0, code, pvi.OWN_CHECK + code)


def clip(q: g.Gaussian, delta: g.Gaussian, max_norm: float,
         max_divergence: float = pvi.MAX_DIVERGENCE) -> tuple[g.Gaussian, Array]:
    """``delta`` judged by the server's rules (:func:`judge`, before clipping: a delta too large
    for any data is withheld, not shrunk) and, if it passes, clipped to norm ``max_norm``;
    returns the clipped delta (zeros if withheld) and the verdict."""
    verdict = judge(q, delta, jnp.inf, max_divergence)
    size = norm(delta)
    c = jnp.where(verdict > 0, jnp.minimum(1.0, max_norm / jnp.where(size > 0, size, 1.0)), 0.0)
    safe = jax.tree_util.tree_map(lambda x: jnp.where(verdict > 0, x, 0.0), delta)
    return g.scale(safe, c.astype(q.nat1.dtype)), verdict


def prepare(server: pvi.ServerState, msg: pvi.ClientMessage, max_norm: float,
            max_divergence: float = pvi.MAX_DIVERGENCE) -> pvi.ClientMessage:
    """The message as the client sends it under secure aggregation, and keeps: its delta clipped
    to ``max_norm`` (:func:`clip`; a delta that fails the server's rules is zeroed, and
    :func:`summand` withholds it)."""
    delta, _ = clip(server.q, msg.delta, max_norm, max_divergence)
    return msg._replace(delta=delta)


def summand(server: pvi.ServerState, msg: pvi.ClientMessage, max_norm: float,
            max_divergence: float = pvi.MAX_DIVERGENCE) -> tuple[pvi.ClientMessage, Array]:
    """What the client adds into the secure sum in place of ``msg`` and its verdict on it
    (:func:`judge`: > 0 to send), made before masking, as the server sees only the sum. The
    summand carries the delta, whether the cavity was repaired and, in ``converged``, whether
    the local step did *not* converge (so that a sum that arrives as a flag says whether any
    did not); the free energy and the iteration count are zeroed."""
    return _summed_diagnostics(msg, _extras(msg)), judge(server.q, msg.delta, max_norm,
                                                         max_divergence)


def _summed_diagnostics(msg: Any, blanked: tuple[str, ...]) -> Any:
    """``msg`` (PVI's message or one with more fields: EP's, a NoisyMessage) as it enters a
    sum: the free energy and iteration count zeroed, ``converged``
    flipped (a summed flag then says whether any step did not converge), the fields
    ``blanked`` zeroed (they stay at the client)."""
    return msg._replace(free_energy=jnp.zeros_like(msg.free_energy),
                        converged=~jnp.asarray(msg.converged, bool),
                        iterations=jnp.zeros_like(msg.iterations),
                        **{name: _blank(getattr(msg, name), 0) for name in blanked})


def _extras(msg: tuple) -> tuple[str, ...]:
    """A message's fields beyond PVI's five (EP's sampler diagnostics): they stay at the client
    (zeros in the sum, NaN in the shares)."""
    return tuple(msg._fields[len(pvi.ClientMessage._fields):])  # type: ignore[attr-defined]


def _blank(x, value: float):
    if x is None:
        return None
    x = jnp.asarray(x)
    return jnp.full_like(x, value if jnp.issubdtype(x.dtype, jnp.inexact) else 0)


def judge_total(server: pvi.ServerState, total: pvi.ClientMessage, n: int | Array,
                max_norm: float) -> Array:
    """The server's first check of a secure total: 1.0, or
    :data:`~fedppl.algorithms.pvi.TOTAL_BEYOND` where the summed delta's norm exceeds ``n``
    clipped deltas' (``n * max_norm``, to one part in 1e6): some client in the sum did not
    clip, and the whole sum is refused (PVI's server update then judges the equal shares)."""
    bound = jnp.asarray(n, total.delta.nat1.dtype) * max_norm * (1.0 + 1e-6)
    return jnp.where(norm(total.delta) <= bound, 1.0, pvi.TOTAL_BEYOND)


def share(server: pvi.ServerState, total: pvi.ClientMessage, n: int | Array
          ) -> pvi.ClientMessage:
    """One of ``n`` equal messages that :func:`fedppl.algorithms.pvi.server_update` folds as it
    would fold the ``n`` clients' messages whose summands (:func:`summand`) add to ``total``:
    ``Delta / n``; the free energy NaN (it stayed at the clients), the cavity repaired if any
    was, the local steps converged only if every one did (``total``'s flags are counts, or
    whether any was set)."""
    n_arr = jnp.maximum(jnp.asarray(n, total.delta.nat1.dtype), 1.0)

    def any_set(x: Array) -> Array:
        return jnp.asarray(x).astype(n_arr.dtype) > 0

    return total._replace(
        delta=g.scale(total.delta, 1.0 / n_arr),
        free_energy=jnp.full_like(total.free_energy, jnp.nan),
        cavity_repaired=any_set(total.cavity_repaired).astype(
            jnp.result_type(total.cavity_repaired)),
        converged=(~any_set(total.converged)).astype(jnp.result_type(total.converged)),
        iterations=jnp.zeros_like(total.iterations),
        **{name: _blank(getattr(total, name), jnp.nan) for name in _extras(total)})


def noisy_summand(server: pvi.ServerState, msg: NoisyMessage, scale: float
                  ) -> tuple[NoisyMessage, Array]:
    """What a client adds into the secure sum for a message with distributed DP noise
    (:class:`~fedppl.algorithms.dp_mechanisms.NoisyMessage`) and its verdict: the delta as it
    is (not clipped, and not judged by the server's plausibility rules, so that the total stays
    linear in the client's noise) with its noise share; withheld only if it is not finite
    (:data:`~fedppl.algorithms.pvi.OWN_CHECK` plus ``NOT_FINITE``) or has an entry beyond
    ``scale``, which the encoding cannot carry (plus ``BEYOND_NORM``). The diagnostics are
    summed as :func:`summand` sums them."""
    leaves = jax.tree_util.tree_leaves(msg.delta)
    finite = g.is_finite(msg.delta)
    largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves]))
    verdict = jnp.where(~finite, pvi.OWN_CHECK + pvi.NOT_FINITE,
                        jnp.where(largest <= scale, 1.0, pvi.OWN_CHECK + pvi.BEYOND_NORM))
    return _summed_diagnostics(msg, ()), verdict


def noisy_total_check(server: pvi.ServerState, total: NoisyMessage, n: int | Array) -> Array:
    """The server's check of a secure total of messages with distributed DP noise: 1.0 where
    their noise shares add up to at least 1 (the total carries the noise the privacy
    accounting assumes), else :data:`~fedppl.algorithms.pvi.NOISE_SHORT` (fewer clients in the
    sum than ``distributed``): refused whole."""
    shares = jnp.asarray(total.noise_share)
    return jnp.where(shares >= 1.0 - 1e-6, 1.0, pvi.NOISE_SHORT)
