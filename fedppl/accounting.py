"""Privacy accounting for every differentially private release in fedppl, with ``dp_accounting``.

A private release is described by a ``dp_accounting`` event (a Gaussian mechanism, subsampled
or not, composed over steps and rounds); this module turns an event into its ``epsilon`` at a
given ``delta`` (:func:`epsilon`) and finds the smallest noise multiplier whose event meets a
target ``(epsilon, delta)`` (:func:`calibrate`). The mechanisms themselves live with the
methods that release something (:mod:`fedppl.algorithms.dp_pvi`, :mod:`fedppl.privacy`,
:mod:`fedppl.algorithms.dp_statistics`); they all count here.

Neighbouring data sets differ by one record added or removed (``ADD_OR_REMOVE_ONE``), except for
fixed-size subsampling without replacement, whose amplification ``dp_accounting`` states for
one record replaced (``REPLACE_ONE``).

Example::

    >>> import dp_accounting
    >>> from fedppl import accounting
    >>> one = dp_accounting.GaussianDpEvent(2.0)
    >>> round(accounting.epsilon(one, 1e-5), 2)
    2.17
    >>> sigma = accounting.calibrate(dp_accounting.GaussianDpEvent, 2.17, 1e-5)
    >>> round(sigma, 2)
    2.0
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # dp_accounting loads scipy.signal and scipy.stats (~0.8 s): imported on use
    import dp_accounting

__all__ = ["METHODS", "check_epsilon", "check_delta", "epsilon", "calibrate"]

#: The accounting methods :func:`epsilon` takes: Renyi DP and privacy-loss distributions.
METHODS = ("rdp", "pld")
MAX_NOISE = 1e4  # calibration looks for a multiplier below this; above it nothing useful is left


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """``epsilon`` as a float, or a ValueError unless ``0 < epsilon`` (``inf`` allowed: no
    privacy asked for)."""
    e = float(epsilon)
    if not e > 0.0:  # also rejects NaN
        raise ValueError(f"{name} must be positive, got {epsilon}")
    return e


def check_delta(delta: float, name: str = "delta") -> float:
    """``delta`` as a float, or a ValueError unless ``0 < delta < 1``."""
    d = float(delta)
    if not 0.0 < d < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {delta}")
    return d


def _relation(event: dp_accounting.DpEvent):
    import dp_accounting

    def has_replace(e) -> bool:
        if isinstance(e, dp_accounting.SampledWithoutReplacementDpEvent):
            return True
        if isinstance(e, dp_accounting.SelfComposedDpEvent):
            return has_replace(e.event)
        if isinstance(e, dp_accounting.ComposedDpEvent):
            return any(has_replace(x) for x in e.events)
        return False

    rel = dp_accounting.NeighboringRelation
    return rel.REPLACE_ONE if has_replace(event) else rel.ADD_OR_REMOVE_ONE


def epsilon(event: dp_accounting.DpEvent, delta: float, method: str = "rdp", *,
            value_discretization_interval: float = 1e-3) -> float:
    """The ``epsilon`` of ``event`` at ``delta``: 0 for no release, ``inf`` for a release
    without noise. ``method``: ``"rdp"`` (Renyi DP; fast, a little loose) or ``"pld"``
    (privacy-loss distributions, on a grid of ``value_discretization_interval``; tight,
    slower)."""
    import dp_accounting
    from dp_accounting import pld, rdp

    delta = check_delta(delta)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    relation = _relation(event)
    if method == "pld":
        acc = pld.PLDAccountant(relation, value_discretization_interval)
    else:
        acc = rdp.RdpAccountant(neighboring_relation=relation)
    absl = logging.getLogger("absl")  # RDP orders that do not converge are dropped, loudly
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        acc.compose(event)
        return float(acc.get_epsilon(delta))
    finally:
        absl.setLevel(level)


def calibrate(event_of: Callable[[float], dp_accounting.DpEvent], epsilon_target: float,
              delta: float, method: str = "rdp", rtol: float = 1e-3) -> float:
    """The smallest noise multiplier ``sigma`` (to relative tolerance ``rtol``) for which
    ``event_of(sigma)`` has ``epsilon <= epsilon_target`` at ``delta``: bisection on
    ``log sigma`` (epsilon falls as sigma grows). Raises a ValueError, before anything runs,
    when no multiplier up to :data:`MAX_NOISE` meets the target."""
    target = check_epsilon(epsilon_target)
    delta = check_delta(delta)
    if math.isinf(target):
        return 0.0

    def eps(sigma: float) -> float:
        return epsilon(event_of(sigma), delta, method)

    hi = 1.0
    while eps(hi) > target:
        hi *= 4.0
        if hi > MAX_NOISE:
            raise ValueError(
                f"no noise multiplier up to {MAX_NOISE:g} meets epsilon={target} at "
                f"delta={delta} for these steps and rounds: ask for fewer rounds or steps, a "
                "smaller sampling rate, or a larger epsilon or delta")
    lo = hi / 4.0
    if lo < 1e-3 or eps(lo) <= target:  # the target is loose: search down to 1e-3
        lo = 1e-3
        if eps(lo) <= target:
            return lo
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        if eps(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi
