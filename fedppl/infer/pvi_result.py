"""``PVIResult``: what PVI, GlobalVI, EP and OneShot return (a Gaussian ``q`` over a NumPyro
model's global sites, the clients' factors, the run's history), and its check against the
pooled posterior (:meth:`PVIResult.check`, :meth:`PVIResult.refine`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax
import numpy as np
from jax import Array

from fedppl.algorithms.solvers import BoundModel
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.infer.base import Result

__all__ = ["PVIResult"]


def _say(enabled: bool, line: str) -> None:
    """One line on stderr that stays (as a run's "stopped" line), when ``enabled``."""
    import sys

    from tqdm import tqdm

    if enabled:
        tqdm.write(line, file=sys.stderr)


@dataclass(kw_only=True)
class PVIResult(Result):
    """The outcome of a run: the posterior ``q``, the client factors and per-round history.

    ``history`` maps to arrays with one row per round: ``free_energy`` (rounds, K) local free
    energies, ``converged`` (rounds, K; 1, 0, or NaN for a client not in the round) whether each
    local step met its tolerance, ``local_iterations`` (rounds, K), ``kl_change`` the KL from
    the previous round's q to this round's (how far q still moves), ``elbo`` global ELBO
    estimate, ``messages_up``/``messages_down`` and ``bytes_up``/``bytes_down`` (per round),
    ``seconds``, ``step`` (rounds, K) the step each client's update was applied with (1 in
    full, less when the server shrank it, 0 when it refused it). ``rejected`` lists
    ``(round, client, reason)`` for updates the server refused; ``unconverged`` lists
    ``(round, client)`` for local steps that stopped at their cap. A private run (``privacy=``)
    adds ``epsilon`` (rounds, K): each client's cumulative epsilon after each round.
    """

    guide: PVIGuide
    q: g.Gaussian
    factors: g.Gaussian
    unconverged: list[tuple[int, str]] = field(default_factory=list)
    local: g.Conditional | None = None  # the clients' private guides, stacked (local sites)
    # (K, d) booleans: the local coordinates each client's data touch (the groups it holds);
    # ``local`` is a posterior only there, and sample() draws the others from the model's prior
    # given the global sites, running the model on ``prototype`` (client 0's arrays)
    held: Array | None = None
    prototype: tuple | None = None
    prior_factor: g.Gaussian | None = None  # the server's t_0 (non-Gaussian priors)
    model: Callable | None = None  # the model as run (static keyword arguments bound)
    # a private run's guarantee: per-client ``epsilon``, ``worst_epsilon``, ``delta``,
    # ``noise_multiplier`` (see fedppl.algorithms.dp_pvi); None for a non-private run
    privacy: dict[str, Any] | None = None
    # history entries (rounds, K) that to_arviz exports per client for the last round
    client_stats: ClassVar[tuple[str, ...]] = ()

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(self.guide.roles())
        if self.privacy is not None:  # the guarantee travels with the result's summary
            out.update(epsilon=self.privacy["worst_epsilon"], delta=self.privacy["delta"])
        return out

    @property
    def posterior(self) -> dict[str, Any]:
        """Per-site marginal distributions of the global sites (constrained space)."""
        return self.guide.posterior(self.q)

    def sample(self, rng_key: Array, num_samples: int, client: int | str | None = None
               ) -> dict[str, Array]:
        """Joint posterior draws keyed by site name, constrained: ``{name: (num_samples, ...)}``.

        ``client`` (an index or a name) adds that client's local sites given each draw of the
        global ones: from its private guide for the groups it holds data for, from the model's
        prior given the global sites for the others (what the pooled posterior says of a group
        without data)."""
        if client is None:
            return self.guide.sample(rng_key, self.q, num_samples)
        k = self._client_index(client, self.factors.nat1.shape[0])
        if self.guide.local_layout is None:  # no local sites: every client's draws are q's
            return self.guide.sample(rng_key, self.q, num_samples)
        self._local_or_raise()
        return self._with_local(rng_key, num_samples, k)

    def sample_clients(self, rng_key: Array, num_samples: int) -> dict[str, Array]:
        """Joint draws with every client's local sites, their client axis after the draw axis
        (``{"a": (num_samples, K, ...)}``), given the same draws of the global ones (as
        :meth:`to_arviz` exports them)."""
        if self.guide.local_layout is None:
            return self.guide.sample(rng_key, self.q, num_samples)
        self._local_or_raise()
        return self._with_local(rng_key, num_samples, slice(None))

    def _local_or_raise(self) -> None:
        if self.local is None:
            raise ValueError("the clients' private guides over their local sites stayed with "
                             "them (a runtime whose server does not hold the data): this "
                             "result has the global sites only; sample without client=")

    def _with_local(self, rng_key: Array, num_samples: int, k: int | slice) -> dict[str, Array]:
        assert self.local is not None
        local = jax.tree_util.tree_map(lambda x: x[k], self.local)
        draws = self.guide.sample(rng_key, self.q, num_samples, local)
        if self.held is None or self.prototype is None or bool(jax.numpy.all(self.held[k])):
            return draws
        model = self.model if self.model is not None else self.guide.model
        return self.guide.unheld_from_prior(jax.random.fold_in(rng_key, 2), draws, self.held[k],
                                            model, self.prototype)

    def predictive(self, rng_key: Array, *args: Any, num_samples: int = 1000,
                   client: int | str | None = None, **kwargs: Any) -> dict[str, Array]:
        """Posterior predictive draws of the model at new inputs (numpyro's ``Predictive`` with
        this posterior's draws; ``client`` uses that client's local sites). Pass the model's
        arguments with ``y=None`` (or without the observations) to predict them."""
        from numpyro.infer import Predictive

        key_post, key_pred = jax.random.split(rng_key)
        draws = self.sample(key_post, num_samples, client)
        model = self.model if self.model is not None else self.guide.model
        return Predictive(model, posterior_samples=draws)(key_pred, *args, **kwargs)

    def mean_and_cov(self) -> tuple[Array, Array]:
        """Mean and covariance of q over the flat unconstrained vector."""
        return g.to_moments(self.q)

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000):
        """An ``xarray.DataTree`` for ArviZ 1.x (``arviz_base.from_dict``; needs
        ``pip install 'fedppl[arviz]'``): ``num_samples`` draws of q as
        :data:`fedppl.arviz.NUM_CHAINS` chains, local sites with a ``client`` dimension after
        ``draw`` (every client's, given the same draws of the global ones), the factors per client
        as their natural parameters over the flat unconstrained vector (``factor_nat1``,
        ``factor_prec`` in ``constant_data``: a factor need not be a normalisable
        distribution), the run's history in the posterior's attributes, and the history entries
        a result names in ``client_stats`` (EP: its sampler's ``rhat``, ``ess``, ``mc_error``)
        as ``last_<name>``, the last round's value per client."""
        from fedppl.arviz import as_chains, check_num_samples, from_dict, history_attrs

        num_samples = check_num_samples(num_samples)
        rng_key = jax.random.key(0) if rng_key is None else rng_key
        draws = (self.sample(rng_key, num_samples) if self.local is None
                 else self.sample_clients(rng_key, num_samples))
        nat1 = np.asarray(self.factors.nat1)
        full = isinstance(self.factors, g.FullGaussian)
        constant = {"factor_nat1": nat1, "factor_prec": np.asarray(self.factors.prec)}
        dims = {"factor_nat1": ["client", "theta"],
                "factor_prec": ["client", "theta", "theta_"] if full else ["client", "theta"]}
        coords: dict[str, list] = {"client": list(self.client_names) or list(range(len(nat1)))}
        if self.local is not None:
            assert self.guide.local_layout is not None
            for site in self.guide.local_layout.sites:
                dims[site.name] = ["client"] + [f"{site.name}_dim_{i}"
                                                for i in range(len(site.shape))]
        for key in self.client_stats:  # per-client statistics of the last round
            values = self.history.get(key)
            if values is not None and len(values):
                constant[f"last_{key}"] = np.asarray(values[-1])
                dims[f"last_{key}"] = ["client"]
        return from_dict({"posterior": {k: as_chains(v) for k, v in draws.items()},
                          "constant_data": constant}, coords=coords, dims=dims,
                         attrs={"posterior": history_attrs(self.history)})

    def check(self, rng_key: Array, clients: Clients, num_draws: int = 1000, *,
              progress_bar: bool = False, **kwargs: Any):
        """How far ``q`` is from the posterior the pooled data give, in one more round: ``S``
        draws of the global sites to every client, ``S`` log-likelihoods back; Pareto k-hat,
        effective sample size and corrected moments (:class:`fedppl.infer.importance.Importance`
        takes the other keyword arguments: ``df``, ``local_draws``, ...; ``runtime`` runs its
        round, as any method's, e.g. :class:`fedppl.runtime.faults.Faults`; the rest are the
        model's static keyword arguments, by default those the run was given). Warns when k-hat
        says the answer is unreliable. Needs ``fedppl[arviz]`` (arviz-stats' PSIS)."""
        return self._importance(rng_key, clients, 1, num_draws, progress_bar, kwargs)

    def refine(self, rng_key: Array, clients: Clients, num_rounds: int | None = None,
               num_draws: int = 1000, *, method: str | None = None, progress_bar: bool = True,
               **kwargs: Any):
        """The pooled posterior, from this answer. ``method``:

        * ``"smc"``: the federated tempered SMC sampler (:class:`fedppl.SMC`, up to
          ``num_rounds`` rounds, default 50), started from ``q`` (and the clients' private guides
          for their local sites); an :class:`~fedppl.infer.smc.SMCResult`;
        * ``"importance"``: the check's exchange repeated (round 1 is the check), each round
          proposing from a t fitted to the weighted draws so far, until k-hat is below
          ``khat_target`` (0.5) and the ESS above ``ess_target`` (2000), or ``num_rounds``
          (default 10); an :class:`~fedppl.infer.importance.ImportanceResult`;
        * None (default): the sampler where the model has local sites (importance weights over
          the global sites would rest on noisy estimates of each client's marginal likelihood)
          or where the check (the importance refinement's first round) flags ``q`` (k-hat above
          the threshold); the importance refinement otherwise, and always on a runtime that
          gives the server only the sum of the clients' messages (secure aggregation, where the
          sampler is refused). The choice and why are in the result's ``chosen`` and, with
          ``progress_bar``, on stderr.

        Keyword arguments are the method's settings (:class:`fedppl.SMC`'s, such as
        ``num_particles``, or :class:`fedppl.Importance`'s, such as ``df``; ``runtime``, the
        runtime of its rounds); the rest are the model's static keyword arguments (by default
        those the run was given)."""
        import inspect

        from fedppl.infer.importance import SETTINGS, khat_threshold
        from fedppl.infer.smc import SMC

        if method not in (None, "smc", "importance"):
            raise ValueError(f"method must be None (choose), 'smc' or 'importance', got "
                             f"{method!r}")
        self._refuse_private("refine")
        sampler = set(inspect.signature(SMC).parameters) - {"model", "guide", "start"}
        warn = kwargs.pop("warn", True)
        stop = kwargs.pop("stop", True)  # the sampler's: False runs all its rounds
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTINGS}
        smc = {k: kwargs.pop(k) for k in list(kwargs) if k in sampler}
        why = ""
        if getattr(kwargs.get("runtime"), "summed", False):  # secure aggregation: sums only
            if method == "smc":
                raise ValueError("the SMC sampler's server needs each client's messages (its "
                                 "log-likelihood estimates at the particles and their checks), "
                                 "and this runtime gives it only their sum (secure "
                                 "aggregation): refine with method='importance', which needs "
                                 "only the sum")
            if method is None:
                method = "importance"
                why = ("the runtime gives the server only the sum of the clients' messages "
                       "(secure aggregation), which the importance refinement needs and the "
                       "sampler does not serve")
        if method is None and self.guide.local_layout is not None:
            method = "smc"
            why = ("the model has local sites, whose marginal likelihood the importance "
                   "refinement could only estimate per draw")
        if method is None:
            check = self._importance(rng_key, clients, num_rounds or 10, num_draws, progress_bar,
                                     {**kwargs, **own, "warn": warn,
                                      "give_up": khat_threshold(num_draws)})
            if check.reliable or check.num_rounds > 1:
                check.chosen = "the check's k-hat is below its threshold: importance refinement"
                _say(progress_bar, f"refine: {check.chosen}")
                return check
            method = "smc"
            why = f"the check flags q (k-hat {check.khat:.2f} above {check.threshold:.2f})"
        if method == "importance":
            result = self._importance(rng_key, clients, num_rounds or 10, num_draws,
                                      progress_bar, {**kwargs, **own, "warn": warn})
            if why:
                result.chosen = f"{why}: the importance refinement"
                _say(progress_bar, f"refine: {result.chosen}")
            return result
        result = self._smc(rng_key, clients, num_rounds or 50, progress_bar, smc, kwargs,
                           warn=bool(warn), stop=bool(stop))
        if why:
            result.chosen = f"{why}: the SMC sampler"
            _say(progress_bar, f"refine: {result.chosen}")
        return result

    def _refuse_private(self, what: str) -> None:
        if self.privacy is not None:
            raise ValueError(f"this run is differentially private, and {what}'s messages (each "
                             "client's log-likelihood at shared draws) are not privatised or "
                             "accounted for: fedppl refuses to use a private run's data again "
                             "rather than spend privacy it has not counted")

    def _model_kwargs(self, kwargs: dict) -> dict:
        # the static keyword arguments the run bound (a model whose parameters are keyword-only
        # is wrapped in positional()'s KeywordData, whose `keywords` are only their names)
        model_kwargs = dict(self.model.keywords) if isinstance(self.model, BoundModel) else {}
        model_kwargs.update(kwargs)
        return model_kwargs

    def _smc(self, rng_key, clients, num_rounds, progress_bar, settings, kwargs, *, warn,
             stop):
        """:class:`~fedppl.infer.smc.SMC` from ``q`` with ``settings`` (split from the model's
        ``kwargs`` by ``refine``)."""
        from fedppl.infer.smc import SMC

        kwargs = dict(kwargs)
        runtime = kwargs.pop("runtime", None)
        method = SMC(self.guide.model, self.guide, self.q, **{"local": self.local, **settings})
        return method.run(rng_key, clients, num_rounds, progress_bar=progress_bar, warn=warn,
                          stop=stop, runtime=runtime, **self._model_kwargs(kwargs))

    def _importance(self, rng_key, clients, num_rounds, num_draws, progress_bar, kwargs):
        from fedppl.infer.importance import SETTINGS, Importance

        self._refuse_private("the check")
        kwargs = dict(kwargs)
        warn = bool(kwargs.pop("warn", True))
        give_up = kwargs.pop("give_up", None)
        settings = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTINGS}
        runtime = kwargs.pop("runtime", None)
        method = Importance(self.guide.model, self.guide, self.q, local=self.local,
                            num_draws=num_draws, **settings)
        return method.run(rng_key, clients, num_rounds, progress_bar=progress_bar,
                          runtime=runtime, warn=warn, give_up=give_up,
                          **self._model_kwargs(kwargs))
