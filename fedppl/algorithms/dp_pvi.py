"""Differentially private PVI (Heikkilä, Ashman, Swaroop, Turner and Honkela, TMLR 2023).

A client's message is a function of its local optimum ``q_k`` and of what the server already
published (``q``, the client's earlier factor), so making ``q_k`` differentially private with
respect to the client's own records makes every message private, whatever the server does.
Three ways to do that (the paper's variants), each a setting of :class:`fedppl.PVI`'s ``privacy=``:

* :class:`DPOptimisation` -- the local free energy is maximised by DP-SGD: every step takes
  each sampled record's gradient of its expected log-likelihood (``vmap`` over records),
  clips it to L2 norm ``clip``, sums, adds ``N(0, (noise_multiplier * clip)^2)`` to each
  coordinate and scales the sum up by the sampling rate; the KL to the cavity holds no data and
  keeps its exact gradient. Records are sampled each step by Poisson sampling with
  ``sampling_rate`` (default 1: every record, every step) or, with ``batch_size``, ``batch_size``
  of them without replacement. The guarantee holds for each client's records, against
  everyone else, for all its steps and rounds.
* :class:`DPLocalAveraging` -- perturbation of the global update: each record belongs to one of
  ``shards`` disjoint shards (a label drawn once for the record, independent of the data); every
  shard fits the client's local problem on its own records, its likelihood scaled up to the
  client's size, starting from ``q``; each shard's change in the guide's parameters (mean and
  log-scale, or the Cholesky factor's raw entries) is clipped to ``clip``; the client sends the
  average of the clipped changes plus ``N(0, (noise_multiplier * clip / shards)^2)``. One record
  moves one shard's change, by at most ``clip``: a Gaussian mechanism per round. Noise in these
  parameters cannot make ``q_k`` improper, so nothing needs repairing.
* :class:`DPVirtualParties` -- perturbation of the global update by virtual parties: the
  client's records are split as above among ``parties`` parties, each with its own factor
  (they sum to the client's factor and never leave it); every party takes a PVI step on its
  own records against its own cavity, its change of factor in natural parameters is clipped
  to ``clip`` and noised, and the client sends the sum, whose noise is
  ``N(0, (noise_multiplier * clip)^2)``: again one Gaussian mechanism per round. With
  ``distributed=t`` under secure aggregation (:class:`fedppl.runtime.SecureAggregation`, or
  ``Task(secure=...)`` on Flower) each client adds only ``1/t`` of that noise variance and
  sends a message linear in its noise
  (:class:`~fedppl.algorithms.dp_mechanisms.NoisyMessage`), so that every total the server can
  decode (at least ``t`` clients' messages) carries the noise the accounting assumes, while no
  single message does.

Accounting (:mod:`fedppl.accounting`, ``dp_accounting``): DP-SGD composes ``local_steps`` x
rounds subsampled Gaussian mechanisms per client (Poisson subsampling with add/remove-one
neighbours; fixed-size sampling without replacement with replace-one neighbours); local
averaging and virtual parties compose one Gaussian mechanism per round. A client counts only
the rounds it took part in. Give either ``noise_multiplier`` or a target ``epsilon`` with the
number of ``rounds``; the multiplier is then calibrated for the client whose guarantee is
weakest (the smallest, with ``batch_size``). A run asked for more rounds than ``rounds``
refuses before any client runs.

What a private run gives up: the server's line search (it would score candidate q on the
clients' data) is off, the ELBO history is not computed, and a message's diagnostics (local
free energy, convergence) are not sent: ``free_energy`` is NaN and every solve reports
converged. Models with local latent sites are not supported (their records' gradients involve
the client's private guide; use the non-private PVI for them).

Distributed noise (``DPVirtualParties(distributed=t)``): the server of a secure round decodes
only a total ``T = sum_k m_k`` of ``n >= t`` messages, each ``m_k = damping * (S_k + nu_k)``
with ``S_k`` the sum of client ``k``'s clipped party changes (non-finite ones zeroed; one
record moves ``S_k`` by at most ``clip``) and ``nu_k ~ N(0, (noise_multiplier * clip)^2 / t)``
per entry. ``T`` is then the Gaussian mechanism the accounting counts (its noise variance
``n / t >= 1`` times the assumed one), and a client's message alone is one with multiplier
``noise_multiplier / sqrt(t)`` (``result.privacy["message_epsilon"]``: the guarantee against
anyone who sees one message, e.g. a server that breaks SecAgg+ by colluding with enough
clients). The message must stay linear in its noise for the first statement, so a client
does not halve its step to keep ``q`` proper (the server does, on the total, also keeping at
least half of ``q``'s precision in every direction) and does not
withhold a noisy message that fails the server's plausibility rules (it withholds only one not
finite or beyond the encoding's ``scale``). Each message states the share of the assumed
noise it carries (``1/t``), and the server refuses a total whose shares add up to less than 1
(fewer than ``t`` clients in it).

Example (4 clients, 2 rounds, DP-SGD at a target epsilon of 4)::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import logistic_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(400, 2)); y = (X[:, 0] > 0) * 1.0
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=4, seed=0)
    >>> dp = fedppl.DPOptimisation(clip=1.0, epsilon=4.0, delta=1e-5, rounds=2,
    ...                            sampling_rate=0.2)
    >>> pvi = fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", privacy=dp,
    ...                  local_steps=20)
    >>> result = pvi.run(jax.random.key(0), clients, 2, progress_bar=False)
    >>> bool(result.privacy["worst_epsilon"] <= 4.0), result.history["epsilon"].shape
    (True, (2, 4))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedppl import accounting
from fedppl.algorithms.dp_mechanisms import DPSGD, LocalAveragingSolver, VirtualPartiesSolver
from fedppl.algorithms.pvi import VariationalSolver
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide

if TYPE_CHECKING:
    import dp_accounting

__all__ = ["DPOptimisation", "DPLocalAveraging", "DPVirtualParties"]


# -- the settings a user gives ----------------------------------------------------------------


def _positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class _Privacy:
    """What both variants share: clipping, the noise or the target, and the accounting."""

    clip: float
    epsilon: float | None = None
    delta: float = 1e-5
    noise_multiplier: float | None = None
    rounds: int | None = None
    accounting: str = "rdp"

    def __post_init__(self) -> None:
        clip = float(self.clip)
        if not clip > 0.0:
            raise ValueError(f"clip must be positive (math.inf turns clipping off), got "
                             f"{self.clip}")
        accounting.check_delta(self.delta)
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of epsilon (a target, with rounds) and "
                             "noise_multiplier")
        if self.epsilon is not None:
            accounting.check_epsilon(self.epsilon)
            if self.rounds is None:
                raise ValueError("a target epsilon needs the number of rounds it must last: "
                                 "give rounds=")
        if self.noise_multiplier is not None:
            s = float(self.noise_multiplier)
            if not (s >= 0.0 and math.isfinite(s)):
                raise ValueError(f"noise_multiplier must be finite and >= 0, got "
                                 f"{self.noise_multiplier}")
            if s > 0.0 and math.isinf(clip):
                raise ValueError("noise needs a finite clip: the noise's scale is "
                                 "noise_multiplier * clip")
        if self.epsilon is not None and math.isinf(clip) and math.isfinite(self.epsilon):
            raise ValueError("a finite epsilon needs a finite clip")
        if self.rounds is not None:
            _positive_int(self.rounds, "rounds")
        if self.accounting not in accounting.METHODS:
            raise ValueError(f"accounting must be one of {accounting.METHODS}, got "
                             f"{self.accounting!r}")

    def round_event(self, sigma: float, size: int, steps: int) -> dp_accounting.DpEvent:
        """What one round costs one client holding ``size`` records: here one Gaussian
        mechanism (the global-update variants); DP-SGD composes its steps."""
        import dp_accounting

        return dp_accounting.GaussianDpEvent(sigma)

    def event(self, sigma: float, rounds: int, size: int, steps: int) -> dp_accounting.DpEvent:
        """``rounds`` rounds of one client holding ``size`` records."""
        import dp_accounting

        if rounds == 0:
            return dp_accounting.NoOpDpEvent()
        if sigma == 0.0:
            return dp_accounting.NonPrivateDpEvent()
        return dp_accounting.SelfComposedDpEvent(self.round_event(sigma, size, steps), rounds)

    def calibrated(self, sizes: np.ndarray, steps: int) -> float:
        """The noise multiplier: as given, or the smallest that keeps every client within the
        target after ``rounds`` rounds (checked before any client runs)."""
        self.check_sizes(sizes)
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        assert self.epsilon is not None and self.rounds is not None
        rounds, worst = self.rounds, int(np.min(sizes))
        return accounting.calibrate(lambda s: self.event(s, rounds, worst, steps),
                                    float(self.epsilon), self.delta, self.accounting)

    def check_sizes(self, sizes: np.ndarray) -> None:
        """Settings that some client's number of records cannot meet."""

    def check_rounds(self, done: int, more: int) -> None:
        """A clear error, before any client runs, when the target's rounds are spent."""
        if self.epsilon is not None and self.rounds is not None and done + more > self.rounds:
            raise ValueError(
                f"the privacy budget (epsilon={self.epsilon}, delta={self.delta}) was calibrated "
                f"for {self.rounds} rounds; {done} are done and {more} more were asked for")

    def spent(self, sigma: float, counts: np.ndarray, sizes: np.ndarray, steps: int
              ) -> np.ndarray:
        """Each client's epsilon after taking part in ``counts[k]`` rounds (each distinct
        round count and size accounted once per run: :func:`_spent`)."""
        return np.array([_spent(self, float(sigma), int(c),
                                int(n) if self.size_matters else 0, int(steps))
                         for c, n in zip(counts, sizes, strict=True)])

    size_matters = False


