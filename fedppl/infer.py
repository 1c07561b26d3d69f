"""``PVI`` and ``GlobalVI``: run federated (or pooled) variational inference on a NumPyro model.

Example::

    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=10, seed=0)
    >>> pvi = fedppl.PVI(model, PVIGuide(model), schedule="synchronous", damping=0.5,
    ...                  optimizer=optax.adam(1e-2), local_steps=200)
    >>> result = pvi.run(jax.random.key(0), clients, num_rounds=20)
    >>> samples = result.sample(jax.random.key(1), 1000)      # {"w": (1000, D)}
    >>> reference = fedppl.GlobalVI(model, PVIGuide(model)).run(jax.random.key(0), clients)
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array
from tqdm.auto import tqdm

from fedppl.algorithms import conjugate, polya_gamma, pvi
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.runtime.embedded import make_round

__all__ = ["PVI", "GlobalVI", "PVIResult"]


@dataclass
class PVIResult:
    """The outcome of a run: the posterior ``q``, the client factors and per-round history.

    ``history`` maps to arrays with one row per round: ``free_energy`` (rounds, K) local free
    energies, ``elbo`` global ELBO estimate, ``messages_up``/``messages_down`` and
    ``bytes_up``/``bytes_down`` (per round), ``seconds``. ``rejected`` lists
    ``(round, client, reason)`` for updates the server refused.
    """

    guide: PVIGuide
    q: g.Gaussian
    factors: g.Gaussian
    history: dict[str, np.ndarray]
    rejected: list[tuple[int, str, str]] = field(default_factory=list)
    client_names: tuple[str, ...] = ()

    @property
    def posterior(self) -> dict[str, Any]:
        """Per-site marginal distributions (constrained space)."""
        return self.guide.posterior(self.q)

    def sample(self, rng_key: Array, num_samples: int) -> dict[str, Array]:
        """Joint posterior draws keyed by site name, constrained: ``{name: (num_samples, ...)}``."""
        return self.guide.sample(rng_key, self.q, num_samples)

    def mean_and_cov(self) -> tuple[Array, Array]:
        """Mean and covariance of q over the flat unconstrained vector."""
        return g.to_moments(self.q)

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000):
        """An ``arviz.InferenceData`` (needs ``pip install fedppl[arviz]``)."""
        from fedppl.arviz import to_inference_data

        return to_inference_data(self, rng_key, num_samples)


class PVI:
    """Partitioned variational inference over the global sites of a NumPyro model.

    :param model: an ordinary NumPyro model, called as ``model(*client_arrays)``; per-datum
        observations must sit in a plate over the data (``numpyro.plate("data", N)``).
    :param guide: a :class:`~fedppl.guides.PVIGuide` for the model.
    :param schedule: ``"sequential"`` (clients in turn), ``"synchronous"`` (all at once, vmapped)
        or ``"loop"`` (synchronous with a Python loop: for benchmarks).
    :param damping: ``rho`` in (0, 1]: a factor moves ``rho`` of the way to its new value.
    :param optimizer: optax optimiser for the local free energy (default ``adam(1e-2)``).
    :param local_steps: optimiser steps per client update.
    :param num_particles: Monte Carlo samples per ELBO estimate.
    :param conjugate: ``"auto"`` uses the closed-form update when the likelihood is Gaussian and
        affine in the global sites; ``True`` requires it; ``False`` never uses it;
        ``"polya-gamma"`` uses closed-form Polya-Gamma CAVI updates for Bernoulli-logit models
        (the Jaakkola-Jordan bound; ``local_steps`` caps the CAVI sweeps), see
        :mod:`fedppl.algorithms.polya_gamma`.
    :param elbo_samples: Monte Carlo samples for the per-round global ELBO (0 to skip it).
    :param clients_per_round: if given, that many clients, drawn at random each round, take part;
        the others send nothing and keep their factors (client sampling, or clients that dropped
        out of the round).
    """

    def __init__(self, model: Callable, guide: PVIGuide, schedule: str = "sequential",
                 damping: float = 1.0, optimizer: optax.GradientTransformation | None = None,
                 local_steps: int = 200, num_particles: int = 8, conjugate: bool | str = "auto",
                 elbo_samples: int = 64, clients_per_round: int | None = None):
        if not 0.0 < damping <= 1.0:
            raise ValueError(f"damping must be in (0, 1], got {damping}")
        if conjugate not in ("auto", True, False, "polya-gamma"):
            raise ValueError("conjugate must be 'auto', True, False or 'polya-gamma', got "
                             f"{conjugate!r}")
        if local_steps < 1 or num_particles < 1:
            raise ValueError("local_steps and num_particles must be positive")
        self.model = model
        self.guide = guide
        self.schedule = schedule
        self.damping = float(damping)
        self.optimizer = optimizer if optimizer is not None else optax.adam(1e-2)
        self.local_steps = int(local_steps)
        self.num_particles = int(num_particles)
        self.conjugate = conjugate
        self.elbo_samples = int(elbo_samples)
        if clients_per_round is not None and clients_per_round < 1:
            raise ValueError(f"clients_per_round must be positive, got {clients_per_round}")
        self.clients_per_round = clients_per_round
        self._compiled: dict = {}  # round and ELBO functions, reused by later runs

    # -- set-up --------------------------------------------------------------------------------

    def _solver(self, clients: Clients) -> pvi.LocalSolver:
        data = tuple(a[0] for a in clients.stacked)
        self.guide.setup(*clients.client(0))
        if self.conjugate == "polya-gamma":
            polya_gamma.validate(self.model, self.guide, clients)
            return polya_gamma.PolyaGammaSolver(self.model, self.guide, self.local_steps)
        if self.conjugate is not False:
            reason = conjugate.check(client(self.model, mask=clients.mask[0]), self.guide.layout,
                                     *data)
            if reason is None:
                return pvi.ConjugateSolver(self.model, self.guide)
            if self.conjugate is True:
                raise ValueError(f"conjugate=True but the model is not conjugate: {reason}")
        return pvi.VariationalSolver(self.model, self.guide, self.optimizer, self.local_steps,
                                     self.num_particles)

    def init_factors(self, num_clients: int) -> g.Gaussian:
        """Flat factors ``t_k = 1`` for every client (q starts at the prior)."""
        zero = g.zeros_like(self.guide.prior)
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape),
                                      zero)

    # -- running -------------------------------------------------------------------------------

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, progress_bar: bool = True,
            factors: g.Gaussian | None = None) -> PVIResult:
        """Run ``num_rounds`` rounds of PVI; ``factors`` resumes from earlier client factors."""
        if not isinstance(clients, Clients):
            raise TypeError("clients must be a fedppl.Clients (see fedppl.partition)")
        if num_rounds < 1:
            raise ValueError(f"num_rounds must be positive, got {num_rounds}")
        solver = self._solver(clients)
        K = clients.num_clients
        factors = self.init_factors(K) if factors is None else g.strong(factors)
        state = pvi.init(self.guide.prior, factors)
        data, masks = clients.stacked, clients.mask
        if solver not in self._compiled:
            self._compiled[solver] = (make_round(solver, self.damping, self.schedule),
                                      self._elbo_fn(solver) if self.elbo_samples > 0 else None)
        round_fn, elbo_fn = self._compiled[solver]
        down = g.num_bytes(state.q)
        up = g.num_bytes(jax.tree_util.tree_map(lambda x: x[0], factors))
        hist: dict[str, list] = {k: [] for k in ("free_energy", "elbo", "messages_up",
                                                 "messages_down", "bytes_up", "bytes_down",
                                                 "seconds")}
        rejected: list[tuple[int, str, str]] = []
        bar = tqdm(range(num_rounds), desc=f"PVI ({self.schedule})", disable=not progress_bar,
                   leave=False)
        for r in bar:
            rng_key, k_round, k_elbo, k_pick = jax.random.split(rng_key, 4)
            active = self._participants(k_pick, K)
            t0 = time.perf_counter()
            state, factors, msgs, steps = round_fn(state, factors, data, masks, k_round, active)
            jax.block_until_ready(state.q)
            hist["seconds"].append(time.perf_counter() - t0)
            active = np.asarray(active)
            self._report(r, clients, np.asarray(steps), np.asarray(msgs.cavity_repaired),
                         active, rejected)
            hist["free_energy"].append(np.where(active, np.asarray(msgs.free_energy), np.nan))
            n = int(active.sum())
            hist["messages_up"].append(n)
            hist["messages_down"].append(n)
            hist["bytes_up"].append(n * up)
            hist["bytes_down"].append(n * down)
            elbo = float(elbo_fn(state.q, data, masks, k_elbo)) if elbo_fn else np.nan
            hist["elbo"].append(elbo)
            bar.set_postfix(elbo=f"{elbo:.4g}")
        return PVIResult(self.guide, state.q, factors, {k: np.asarray(v) for k, v in hist.items()},
                         rejected, clients.names)

    def _participants(self, key: Array, num_clients: int) -> Array:
        """Booleans marking this round's clients (all, or a random ``clients_per_round``)."""
        m = self.clients_per_round
        if m is None or m >= num_clients:
            return jnp.ones(num_clients, bool)
        chosen = jax.random.permutation(key, num_clients)[:m]
        return jnp.zeros(num_clients, bool).at[chosen].set(True)

    @staticmethod
    def _report(r: int, clients: Clients, steps: np.ndarray, repaired: np.ndarray,
                active: np.ndarray, rejected: list) -> None:
        """One warning per kind of trouble per round, naming the clients."""
        names = clients.names
        bad = np.nonzero(active & (steps == 0))[0]
        reason = "update not finite, or q not positive definite with it"
        for k in bad:
            rejected.append((r + 1, names[k], reason))
        if len(bad):
            warnings.warn(f"round {r + 1}: rejected the updates of {_list(names, bad)} ({reason}); "
                          "their factors are unchanged", RuntimeWarning, stacklevel=3)
        shrunk = np.nonzero((steps > 0) & (steps < 1))[0]
        if len(shrunk):
            warnings.warn(f"round {r + 1}: updates of {_list(names, shrunk)} applied with step "
                          f"{steps[shrunk].min():.3g} to keep q positive definite",
                          RuntimeWarning, stacklevel=3)
        fixed = np.nonzero(active & repaired)[0]
        if len(fixed):
            warnings.warn(f"round {r + 1}: cavities of {_list(names, fixed)} were not positive "
                          "definite and were repaired (eigenvalues clipped)", RuntimeWarning,
                          stacklevel=3)

    def _elbo_fn(self, solver: pvi.LocalSolver):
        """Jitted global ELBO ``sum_k E_q[log p(y_k | theta)] - KL(q || prior)``."""
        guide, model, S = self.guide, self.model, self.elbo_samples

        if isinstance(solver, pvi.ConjugateSolver):

            def per_client(q, data_k, mask_k, key):
                lik = conjugate.likelihood_terms(client(model, mask=mask_k), guide.layout, *data_k)
                mean, cov = g.to_moments(g.to_full(q))
                return conjugate.expected_log_lik(lik, mean, cov)

        else:

            def per_client(q, data_k, mask_k, key):
                theta = g.sample(key, q, S)
                values = guide.layout.constrain(theta)
                ll = jax.vmap(lambda v: pvi.observed_log_lik(client(model, mask=mask_k), v,
                                                             *data_k))(values)
                return jnp.mean(ll)

        @jax.jit
        def elbo(q, data, masks, key):
            keys = jax.random.split(key, masks.shape[0])
            ell = jax.vmap(per_client, in_axes=(None, 0, 0, 0))(q, data, masks, keys)
            return jnp.sum(ell) - g.kl(q, guide.prior)

        return elbo


def _list(names: tuple[str, ...], idx: np.ndarray) -> str:
    return ", ".join(names[k] for k in idx)


class GlobalVI:
    """The same guide family fitted to the pooled data: the answer PVI converges to.

    Implemented as PVI with one client holding all the data (its cavity is the prior, so its local
    free energy is the global ELBO). ``run`` accepts :class:`Clients` (pooled first) or the model's
    arrays as a tuple.
    """

    def __init__(self, model: Callable, guide: PVIGuide,
                 optimizer: optax.GradientTransformation | None = None, num_steps: int = 2000,
                 num_particles: int = 8, conjugate: bool | str = "auto", elbo_samples: int = 64):
        self._pvi = PVI(model, guide, "sequential", 1.0, optimizer, num_steps, num_particles,
                        conjugate, elbo_samples)

    def run(self, rng_key: Array, data: Clients | tuple, progress_bar: bool = False) -> PVIResult:
        pooled = data.pooled() if isinstance(data, Clients) else Clients.from_list([data])
        return self._pvi.run(rng_key, pooled, 1, progress_bar=progress_bar)
