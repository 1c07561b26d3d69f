"""``FederatedSGP``: federated sparse GPs, PVI with an HVM over inducing locations, and baselines.

Methods: ``"dpo"`` / ``"cpo"`` (PVI with q(Z), decoupled or coupled pseudo-observations),
``"fedavg-z"`` (Alg. 1: point Z averaged by the server), ``"fixed"`` (Z fixed at a N(0, I) draw)
and ``"global"`` (centralised SVGP on the pooled data: Z a point initialised at random training
inputs; for a Gaussian likelihood q(u) is Titsias' optimum, for Bernoulli a free Gaussian).
The algorithm is :mod:`fedppl.algorithms.sgp_pvi`'s trio, run by the embedded runtime:
``schedule="sequential"`` takes one client per round, cycling through them (a round is one
communication); ``"synchronous"`` takes every client each round (vmapped, damped).

Example::

    >>> import jax, numpy as np, optax, fedppl
    >>> rng = np.random.default_rng(0)
    >>> X = rng.uniform(-2, 2, (40, 1)); y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=40)
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=2, seed=0)
    >>> sgp = FederatedSGP("dpo", num_inducing=5, local_steps=20, optimizer=optax.adam(1e-2))
    >>> result = sgp.run(jax.random.key(0), clients, num_rounds=2, progress_bar=False)
    >>> mean, var = result.predict(X[:3])
    >>> mean.shape, result.history["round"].tolist(), result.history["communications"].tolist()
    ((3,), [1, 2], [1, 2])
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array
from jax.scipy.special import logsumexp

from fedppl import metrics, trees
from fedppl import validation as check
from fedppl.algorithms import sgp_pvi
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.sgp_guide import Pseudo
from fedppl.infer import _gp_checks as chk
from fedppl.infer.base import FederatedMethod, Plan, Result, RunState, num_bytes, shared

__all__ = ["FederatedSGP", "SGPConfig", "SGPResult", "METHODS", "DPO_DEFAULTS", "PAPER_DPO"]

METHODS = ("dpo", "cpo", "fedavg-z", "fixed", "global")
FREE_ENERGY_KEY = 12345   # common draws for the per-round free energy (a smooth curve)
FREE_ENERGY_SAMPLES = 4


class SGPConfig(NamedTuple):
    """Settings of :class:`FederatedSGP` (each may also be given as a keyword argument).

    ``optimizer``: any optax optimiser for the clients' local steps (and global VI's steps).
    ``schedule``: ``"sequential"`` (one client per round, cycling) or ``"synchronous"``.
    ``inner_steps``: FedAvg-Z's joint steps over (factor, Z) after ``local_steps``.
    ``pseudo_init``: V_k from the client's inputs (``"data"``) or N(0, I) (``"prior"``).
    ``fixed_hyper``: ``{"lengthscale", "variance", "noise"}`` held fixed instead of q(beta).
    ``fixed_inducing``: a point Z held fixed (its rows give M).
    ``init_inducing``: q(Z)'s initial mean (fixed Z's value): ``"random-normal"`` (the paper's
    N(0, I) draw) or ``"pseudo-inputs"``: ``num_inducing`` rows drawn from the clients' initial
    DPO pseudo-inputs, which ``pseudo_init="data"`` takes from their data; so it reveals no row
    that the first messages do not carry already (DPO, FedAvg-Z and fixed Z; not on a deployment,
    whose server holds no data). See the sgp_dpo_diagnosis benchmark page in the docs.
    ``covariance``: DPO's S_k, ``"diag"`` (the paper's), ``"full"``, or ``"noise"``:
    ``noise^2 diag(exp(s))``, so that the pseudo-noise follows the learnt noise.
    ``alpha``: the weight of q(Z)'s KL in the local free energies.
    ``learn_inducing_sd``: learn q(Z)'s sds (the paper) or hold them at their start, learning
    its means only. ``inducing_precision``: q(Z)'s starting precision (``None`` outside DPO:
    ``init_precision``, as in the paper).
    ``alpha``, ``covariance``, ``learn_inducing_sd`` and ``inducing_precision`` left at ``None``
    take the method's defaults: :data:`DPO_DEFAULTS` for ``"dpo"``, :data:`PAPER_DPO` (the
    paper's) for the others; ``FederatedSGP("dpo", **PAPER_DPO)`` is the paper's DPO.
    ``shared_draws``: 0 (the paper's method) or S > 0: every client's local free energy is
    estimated at S draws of ``(beta, Z)`` that the server makes from q once a round, with the
    summed statistics of all clients' factors at each (importance-weighted, see
    :func:`fedppl.algorithms.sgp_pvi.begin_round`): a DPO, fixed-Z or FedAvg-Z round linear in
    K instead of quadratic (each client otherwise sums every other client's pseudo-observations
    at its own draws).
    """

    num_inducing: int = 100
    pseudo_fraction: float = 0.8
    max_pseudo: int = 500
    alpha: float | None = None
    optimizer: optax.GradientTransformation = optax.adam(1e-2)
    local_steps: int = 200
    schedule: str = "sequential"
    damping: float = 1.0
    num_samples: int = 1
    inner_steps: int = 200
    init_precision: float = 100.0
    covariance: str | None = None
    likelihood: str = "gaussian"
    fixed_hyper: dict | None = None
    fixed_inducing: Array | None = None
    pseudo_init: str = "data"
    shared_draws: int = 0
    init_inducing: str = "random-normal"
    learn_inducing_sd: bool | None = None
    inducing_precision: float | None = None


@dataclass(kw_only=True)
class SGPResult(Result):
    """A fitted federated sparse GP. ``history`` (one row per round, round 1 first):
    ``free_energy`` (global alpha-tempered free energy, MC with fixed draws),
    ``local_free_energy`` (K,) (NaN for clients not in the round), ``communications`` and
    ``passes`` (cumulative client updates, and over K), and the common keys."""

    method: str
    state: sgp_pvi.ServerState
    spec: sgp_pvi.Spec

    def _samples(self, X: Any, rng_key: Array | None, num_samples: int):
        X = chk.check_inputs(X, self.spec.input_dim)
        check.positive_int(num_samples, "num_samples")
        key = jax.random.key(1) if rng_key is None else rng_key
        return _predict_jit(self.spec, self.state, jnp.asarray(X), key, num_samples)

    def predict(self, X: Any, rng_key: Array | None = None, num_samples: int = 100
                ) -> tuple[Array, Array]:
        """Mixture mean and variance of y (Gaussian likelihood) or of f (Bernoulli), over
        ``num_samples`` draws of (beta, Z) (fixed draws unless ``rng_key`` is given)."""
        mu, var, noise = self._samples(X, rng_key, num_samples)
        extra = noise[:, None] if self.spec.likelihood == "gaussian" else 0.0
        mean = mu.mean(0)
        return mean, jnp.mean(var + extra + mu**2, 0) - mean**2

    def predict_f(self, X: Any, rng_key: Array | None = None, num_samples: int = 100
                  ) -> tuple[Array, Array]:
        """Mixture mean and variance of the latent f."""
        mu, var, _ = self._samples(X, rng_key, num_samples)
        mean = mu.mean(0)
        return mean, jnp.mean(var + mu**2, 0) - mean**2

    def predict_proba(self, X: Any, rng_key: Array | None = None, num_samples: int = 100
                      ) -> Array:
        """P(y = 1) for the Bernoulli likelihood (Gauss-Hermite over f, averaged over samples)."""
        mu, var, _ = self._samples(X, rng_key, num_samples)
        gx, gw = np.polynomial.hermite_e.hermegauss(32)
        f = mu[..., None] + jnp.sqrt(var)[..., None] * gx
        return jnp.mean(jax.nn.sigmoid(f) @ (gw / np.sqrt(2 * np.pi)), 0)

    def inducing(self) -> tuple[Array, Array]:
        """Mean and standard deviation of q(Z) (zeros for point estimates)."""
        if self.spec.z_mode != "hvm":
            return self.state.z_point, jnp.zeros_like(self.state.z_point)
        return g.mean_and_scale_tril(sgp_pvi.q_z(self.state))

    def log_likelihood(self, X: Any, y: Any, rng_key: Array | None = None,
                       num_samples: int = 100, y_mean: float = 0.0, y_std: float = 1.0) -> float:
        """Average test log-likelihood in original units: log-mean-exp over the (beta, Z) samples
        of N(y_std_scaled; mu_s, var_s + noise_s), minus log(y_std) (Jacobian). Gaussian only."""
        if self.spec.likelihood != "gaussian":
            raise ValueError("log_likelihood is for the Gaussian likelihood; use predict_proba")
        mu, var, noise = self._samples(X, rng_key, num_samples)
        y = jnp.asarray(chk.check_targets(y, mu.shape[1]))
        ys = (y - y_mean) / check.positive(y_std, "y_std")
        v = var + noise[:, None]
        logp = -0.5 * (jnp.log(2 * jnp.pi * v) + (ys - mu) ** 2 / v)
        return float(jnp.mean(logsumexp(logp, 0) - np.log(num_samples)) - np.log(y_std))

    def rmse(self, X: Any, y: Any, rng_key: Array | None = None, num_samples: int = 100,
             y_mean: float = 0.0, y_std: float = 1.0) -> float:
        """Test RMSE of the predictive mean in original units."""
        mean, var = self.predict(X, rng_key, num_samples)
        y = chk.check_targets(y, mean.shape[0])
        return metrics.rmse(y, metrics.unstandardise(mean, var, y_mean, y_std)[0])

    def rounds_to_convergence(self, rel_tol: float = 0.01) -> int | None:
        """First round after which the free energy stays within ``rel_tol`` of its range."""
        return chk.converged_round(self.history["free_energy"], rel_tol)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "method": self.method,
                "free_energy": float(self.history["free_energy"][-1]),
                "rounds_to_convergence": self.rounds_to_convergence()}

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000):
        """Posterior draws of the hyperparameters (where q(beta) is learnt), the inducing
        locations (where q(Z) is), and the inducing outputs ``u`` given each draw; point values
        as constant data, as an ``xarray.DataTree`` for ArviZ 1.x (``num_samples`` draws as 4
        chains). Needs ``pip install 'fedppl[arviz]'``."""
        from fedppl.arviz import check_num_samples

        key = jax.random.key(0) if rng_key is None else rng_key
        num = check_num_samples(num_samples)
        lb, Z, u = (np.asarray(a) for a in _sample_u_jit(self.spec, self.state, key, num))
        hyper = _hyper_values(lb, self.spec)
        posterior: dict[str, Any] = {"u": u}
        constant: dict[str, Any] = {}
        if self.spec.learn_hyper:
            posterior.update(hyper)
        else:
            constant.update({k: v[0] for k, v in hyper.items()})
        if self.spec.z_mode == "hvm":
            posterior["Z"] = Z
        else:
            constant["Z"] = Z[0]
        return chk.inference_data(posterior, constant, {
            "method": self.method, "num_rounds": self.num_rounds,
            "final_free_energy": float(self.history["free_energy"][-1])})


def _hyper_values(log_beta: np.ndarray, spec: sgp_pvi.Spec) -> dict[str, np.ndarray]:
    D = spec.input_dim
    out = {"lengthscale": np.exp(log_beta[:, :D]), "variance": np.exp(log_beta[:, D])}
    if spec.likelihood == "gaussian":
        out["noise"] = np.exp(log_beta[:, D + 1])
    return out


_predict_jit = jax.jit(sgp_pvi.predictive_samples, static_argnums=(0, 4))
_sample_u_jit = jax.jit(sgp_pvi.sample_u, static_argnums=(0, 3))
_free_energy_jit = jax.jit(sgp_pvi.free_energy, static_argnums=(0, 6))


class FederatedSGP(FederatedMethod):
    """A federated sparse GP (the methods: see :mod:`fedppl.infer.sparse_gps`).

    :param method: ``"dpo"``, ``"cpo"``, ``"fedavg-z"``, ``"fixed"`` or ``"global"``.
    :param config: an :class:`SGPConfig`; keyword arguments override its fields.
    """

    name = "FederatedSGP"
    # the bar: the global free energy (a deployment's server, without data, has the clients'
    # local ones); run(..., tol=) stops on the free energy's relative change
    progress: ClassVar[tuple[str, ...]] = ("free_energy", "local_free_energy:mean")
    tol_objective: ClassVar[str | None] = "free_energy"
    refusal = "non-finite update, or q(beta) or q(Z) improper with it"

    def __init__(self, method: str = "dpo", config: SGPConfig | None = None, **settings: Any):
        self.method = check.one_of(method, METHODS, "method")
        if config is not None and not isinstance(config, SGPConfig):
            raise TypeError(f"config must be an SGPConfig, got {type(config).__name__}")
        unknown = set(settings) - set(SGPConfig._fields)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}; FederatedSGP takes "
                            f"{list(SGPConfig._fields)}")
        self.config = _checked(_resolved(method, (config or SGPConfig())._replace(**settings)))
        if self.config.shared_draws and method not in ("dpo", "fixed", "fedavg-z"):
            raise ValueError(f"shared_draws applies to 'dpo', 'fixed' and 'fedavg-z' (the "
                             f"methods whose clients sum each other's DPO factors at their own "
                             f"draws), not {method!r}")
        self.optimizer = self.config.optimizer
        sync = self.config.schedule == "synchronous" and method != "global"
        self.schedule = "synchronous" if sync else "sequential"

    # -- set-up --------------------------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, *, runtime: Any = None,
             **kwargs: Any) -> RunState:
        """Check the clients' data (``(X, y)`` per client) against the settings and set up the
        run (``"global"`` pools the clients first)."""
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        cfg = self.config
        if self.method == "cpo" and jnp.result_type(float) != jnp.float64:
            raise TypeError(
                "FederatedSGP('cpo') computes in float64 only: a CPO cavity is the sum of every "
                "client's factor less the client's own, a difference float32 does not resolve "
                "(measured: a float32 run can end 50 nats of free energy below float64's). "
                "Call numpyro.enable_x64() first, or use method='dpo', which runs in float32")
        clients = chk.regression_clients(clients, binary=cfg.likelihood == "bernoulli")
        if self.method == "global":
            clients = clients.pooled()
        _check_against_data(cfg, clients, self.method)
        return super().init(rng_key, clients, runtime=runtime)

    def _spec(self, D: int) -> sgp_pvi.Spec:
        cfg, method = self.config, self.method
        factor = {"cpo": "cpo", "global": "opt" if cfg.likelihood == "gaussian" else "cpo"}
        z_mode = {"dpo": "hvm", "cpo": "hvm", "fedavg-z": "train", "fixed": "fixed",
                  "global": "train"}[method]
        if cfg.fixed_inducing is not None:
            z_mode = "fixed"
        assert cfg.covariance is not None and cfg.alpha is not None  # filled by _resolved
        return sgp_pvi.Spec(factor.get(method, "dpo"), cfg.covariance, cfg.likelihood, z_mode,
                            cfg.fixed_hyper is None, float(cfg.alpha), int(cfg.local_steps),
                            int(cfg.inner_steps) if method == "fedavg-z" else 0,
                            int(cfg.num_samples), float(cfg.damping), D,
                            shared_draws=int(cfg.shared_draws),
                            learn_z_sd=bool(cfg.learn_inducing_sd))

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              **kwargs: Any) -> Plan:
        rng_key, k_setup = jax.random.split(rng_key)
        X_stack, y_stack = (np.asarray(a) for a in clients.stacked)
        D = X_stack.shape[2]
        spec = self._spec(D)
        if not data_at_server:  # a deployment's server holds no data to set up from
            if self.method == "global":
                raise ValueError("global VI fits the pooled data in one place; it does not run "
                                 "on a federation")
            if spec.factor == "dpo" and self.config.pseudo_init == "data":
                raise ValueError("pseudo_init='data' draws each client's pseudo-inputs from its "
                                 "data at the set-up, which a deployment's server does not "
                                 "hold: use pseudo_init='prior'")
        state = _initial_state(self.method, spec, self.config, clients, k_setup)
        trio = shared(sgp_pvi.make_trio, spec, self.optimizer)
        mask = np.asarray(clients.mask)
        flat = (jnp.asarray(X_stack.reshape(-1, D)), jnp.asarray(y_stack.reshape(-1)),
                jnp.asarray(mask.reshape(-1)))
        return Plan(trio, self.schedule, state, sgp_pvi.ClientState(), self._row, self._result,
                    rng_key=rng_key, static=_Static(spec, flat))

    # -- the front's hooks ---------------------------------------------------------------------

    def _round_inputs(self, state: RunState):
        """The key stream of the original ``fit_sgp``: one split per round; sequential rounds
        take client ``round mod K`` only."""
        K = state.masks.shape[0]
        rng_key, k_round = jax.random.split(state.rng_key)
        if self.schedule == "synchronous":
            keys, active = jax.random.split(k_round, K), jnp.ones(K, bool)
        else:
            keys = jnp.stack([k_round] * K)
            active = jnp.arange(K) == state.round % K
        return rng_key, keys, active, k_round, jax.random.PRNGKey(FREE_ENERGY_KEY)

    def _refused(self, replies: Array, active: np.ndarray) -> np.ndarray:
        return ~np.asarray(replies, bool)

    def _row(self, before, after, msgs, replies, active, rng_key) -> tuple[None, dict[str, Any]]:
        plan = self._started(after)
        spec, flat = plan.static
        refused = [plan.names[k] for k in np.nonzero(active & ~np.asarray(replies, bool))[0]]
        if refused:
            warnings.warn(f"round {after.round}: rejected non-finite or improper updates from "
                          f"{refused}; their factors are unchanged", RuntimeWarning, stacklevel=4)
        K = len(active)
        comms = after.round * (K if self.schedule == "synchronous" else 1)
        fe = (_free_energy_jit(spec, after.server, *flat, rng_key, FREE_ENERGY_SAMPLES)
              if plan.data_at_server else np.nan)  # a deployment's server holds no data
        return None, {"free_energy": float(fe),
                      "local_free_energy": np.where(active, np.asarray(msgs.free_energy), np.nan),
                      "communications": comms, "passes": comms / K}

    def _message_bytes(self, msgs: sgp_pvi.Message) -> int:
        spec, one = self._spec(0), jax.eval_shape(trees.first, msgs)  # shapes: nothing compiled
        sent = [one.pseudo]
        sent += [g.num_bytes(one.t_beta)] if spec.learn_hyper else []
        sent += [g.num_bytes(one.t_z)] if spec.z_mode == "hvm" else []
        sent += [one.z_point] if spec.z_mode == "train" else []
        return sum(s if isinstance(s, int) else num_bytes(s) for s in sent)

    def _result(self, state: RunState, history, rejected) -> SGPResult:
        return SGPResult(method=self.method, state=state.server,
                         spec=self._started(state).static.spec,
                         history=history, client_names=self._started(state).names,
                         rejected=rejected)


class _Static(NamedTuple):
    """A run's static part (``plan.static``): its spec, and the pooled rows the server's free
    energy reads."""

    spec: sgp_pvi.Spec
    flat: tuple


# -- checks and the initial state ----------------------------------------------------------------

#: The paper's DPO (Sec. 6 and App. D): q(Z)'s sds learnt, both q(beta) and q(Z) starting at
#: precision 100, alpha = 0.1, a diagonal S_k. ``FederatedSGP("dpo", **PAPER_DPO)``.
PAPER_DPO: dict[str, Any] = {"alpha": 0.1, "covariance": "diag", "learn_inducing_sd": True,
                             "inducing_precision": 100.0}

#: The default DPO: q(Z) narrow and held so, its means learnt; the pseudo-noise relative to the
#: learnt noise (see the ``sgp_dpo_diagnosis`` benchmark page for the measurements).
DPO_DEFAULTS: dict[str, Any] = {"alpha": 0.01, "covariance": "noise",
                                "learn_inducing_sd": False, "inducing_precision": 100.0}


def _resolved(method: str, cfg: SGPConfig) -> SGPConfig:
    """The settings left at ``None`` filled with the method's defaults: :data:`DPO_DEFAULTS` for
    ``"dpo"`` (a diagonal S_k for a Bernoulli likelihood, which has no noise), the paper's
    (:data:`PAPER_DPO`) for the other methods."""
    base = DPO_DEFAULTS if method == "dpo" else {**PAPER_DPO, "inducing_precision": None}
    if method == "dpo" and cfg.likelihood != "gaussian":
        base = {**base, "covariance": "diag"}
    return cfg._replace(**{k: v for k, v in base.items() if getattr(cfg, k) is None})



def _checked(cfg: SGPConfig) -> SGPConfig:
    """Every setting checked on its own (before any data is seen)."""
    for name in ("num_inducing", "max_pseudo", "local_steps", "num_samples"):
        check.positive_int(getattr(cfg, name), name)
    check.positive_int(cfg.inner_steps, "inner_steps", minimum=0)
    check.positive_int(cfg.shared_draws, "shared_draws", minimum=0)
    check.fraction(cfg.pseudo_fraction, "pseudo_fraction")
    check.fraction(cfg.damping, "damping")
    check.positive(cfg.alpha, "alpha", allow_zero=True)
    check.positive(cfg.init_precision, "init_precision")
    if cfg.inducing_precision is not None:
        check.positive(cfg.inducing_precision, "inducing_precision")
    check.one_of(cfg.learn_inducing_sd, (True, False), "learn_inducing_sd")
    check.optimizer(cfg.optimizer)
    check.one_of(cfg.schedule, ("sequential", "synchronous"), "schedule")
    check.one_of(cfg.covariance, ("diag", "full", "noise"), "covariance")
    check.one_of(cfg.likelihood, ("gaussian", "bernoulli"), "likelihood")
    check.one_of(cfg.pseudo_init, ("data", "prior"), "pseudo_init")
    check.one_of(cfg.init_inducing, ("random-normal", "pseudo-inputs"), "init_inducing")
    if cfg.init_inducing == "pseudo-inputs" and cfg.pseudo_init != "data":
        raise ValueError("init_inducing='pseudo-inputs' starts Z at the clients' pseudo-inputs, "
                         "which are data rows only with pseudo_init='data'")
    if cfg.fixed_hyper is not None:
        _check_hyper(cfg.fixed_hyper, cfg.likelihood)
    if cfg.fixed_inducing is not None:
        Z = chk.check_inputs(cfg.fixed_inducing, np.shape(cfg.fixed_inducing)[-1],
                             "fixed_inducing")
        if len(np.unique(Z, axis=0)) < len(Z):
            warnings.warn("fixed_inducing has duplicate rows: K_ZZ is singular and only the "
                          "jitter keeps it invertible (the duplicates add nothing)", stacklevel=3)
    return cfg


def _check_hyper(h: Any, likelihood: str) -> None:
    need = {"lengthscale", "variance"} | ({"noise"} if likelihood == "gaussian" else set())
    if not isinstance(h, dict) or not need <= set(h):
        raise ValueError(f"fixed_hyper must be a dict with {sorted(need)}, got {h!r}")
    for name in need:
        values = np.asarray(h[name], dtype=float).reshape(-1)
        if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError(f"fixed_hyper[{name!r}] must be positive, got {h[name]!r}")


def _check_against_data(cfg: SGPConfig, clients: Clients, method: str) -> None:
    D = clients.data[0][0].shape[1]
    if cfg.fixed_hyper is not None:
        ls = np.asarray(cfg.fixed_hyper["lengthscale"], dtype=float)
        if ls.ndim > 1 or ls.size not in (1, D):
            raise ValueError(f"fixed_hyper['lengthscale'] must be a scalar or have {D} entries "
                             f"(one per input), got shape {ls.shape}")
    m = cfg.num_inducing
    if cfg.fixed_inducing is not None:
        shape = np.shape(cfg.fixed_inducing)
        if shape[1] != D:
            raise ValueError(f"fixed_inducing must have shape (M, {D}), got {shape}")
        m = shape[0]
    n = int(clients.sizes.sum())
    if m > n:
        raise ValueError(f"num_inducing={m} exceeds the total number of training points {n}")


def _fixed_log_beta(cfg: SGPConfig, D: int) -> np.ndarray | None:
    h = cfg.fixed_hyper
    if h is None:
        return None
    vals = [np.broadcast_to(np.asarray(h["lengthscale"], float), (D,)),
            np.asarray([h["variance"]], float)]
    if cfg.likelihood == "gaussian":
        vals.append(np.asarray([h["noise"]], float))
    return np.log(np.concatenate(vals))


def _initial_state(method: str, spec: sgp_pvi.Spec, cfg: SGPConfig, clients: Clients,
                   key: Array) -> sgp_pvi.ServerState:
    X_stack, y_stack = (np.asarray(a) for a in clients.stacked)
    mask, sizes = np.asarray(clients.mask), clients.sizes
    num_pseudo = np.maximum(1, np.minimum((cfg.pseudo_fraction * sizes).astype(int),
                                          cfg.max_pseudo))
    pseudo, m = None, cfg.num_inducing
    z_init = None if cfg.fixed_inducing is None else np.asarray(cfg.fixed_inducing, float)
    if z_init is not None:
        m = len(z_init)
    if method == "global":
        if z_init is None:
            rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
            z_init = X_stack[0][rng.choice(sizes[0], size=m, replace=False)]
        if spec.factor == "opt":
            pseudo = Pseudo(X_stack, y_stack, np.zeros_like(y_stack))
    from_pseudo = cfg.init_inducing == "pseudo-inputs" and z_init is None
    if from_pseudo and spec.factor != "dpo":
        raise ValueError(f"init_inducing='pseudo-inputs' needs DPO pseudo-inputs; {method!r} has "
                         "none")
    return sgp_pvi.init(spec, key, X_stack, mask, sizes, m, num_pseudo, cfg.init_precision,
                        cfg.pseudo_init == "data", z_init,
                        _fixed_log_beta(cfg, X_stack.shape[2]), pseudo, from_pseudo,
                        cfg.inducing_precision)