@functools.lru_cache(maxsize=4096)
def _spent(privacy: _Privacy, sigma: float, rounds: int, size: int, steps: int) -> float:
    return accounting.epsilon(privacy.event(sigma, rounds, size, steps), privacy.delta,
                              privacy.accounting)


@dataclass(frozen=True)
class DPOptimisation(_Privacy):
    """DP-SGD as each client's local step (see the module's text).

    :param clip: per-record gradient norm bound ``C`` (``math.inf``: no clipping).
    :param epsilon: target epsilon per client after ``rounds`` rounds (or ``noise_multiplier``).
    :param delta: the ``delta`` of the guarantee.
    :param noise_multiplier: the Gaussian noise's standard deviation over ``C``.
    :param rounds: rounds the target must last.
    :param sampling_rate: Poisson sampling probability of each record at each step.
    :param batch_size: instead, records drawn without replacement at each step.
    :param accounting: ``"rdp"`` or ``"pld"``.
    """

    sampling_rate: float = 1.0
    batch_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < float(self.sampling_rate) <= 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1], got {self.sampling_rate}")
        if self.batch_size is not None:
            _positive_int(self.batch_size, "batch_size")
            if self.sampling_rate != 1.0:
                raise ValueError("give sampling_rate (Poisson sampling) or batch_size "
                                 "(fixed-size sampling), not both")

    @property
    def size_matters(self) -> bool:  # type: ignore[override]
        return self.batch_size is not None

    def round_event(self, sigma, size, steps):
        import dp_accounting

        one = dp_accounting.GaussianDpEvent(sigma)
        if self.batch_size is not None:
            if self.batch_size < size:
                one = dp_accounting.SampledWithoutReplacementDpEvent(size, self.batch_size, one)
        elif self.sampling_rate < 1.0:
            one = dp_accounting.PoissonSampledDpEvent(self.sampling_rate, one)
        return dp_accounting.SelfComposedDpEvent(one, steps)

    def check_sizes(self, sizes):
        if self.batch_size is not None and np.min(sizes) < self.batch_size:
            k = int(np.argmin(sizes))
            raise ValueError(f"batch_size={self.batch_size} but client {k} holds only "
                             f"{int(sizes[k])} records")

    def solver(self, model: Callable, guide: PVIGuide, optimizer: optax.GradientTransformation,
               steps: int, num_particles: int, sigma: float):
        gradient = DPSGD(model, guide, num_particles, float(self.clip), sigma,
                         float(self.sampling_rate), self.batch_size)
        return VariationalSolver(model, guide, optimizer, steps, num_particles,
                                 gradient=cast(Callable, gradient))


