"""What a front tells the user after each round.

:class:`Progress` is every method's progress bar (on stderr, off with ``progress_bar=False``):
one tick per round, a quantity the method has (PVI's ``elbo`` and ``kl_change``, EP's
``site_change``, a sparse GP's ``free_energy``, ...; never a NaN), and, when a run stops before
its last round (``tol``, a method's own stopping rule), one line that stays once the bar has
gone, naming the round and the criterion.

:func:`report` is PVI's account of each round: refused and shrunk updates, repaired
cavities, EP's chains that did not mix and (once) a collapse of q's uncertainty, each naming the
clients; the refusals are kept for the result in a :class:`RoundRecord` that each round
replaces (it travels in the run's state); :func:`unfinished` names, at the end of a run,
the clients whose last local step stopped at its cap. :class:`RoundLog` keeps the record on an
object for the Pyro port's front; both read the messages and Gaussians as NumPy arrays (JAX
arrays, or torch tensors detached first).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from fedppl import validation
from fedppl.algorithms import pvi

__all__ = ["RoundLog", "RoundRecord", "report", "unfinished", "Progress", "postfix"]


def postfix(info: Mapping[str, Any], keys: Sequence[str]) -> dict[str, str]:
    """The bar's ``name=value`` pairs for one round's history row: each of ``keys`` present
    and finite. A key ``"name:max"`` or ``"name:mean"`` reduces a per-client array over its
    finite entries (a scalar is shown as it is). When none is finite, the messages sent
    (``messages_up``) stand in, so a bar never shows a NaN."""
    out: dict[str, str] = {}
    for spec in keys:
        name, _, how = spec.partition(":")
        if name not in info:
            continue
        arr = np.asarray(info[name], dtype=float)
        if arr.ndim:
            arr = arr[np.isfinite(arr)]
            if not arr.size:
                continue
            arr = arr.max() if how == "max" else arr.mean()
        value = float(arr)
        if math.isfinite(value):
            out[name] = f"{value:.4g}"
    if not out and "messages_up" in info:
        out["messages_up"] = str(int(info["messages_up"]))
    return out


class Progress:
    """A run's progress bar on stderr, for ``num_rounds`` rounds.

    ``about`` (what the run fits: PVI's global and local sites) is written first, as a line
    that stays. ``update(info)`` ticks once and shows :func:`postfix` of the round's row;
    ``close(stopped)`` removes the bar and, if ``stopped`` (why the run ended early) is given,
    writes one line that stays: ``"PVI (sequential): stopped after round 7 of 30: kl_change
    3.2e-09 <= tol 1e-08"``. ``enabled=False`` writes nothing at all.

    Example::

        >>> bar = Progress("PVI", 3, ("elbo",), enabled=False)
        >>> bar.update({"round": 1, "elbo": -12.5})
        >>> bar.close("elbo stopped moving")
    """

    def __init__(self, desc: str, num_rounds: int, keys: Sequence[str], enabled: bool = True,
                 about: str = ""):
        self.desc, self.num_rounds, self.keys, self.enabled = desc, num_rounds, keys, enabled
        self.rounds = 0
        if about and enabled:  # what the run fits, before its first round
            tqdm.write(f"{desc}: {about}", file=sys.stderr)
        self.bar = tqdm(total=num_rounds, desc=desc, disable=not enabled, leave=False,
                        unit="round")

    def update(self, info: Mapping[str, Any]) -> None:
        self.rounds += 1
        self.bar.update(1)
        if self.enabled:
            self.bar.set_postfix(postfix(info, self.keys))  # redraws: the row is always shown

    def close(self, stopped: str | None = None) -> None:
        self.bar.close()
        if stopped and self.enabled:
            tqdm.write(f"{self.desc}: stopped after round {self.rounds} of {self.num_rounds}: "
                       f"{stopped}", file=sys.stderr)


class RoundRecord(NamedTuple):
    """PVI's account of a run so far, replaced (never changed) by :func:`report`: the refused
    updates ``(round, client, reason)``, the local steps that did not converge ``(round,
    client)``, and whether the collapse of q's uncertainty has been reported."""

    rejected: tuple[tuple[int, str, str], ...] = ()
    unconverged: tuple[tuple[int, str], ...] = ()
    shrink_warned: bool = False


def report(record: RoundRecord, names: Sequence[str], shrink_factor: float, r: int,
           steps: np.ndarray, msgs: Any, active: np.ndarray, q_old: Any, q_new: Any
           ) -> RoundRecord:
    """Round ``r + 1``'s server outcome as warnings naming the clients (refused or shrunk
    updates, repaired cavities, unconverged local steps, once a collapse of q's uncertainty by
    more than ``shrink_factor``), and the record with it added."""

    def listed(idx) -> str:
        return ", ".join(names[k] for k in idx)

    rejected, unconverged = list(record.rejected), list(record.unconverged)
    for code, reason in pvi.REFUSALS.items():
        bad = np.nonzero(active & (steps == code))[0]
        for k in bad:
            rejected.append((r + 1, names[k], reason))
        if len(bad):
            _warn(f"round {r + 1}: refused the updates of {listed(bad)} ({reason}); "
                  "their factors are unchanged")
    shrunk = np.nonzero((steps > 0) & (steps < 1))[0]
    if len(shrunk):
        _warn(f"round {r + 1}: updates of {listed(shrunk)} applied with step "
              f"{steps[shrunk].min():.3g} to keep q positive definite (and, with the line "
              "search, the global ELBO from dropping)")
    fixed = np.nonzero(active & np.asarray(msgs.cavity_repaired))[0]
    if len(fixed):
        _warn(f"round {r + 1}: cavities of {listed(fixed)} were not positive definite and "
              "were repaired (eigenvalues clipped)")
    slow = np.nonzero(active & ~np.asarray(msgs.converged, bool))[0]
    for k in slow:
        unconverged.append((r + 1, names[k]))
    if len(slow) and hasattr(msgs, "rhat"):  # EP: a sampler that did not mix
        rhat = np.asarray(msgs.rhat)[slow]
        _warn(f"round {r + 1}: the chains of {listed(slow)} did not mix (largest split "
              f"r-hat {np.nanmax(rhat):.3g}); their updates were skipped"
              + ("; no client moved q, and the next round samples the same cavities: raise "
                 "num_warmup or num_samples, start from other factors (a one-shot's or "
                 "PVI's), or raise max_rhat" if len(slow) == int(np.sum(active)) else ""))
    warned = record.shrink_warned
    if r > 0 and not warned:
        warned = _check_shrink(names, shrink_factor, r, q_old, q_new, msgs, steps)
    return RoundRecord(tuple(rejected), tuple(unconverged), warned)


class RoundLog:
    """:func:`report` with its record kept on the object (the Pyro port's front): ``rejected``,
    ``unconverged`` and ``shrink_warned`` as lists and a flag."""

    def __init__(self, names: tuple[str, ...], shrink_factor: float):
        self.names = names
        self.shrink_factor = shrink_factor
        self.rejected: list[tuple[int, str, str]] = []
        self.unconverged: list[tuple[int, str]] = []
        self.shrink_warned = False

    def report(self, r: int, steps: np.ndarray, msgs, active: np.ndarray, q_old, q_new) -> None:
        record = report(RoundRecord(tuple(self.rejected), tuple(self.unconverged),
                                    self.shrink_warned), self.names, self.shrink_factor, r,
                        steps, msgs, active, q_old, q_new)
        self.rejected, self.unconverged = list(record.rejected), list(record.unconverged)
        self.shrink_warned = record.shrink_warned


def _check_shrink(names, shrink_factor, r, q_old, q_new, msgs, steps) -> bool:
    """Warn if q's uncertainty collapsed this round; whether it did."""
    sd_old, sd_new = _marginal_sds(q_old), _marginal_sds(q_new)
    ratio = sd_new / sd_old
    worst, geo = float(np.min(ratio)), float(np.exp(np.mean(np.log(ratio))))
    if worst >= 1 / shrink_factor and geo >= 1 / shrink_factor:
        return False
    # each client's own pull: the largest relative rise its delta gives a diagonal precision
    prec_old = np.asarray(q_old.prec)
    dprec = np.asarray(msgs.delta.prec)
    if dprec.ndim == 3:
        prec_old, dprec = np.diagonal(prec_old), np.diagonal(dprec, axis1=1, axis2=2)
    pull = np.max(np.maximum(np.asarray(steps), 0.0)[:, None] * dprec / prec_old, axis=1)
    top = np.argsort(-pull)[:5]
    top = top[pull[top] > 0]
    _warn(f"round {r + 1}: q's uncertainty collapsed (a marginal sd fell to {worst:.3g} of "
          f"its value, the geometric mean of the sds to {geo:.3g}); the updates that shrink "
          f"it most are from {', '.join(names[k] for k in top) or 'no single client'}. This "
          "is the first such round; later ones are not reported")
    return True


def _marginal_sds(q) -> np.ndarray:
    """q's marginal sds from its precision (a vector for a diagonal Gaussian)."""
    prec = np.asarray(q.prec, float)
    return np.sqrt(1.0 / prec if prec.ndim == 1 else np.diagonal(np.linalg.inv(prec)))


def unfinished(history: Mapping[str, Any], names: Sequence[str]) -> None:
    """Warn, naming them, when clients' last local steps in the run stopped at their cap
    (``history["converged"]`` 0 in the last round each took part in): the answer rests on those
    steps. A step cut short in an earlier round is finished by the rounds after it (PVI's fixed
    point does not depend on the path), so it is recorded (``result.unconverged``) and not
    reported."""
    converged = np.asarray(history.get("converged", ()), float)
    if converged.ndim != 2 or not len(converged):
        return
    iterations = np.asarray(history.get("local_iterations", np.zeros_like(converged)), float)
    slow, most = [], 0
    for k in range(converged.shape[1]):
        taken = np.nonzero(~np.isnan(converged[:, k]))[0]
        if len(taken) and converged[taken[-1], k] == 0:
            slow.append(names[k])
            most = max(most, int(iterations[taken[-1], k]))
    if slow:
        _warn(f"the local steps of {', '.join(slow)} did not converge in the last round they "
              f"took part in (after {most} iterations), and the answer rests on them: run more "
              "rounds (a step cut short in an earlier round is finished by the later ones) or "
              "raise local_steps; result.unconverged lists every unfinished step")


def _warn(message: str) -> None:
    validation.warn(message, RuntimeWarning)