@dataclass(frozen=True)
class DPLocalAveraging(_Privacy):
    """Perturbation of each client's global update by local averaging over ``shards`` disjoint
    shards of its records (see the module's text); ``clip`` bounds one shard's change in the
    guide's parameters."""

    shards: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(self.shards, "shards")

    def solver(self, model: Callable, guide: PVIGuide, optimizer: optax.GradientTransformation,
               steps: int, num_particles: int, sigma: float):
        return LocalAveragingSolver(model, guide, optimizer, steps, num_particles,
                                    float(self.clip), sigma, self.shards)


@dataclass(frozen=True)
class DPVirtualParties(_Privacy):
    """Perturbation of each client's global update by ``parties`` virtual parties: the client's
    records are split into ``parties`` disjoint shards, each a party with its own factor (the
    factors sum to the client's); each party runs a PVI step on its own records against its own
    cavity, and its change of factor (natural parameters) is clipped to ``clip`` and noised
    with ``N(0, (noise_multiplier * clip)^2 / parties)``; the client sends the sum. One record
    moves one party's change, by at most ``clip``, and the noises add up to
    ``N(0, (noise_multiplier * clip)^2)``: a Gaussian mechanism per round. The parties'
    factors stay with the client.

    ``distributed=t``: the noise is shared among at least ``t`` clients whose messages the
    server sees only summed (secure aggregation; refused on any other runtime): each client adds
    ``1/t`` of the noise variance, and its message stays linear in its noise (module text)."""

    parties: int = 10
    distributed: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(self.parties, "parties")
        if self.distributed is not None:
            _positive_int(self.distributed, "distributed")

    def split(self, factors: g.Gaussian) -> g.Gaussian:
        """The parties' first factors: each client's factor shared equally (client axis 0,
        parties axis 1), so that they sum to it."""
        return jax.tree_util.tree_map(
            lambda t: jnp.repeat((t / self.parties)[:, None], self.parties, axis=1), factors)

    def solver(self, model: Callable, guide: PVIGuide, optimizer: optax.GradientTransformation,
               steps: int, num_particles: int, sigma: float):
        return VirtualPartiesSolver(model, guide, optimizer, steps, num_particles,
                                    float(self.clip), sigma, self.parties, self.distributed)

    def message_multiplier(self, sigma: float) -> float:
        """The noise multiplier of one client's message alone: ``sigma``, or
        ``sigma / sqrt(distributed)`` when the noise is distributed."""
        return sigma if self.distributed is None else sigma / math.sqrt(self.distributed)
