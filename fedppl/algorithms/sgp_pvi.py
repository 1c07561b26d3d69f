"""PVI for sparse GPs with a hierarchical variational model over the inducing locations.

The server's :class:`ServerState` holds the priors and every client's factors, stacked on axis 0
(each client's cavity over ``u`` needs the others' pseudo-observations at its own draw of
``(beta, Z)``, so the server broadcasts them); a client keeps nothing between rounds
(:class:`ClientState` is empty). The trio (:func:`make_trio`, run by
:func:`fedppl.runtime.make_round`):

* :func:`client_update` maximises client ``k``'s local free energy (Eq. 7 of the paper, with the
  alpha-scaled Z KL) over its own factor parameters with any optax optimiser
  (:func:`fedppl.optimise.minimise`), leaving out its own factors from the cavity by
  its ``index``, and returns a :class:`Message` (its new ``t_k(beta)``, ``t_k(Z)``,
  pseudo-observations and, for FedAvg-Z, its local Z);
* :func:`server_update` accepts finite, proper updates, damps and stores them, and averages Z
  for FedAvg-Z (Alg. 1); a rejected client's factors stay as they were.

``Spec.z_mode``: ``"hvm"`` (q(Z), PVI on its factors), ``"fixed"`` (Z a fixed point) or
``"train"`` (Z a point optimised by the client: FedAvg-Z, and global VI with one client).
The Gaussian algebra (q = prior x prod t, cavities, damping, KL) is
:mod:`fedppl.families.gaussian`'s.

Example (one sequential step by hand; :class:`fedppl.FederatedSGP` runs the rounds)::

    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> X = np.random.default_rng(0).normal(size=(2, 6, 1))
    >>> spec = Spec(local_steps=3, input_dim=1)
    >>> state = init(spec, jax.random.key(0), X, np.ones((2, 6), bool), np.array([6, 6]),
    ...              num_inducing=3, num_pseudo=np.array([4, 4]))
    >>> data = (jnp.asarray(X[0]), jnp.sin(jnp.asarray(X[0, :, 0])), jnp.ones(6, bool))
    >>> msg = client_update(spec, optax.adam(1e-2), state, 0, data, jax.random.key(1))
    >>> state, ok = server_update(spec, state, expand(msg), jnp.array([0]))
    >>> bool(ok[0]), msg.pseudo.V.shape
    (True, (4, 1))
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import optax
from jax import Array
from numpyro.distributions.kl import kl_divergence
from numpyro.infer import TraceMeanField_ELBO

from fedppl import trees
from fedppl.algorithms import fedavg
from fedppl.algorithms.trio import Trio
from fedppl.families import gaussian as g
from fedppl.guides import sgp_guide as sg
from fedppl.handlers.tempered import tempered
from fedppl.models import sparse_gp as sgp
from fedppl.optimise import minimise

__all__ = ["Spec", "ServerState", "Shared", "ClientState", "Message", "init", "begin_round",
           "q_beta", "q_z", "cavity", "local_free_energy", "client_update", "server_update",
           "make_trio", "free_energy", "sample_q", "sample_u", "predictive_samples", "expand"]


class Spec(NamedTuple):
    """Static (hashable) settings: one compiled program per Spec."""

    factor: str = "dpo"          # dpo | cpo | opt
    covariance: str = "diag"     # DPO S_k: diag | full | noise (noise^2 diag)
    likelihood: str = "gaussian"
    z_mode: str = "hvm"          # hvm | fixed | train
    learn_hyper: bool = True
    alpha: float = 0.1
    local_steps: int = 200
    inner_steps: int = 0         # FedAvg-Z: joint (factor, Z) steps after local_steps
    num_samples: int = 1
    damping: float = 1.0
    input_dim: int = 1
    jitter: float = sgp.JITTER   # relative jitter on K_ZZ
    shared_draws: int = 0        # S > 0: the round's shared (beta, Z) draws (see begin_round)
    learn_z_sd: bool = True      # False: q(Z)'s sds held at their start, only its means learnt


class ServerState(NamedTuple):
    beta_prior: g.DiagGaussian   # over log beta, (P,)
    t_beta: g.DiagGaussian       # (K, P)
    z_prior: g.DiagGaussian      # p~(Z) = N(0, I), (M, D)
    t_z: g.DiagGaussian          # (K, M, D)
    z_point: Array               # (M, D): the point Z of fixed / train modes
    log_beta_fixed: Array        # (P,): used when not spec.learn_hyper
    pseudo: sg.Pseudo            # stacked (K, ...)
    pseudo_mask: Array           # (K, M_max) booleans
    sizes: Array                 # (K,) data counts
    round: Array
    shared: Shared | None = None  # the round's shared draws (Spec.shared_draws > 0)


class Shared(NamedTuple):
    """The server's S draws of ``(log beta, Z)`` from q for one round, and the whitened summed
    statistics ``(A_s, c_s)`` of every client's factor at each (:func:`begin_round`)."""

    log_beta: Array  # (S, P)
    Z: Array         # (S, M, D)
    A: Array         # (S, M, M)
    c: Array         # (S, M)


class ClientState(NamedTuple):
    """A client keeps nothing between rounds: its factors live in the server's broadcast."""


class Message(NamedTuple):
    """What client k sends: new factors over beta and Z, its pseudo-observations, its local Z
    (FedAvg-Z) and the local free energy it reached."""

    t_beta: g.DiagGaussian
    t_z: g.DiagGaussian
    pseudo: sg.Pseudo
    z_point: Array
    free_energy: Array


#: Add a leading axis of length 1 (a single sequential message): :func:`fedppl.trees.one`.
expand = trees.one


# -- initialisation ------------------------------------------------------------------------------


def init(spec: Spec, key: Array, X_stack: np.ndarray, mask: np.ndarray, sizes: np.ndarray,
         num_inducing: int, num_pseudo: np.ndarray, init_precision: float = 100.0,
         pseudo_from_data: bool = True, z_init: np.ndarray | None = None,
         log_beta_fixed: np.ndarray | None = None, pseudo: sg.Pseudo | None = None,
         z_from_pseudo: bool = False, z_precision: float | None = None) -> ServerState:
    """Initial state (App. D). q(beta) starts at mean 0 (beta = 1) with precision
    ``init_precision``, q(Z) at mean ``Z0 ~ N(0, I)`` (a random draw: all-zero means would make
    the inducing points coincide) with precision ``init_precision``; the precision above the
    prior's unit precision is split evenly among the K factors. ``z_init`` overrides Z0;
    ``z_from_pseudo`` draws Z0's rows without replacement from the clients' initial DPO
    pseudo-inputs (the rows the first messages carry). ``z_precision`` is q(Z)'s starting
    precision where it differs from q(beta)'s (``None``: ``init_precision``)."""
    K, _, D = X_stack.shape
    P = sgp.num_hyper(D, spec.likelihood)
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    Z0 = rng.standard_normal((num_inducing, D)) if z_init is None else np.asarray(z_init, float)
    if pseudo is not None:
        pmask = np.asarray(mask)
    elif spec.factor == "cpo":
        one = sg.init_cpo(num_inducing, D)
        pseudo = jax.tree_util.tree_map(lambda a: np.broadcast_to(a, (K, *a.shape)), one)
        pmask = np.ones((K, num_inducing), bool)
    else:
        m_max = int(np.max(num_pseudo))
        parts = [sg.init_dpo(rng, np.asarray(X_stack[k, : sizes[k]]), int(num_pseudo[k]), m_max,
                             spec.covariance, pseudo_from_data) for k in range(K)]
        pseudo = trees.stack([p for p, _ in parts], xp=np)
        pmask = np.stack([m for _, m in parts])
    if z_from_pseudo:
        pool = np.asarray(pseudo.V)[np.asarray(pmask, bool)]
        if len(pool) < num_inducing:
            raise ValueError(f"init_inducing='pseudo-inputs' needs num_inducing={num_inducing} "
                             f"rows, the clients' pseudo-inputs have {len(pool)}")
        Z0 = pool[rng.choice(len(pool), size=num_inducing, replace=False)]
    share = max(init_precision - 1.0, 0.0) / K
    z_share = share if z_precision is None else max(z_precision - 1.0, 0.0) / K
    t_beta = g.DiagGaussian(jnp.zeros((K, P)), jnp.full((K, P), share))
    t_z = g.DiagGaussian(jnp.broadcast_to(Z0 * (1.0 + z_share * K) / K, (K, *Z0.shape)),
                         jnp.full((K, *Z0.shape), z_share))
    fixed = np.zeros(P) if log_beta_fixed is None else np.asarray(log_beta_fixed, float)
    S, M = spec.shared_draws, num_inducing
    shared = Shared(jnp.zeros((S, P)), jnp.zeros((S, M, D)), jnp.zeros((S, M, M)),
                    jnp.zeros((S, M))) if S > 0 else None
    return ServerState(g.DiagGaussian(jnp.zeros(P), jnp.ones(P)), t_beta,
                       g.DiagGaussian(jnp.zeros(Z0.shape), jnp.ones(Z0.shape)), t_z,
                       jnp.asarray(Z0), jnp.asarray(fixed),
                       jax.tree_util.tree_map(jnp.asarray, pseudo), jnp.asarray(pmask),
                       jnp.asarray(sizes), jnp.asarray(0), shared)


# -- q and cavities ------------------------------------------------------------------------------


def _q(prior: g.DiagGaussian, t: g.DiagGaussian) -> g.DiagGaussian:
    """``prior x prod_k t_k`` for factors stacked on axis 0."""
    return cast(g.DiagGaussian, g.product(prior, jax.tree_util.tree_map(lambda x: x.sum(0), t)))


def q_beta(state: ServerState) -> g.DiagGaussian:
    """``q(log beta)``."""
    return _q(state.beta_prior, state.t_beta)


def q_z(state: ServerState) -> g.DiagGaussian:
    """``q(Z)`` (over the ``(M, D)`` inducing locations, fully factorised)."""
    return _q(state.z_prior, state.t_z)


def cavity(prior: g.DiagGaussian, t: g.DiagGaussian, k: Any) -> g.DiagGaussian:
    """``q / t_k``: q without client ``k``'s factor."""
    return cast(g.DiagGaussian, g.quotient(_q(prior, t), trees.index(t, k)))


def _proper(cav: g.DiagGaussian, q: g.DiagGaussian, floor: float = 1e-2) -> g.DiagGaussian:
    """The cavity with its precision floored at ``floor`` where it is not proper (possible
    mid-run when other factors have negative precision), centred there at q's mean."""
    bad = cav.prec < floor
    mean, _ = g.to_moments(q)
    return g.DiagGaussian(jnp.where(bad, floor * mean, cav.nat1), jnp.where(bad, floor, cav.prec))


def _loc_scale(prior: g.DiagGaussian, t: g.DiagGaussian, k: Any) -> tuple[Array, Array]:
    """Mean and standard deviation of client ``k``'s (proper) cavity."""
    return g.mean_and_scale_tril(_proper(cavity(prior, t, k), _q(prior, t)))


# -- the local free energy, expressed through NumPyro ----------------------------------------------


def _own_stats(spec: Spec, state: ServerState, k: Any, pseudo: sg.Pseudo, Z: Array,
               hyper: sgp.SEParams, L: Array) -> tuple[Array, Array]:
    """Whitened statistics of client ``k``'s factor with parameters ``pseudo`` at ``(beta, Z)``."""
    return sg.summed_stats(spec.factor, spec.covariance, trees.one(pseudo),
                           state.pseudo_mask[k][None], jnp.ones(1), Z, hyper, L)


def _cavity_stats(spec: Spec, state: ServerState, k: Any, Z: Array, hyper: sgp.SEParams,
                  L: Array) -> tuple[Array, Array]:
    """Whitened statistics of every client's factor but ``k``'s at one ``(beta, Z)``.

    CPO factors are Gaussians over ``u`` whatever ``(beta, Z)`` is, so the sum over all clients
    does not depend on client ``k`` (under ``vmap`` it is computed once) and k's own is taken off:
    linear in K. DPO factors must be summed at each client's own draw: O(K) per client."""
    if spec.factor == "cpo":
        A, c = sg.summed_stats("cpo", spec.covariance, state.pseudo, state.pseudo_mask,
                               jnp.ones(state.sizes.shape[0]), Z, hyper, L)
        A_k, c_k = _own_stats(spec, state, k, trees.index(state.pseudo, k), Z, hyper, L)
        return A - A_k, c - c_k
    w = jnp.ones(state.sizes.shape[0]).at[k].set(0.0)  # every client's factor but k's own
    return sg.summed_stats(spec.factor, spec.covariance, state.pseudo, state.pseudo_mask, w, Z,
                           hyper, L)


def _u_given(spec: Spec, state: ServerState, k: Any, own: sg.Pseudo, data: tuple,
             log_beta: Array, Z: Array, cavity_stats: Callable) -> Array:
    """E_q[log p(y_k | f)] - KL(q(u|Z,beta) || q_cavity(u|Z,beta)) for one (beta, Z), with the
    cavity's statistics from ``cavity_stats(hyper, L)``."""
    X, y, mask = data
    hyper = sgp.split_hyper(log_beta, spec.input_dim)
    L = jnp.linalg.cholesky(sgp.kzz(Z, hyper, spec.jitter))
    A_c, c_c = cavity_stats(hyper, L)
    A_k, c_k = _own_stats(spec, state, k, own, Z, hyper, L)
    post = sgp.posterior(L, A_c + A_k, c_c + c_k)
    cav = sgp.posterior(L, A_c, c_c)
    mean, var = sgp.predict_f(post, hyper.kernel(X, Z), jnp.full(X.shape[0], hyper.variance))
    ell = sgp.expected_log_lik(spec.likelihood, y, mean, var, hyper.noise, mask)
    return ell - sgp.kl_whitened(post, cav)


def _u_term(spec: Spec, state: ServerState, k: Any, own: sg.Pseudo, data: tuple, log_beta: Array,
            Z: Array) -> Array:
    """E_q[log p(y_k | f)] - KL(q(u|Z,beta) || q_cavity(u|Z,beta)) at the client's own draw."""
    return _u_given(spec, state, k, own, data, log_beta, Z,
                    lambda hyper, L: _cavity_stats(spec, state, k, Z, hyper, L))


def local_free_energy(spec: Spec, state: ServerState, k: Any, data: tuple, params: tuple,
                      key: Array) -> Array:
    """Client k's alpha-tempered local free energy (one MC estimate over (beta, Z); with
    ``spec.shared_draws``, the estimate at the round's shared draws, :func:`_shared_estimate`)."""
    lq, own, z_point = params
    if spec.factor == "opt":
        own = jax.lax.stop_gradient(own)
    if not spec.learn_z_sd:  # q(Z)'s sds stay where the round began: only its means move
        lq = lq._replace(z_logsd=jax.lax.stop_gradient(lq.z_logsd))
    if spec.shared_draws:
        return _shared_estimate(spec, state, k, data, lq, own, z_point, key)
    cav_b = _loc_scale(state.beta_prior, state.t_beta, k) if spec.learn_hyper else None
    cav_z = _loc_scale(state.z_prior, state.t_z, k) if spec.z_mode == "hvm" else None
    model = partial(sgp.local_model, partial(_u_term, spec, state, k, own, data), cav_b, cav_z,
                    state.log_beta_fixed, z_point)
    guide = partial(sg.hvm_guide, lq, spec.learn_hyper, spec.z_mode == "hvm")
    stochastic = spec.learn_hyper or spec.z_mode == "hvm"
    elbo = TraceMeanField_ELBO(num_particles=spec.num_samples if stochastic else 1)
    return -elbo.loss(key, {}, tempered(model, spec.alpha, ["Z"]),
                      tempered(guide, spec.alpha, ["Z"]))


def begin_round(spec: Spec, state: ServerState, key: Array) -> ServerState:
    """The server's work before a round with shared draws: S draws of ``(log beta, Z)`` from the
    current q and, at each, the whitened statistics of all K clients' factors (O(S K M_k M^2)
    once, instead of each client summing the others' at its own draws: O(K^2) a round)."""
    lb, Z = sample_q(spec, state, key, spec.shared_draws)
    ones = jnp.ones(state.sizes.shape[0])

    def stats(draw: tuple[Array, Array]) -> tuple[Array, Array]:
        hyper = sgp.split_hyper(draw[0], spec.input_dim)
        L = jnp.linalg.cholesky(sgp.kzz(draw[1], hyper, spec.jitter))
        return sg.summed_stats(spec.factor, spec.covariance, state.pseudo, state.pseudo_mask,
                               ones, draw[1], hyper, L)

    A, c = jax.lax.map(stats, (lb, Z))  # one draw at a time: memory of one
    return state._replace(shared=Shared(lb, Z, A, c))


def _shared_estimate(spec: Spec, state: ServerState, k: Any, data: tuple, lq: sg.LocalQ,
                     own: sg.Pseudo, z_point: Array, key: Array) -> Array:
    """One estimate of the local free energy at one of the round's shared draws ``x_s ~ q``
    (:func:`begin_round`), picked by ``key``: the client's own draw is ``x = mu_k + sigma_k
    eps_s``, with ``eps_s`` the shared draw's standard noise (so ``x = x_s`` while the client's
    q_k is still q, at the start of its local step; FedAvg-Z's Z is its own point), and its
    cavity's statistics are the server's sum at ``x_s`` less the client's own factor as it was
    (``A_s - A_k(x_s)``), held fixed in whitened coordinates (no gradient through the other
    clients' factors). The KLs over beta and Z are analytic."""
    assert state.shared is not None
    sh = state.shared
    start = sg.local_q_from(q_beta(state), q_z(state))
    s = jax.random.randint(key, (), 0, sh.A.shape[0])
    lb, Z = sh.log_beta[s], sh.Z[s]
    hyper_s = sgp.split_hyper(lb, spec.input_dim)
    L_s = jnp.linalg.cholesky(sgp.kzz(Z, hyper_s, spec.jitter))
    A_k, c_k = _own_stats(spec, state, k, trees.index(state.pseudo, k), Z, hyper_s, L_s)
    frozen = jax.lax.stop_gradient((sh.A[s] - A_k, sh.c[s] - c_k))
    if spec.learn_hyper:
        lb = lq.beta_loc + jnp.exp(lq.beta_logsd - start.beta_logsd) * (lb - start.beta_loc)
    if spec.z_mode == "hvm":
        Z = lq.z_loc + jnp.exp(lq.z_logsd - start.z_logsd) * (Z - start.z_loc)
    elif spec.z_mode == "train":
        Z = z_point
    value = _u_given(spec, state, k, own, data, lb, Z, lambda hyper, L: frozen)
    if spec.learn_hyper:
        cav = _loc_scale(state.beta_prior, state.t_beta, k)
        value -= jnp.sum(kl_divergence(dist.Normal(lq.beta_loc, jnp.exp(lq.beta_logsd)),
                                       dist.Normal(*cav)))
    if spec.z_mode == "hvm":
        cav = _loc_scale(state.z_prior, state.t_z, k)
        value -= spec.alpha * jnp.sum(kl_divergence(dist.Normal(lq.z_loc, jnp.exp(lq.z_logsd)),
                                                    dist.Normal(*cav)))
    return value


def client_update(spec: Spec, optimizer: optax.GradientTransformation, state: ServerState,
                  k: Any, data: tuple, key: Array) -> Message:
    """Optimise client k's factors (``local_steps`` optimiser steps; FedAvg-Z then
    ``inner_steps`` joint steps with its local Z). ``data = (X_k, y_k, mask_k)``."""
    lq = sg.local_q_from(q_beta(state), q_z(state))
    params = (lq, trees.index(state.pseudo, k), state.z_point)
    fe = partial(local_free_energy, spec, state, k, data)
    k1, k2 = jax.random.split(key)

    def loss(train_z: bool, p: tuple, sk: Array) -> Array:
        if not train_z:
            p = (p[0], p[1], jax.lax.stop_gradient(p[2]))
        return -fe(p, sk)

    train_z_first = spec.z_mode == "train" and spec.inner_steps == 0
    params, values, _ = minimise(partial(loss, train_z_first), params, optimizer,
                                 spec.local_steps, k1)
    if spec.z_mode == "train" and spec.inner_steps > 0:
        params, values, _ = minimise(partial(loss, True), params, optimizer, spec.inner_steps,
                                     k2)
    lq, own, z_point = params
    t_b, t_z = sg.to_factors(lq, cavity(state.beta_prior, state.t_beta, k),
                             cavity(state.z_prior, state.t_z, k))
    return Message(t_b, t_z, own, z_point, -values[-1])


# -- server ----------------------------------------------------------------------------------------


def _accept(state: ServerState, msgs: Message, idx: Array, received: Array, rho: float
            ) -> Array:
    """Accept, in order, each finite message whose (damped) factors keep q(beta) and q(Z)
    proper given the messages accepted before it (a scan: synchronous updates can be proper one
    at a time and improper together)."""
    finite = fedavg.all_finite((msgs.t_beta, msgs.t_z, msgs.pseudo, msgs.z_point)) & received

    def flat(a: Array) -> Array:
        return a.reshape(a.shape[0], -1)

    olds = jnp.concatenate([flat(state.t_beta.prec[idx]), flat(state.t_z.prec[idx])], 1)
    news = jnp.concatenate([flat(msgs.t_beta.prec), flat(msgs.t_z.prec)], 1)
    news = jnp.where(jnp.isfinite(news), news, 0.0)
    total = jnp.concatenate([q_beta(state).prec.reshape(-1), q_z(state).prec.reshape(-1)])

    def step(tot: Array, xs: tuple) -> tuple[Array, Array]:
        old, new, fin = xs
        cand = tot + rho * (new - old)
        ok = fin & jnp.all(cand > 0)
        return jnp.where(ok, cand, tot), ok

    return jax.lax.scan(step, total, (olds, news, finite))[1]


def _lerp(old: Any, new: Any, rho: float) -> Any:
    """Pseudo-observation parameters moved ``rho`` of the way to their new values."""
    return jax.tree_util.tree_map(lambda o, n: (1.0 - rho) * o + rho * n, old, new)


def _store(stack: Any, new: Any, idx: Array, ok: Array, rho: float,
           combine: Callable[[Any, Any, float], Any]) -> Any:
    """Stacked values with rows ``idx`` replaced by ``combine(old, new, rho)`` where ``ok``."""
    def keep(a: Array) -> Array:
        return ok.reshape(ok.shape + (1,) * (a.ndim - 1))

    prev = trees.index(stack, idx)
    new = jax.tree_util.tree_map(lambda n, p: jnp.where(keep(n), n, p), new, prev)
    cand = combine(prev, new, rho)
    return jax.tree_util.tree_map(lambda s, c, p: s.at[idx].set(jnp.where(keep(c), c, p)),
                                  stack, cand, prev)


def server_update(spec: Spec, state: ServerState, msgs: Message, idx: Array,
                  received: Array | None = None) -> tuple[ServerState, Array]:
    """Apply the accepted messages of clients ``idx`` (messages stacked on axis 0).

    A message is rejected (its client's factors stay as they were) when it did not arrive, any
    leaf is non-finite or it would make q(beta) or q(Z) improper (checked in order, see
    :func:`_accept`). Factors over beta and Z are damped in natural parameters
    (:func:`fedppl.families.gaussian.damp`); DPO/CPO pseudo-observation parameters are
    interpolated linearly (a heuristic; exact when damping = 1). FedAvg-Z: Z <- weighted average
    of the old Z (weight N - sum N_k) and the clients' Z (weights N_k), via
    :func:`fedppl.algorithms.fedavg.server_update`."""
    rho = spec.damping
    received = jnp.ones(idx.shape[0], bool) if received is None else received
    ok = _accept(state, msgs, idx, received, rho)
    t_beta = _store(state.t_beta, msgs.t_beta, idx, ok, rho, g.damp)
    t_z = _store(state.t_z, msgs.t_z, idx, ok, rho, g.damp)
    pseudo = _store(state.pseudo, msgs.pseudo, idx, ok, rho, _lerp)
    z_point = state.z_point
    if spec.z_mode == "train":
        n_k = state.sizes[idx].astype(float)
        rest = jnp.sum(state.sizes) - jnp.sum(n_k)
        stack = jnp.concatenate([state.z_point[None], msgs.z_point])
        fa = fedavg.server_update(fedavg.init(state.z_point), stack,
                                  weights=jnp.concatenate([rest[None], n_k]),
                                  received=jnp.concatenate([jnp.array([True]), ok]))[0]
        z_point = fa.params
    new = state._replace(t_beta=t_beta, t_z=t_z, pseudo=pseudo, z_point=z_point,
                         round=state.round + 1)
    return new, ok


def make_trio(spec: Spec, optimizer: optax.GradientTransformation) -> Trio:
    """The sparse-GP PVI trio for :func:`fedppl.runtime.make_round` (replies: accepted flags)."""

    def client(server: ServerState, cstate: ClientState, data: tuple, mask: Array, key: Array,
               index: Array) -> tuple[Message, ClientState]:
        X, y = data
        return client_update(spec, optimizer, server, index, (X, y, mask), key), cstate

    def server(state: ServerState, msgs: Message, index: Array, received: Array, key: Array,
               evaluate: Any) -> tuple[ServerState, Array]:
        return server_update(spec, state, msgs, index, received)

    return Trio(client, server,
                begin_round=partial(begin_round, spec) if spec.shared_draws else None)


# -- sampling q, the global free energy and predictions --------------------------------------------


def _draws(key: Array, q: g.DiagGaussian, num: int) -> Array:
    """``num`` draws of a diagonal Gaussian of any shape (flattened for :func:`g.sample`)."""
    shape = q.nat1.shape
    flat = g.DiagGaussian(q.nat1.reshape(-1), q.prec.reshape(-1))
    return g.sample(key, flat, num).reshape((num, *shape))


def sample_q(spec: Spec, state: ServerState, key: Array, num: int) -> tuple[Array, Array]:
    """``num`` draws of (log_beta, Z) from q (point values where they are not random)."""
    kb, kz = jax.random.split(key)
    if spec.learn_hyper:
        lb = _draws(kb, q_beta(state), num)
    else:
        lb = jnp.broadcast_to(state.log_beta_fixed, (num, *state.log_beta_fixed.shape))
    if spec.z_mode == "hvm":
        Z = _draws(kz, q_z(state), num)
    else:
        Z = jnp.broadcast_to(state.z_point, (num, *state.z_point.shape))
    return lb, Z


def _posterior_at(spec: Spec, state: ServerState, log_beta: Array, Z: Array):
    hyper = sgp.split_hyper(log_beta, spec.input_dim)
    L = jnp.linalg.cholesky(sgp.kzz(Z, hyper, spec.jitter))
    A, c = sg.summed_stats(spec.factor, spec.covariance, state.pseudo, state.pseudo_mask,
                           jnp.ones(state.sizes.shape[0]), Z, hyper, L)
    return hyper, L, sgp.posterior(L, A, c)


def predictive_samples(spec: Spec, state: ServerState, X: Array, key: Array, num: int):
    """Per-sample latent mean, variance (num, N) and noise variance (num,) at ``X``."""
    def one(lb: Array, Z: Array):
        hyper, _, post = _posterior_at(spec, state, lb, Z)
        mean, var = sgp.predict_f(post, hyper.kernel(X, Z), jnp.full(X.shape[0], hyper.variance))
        return mean, var, hyper.noise**2
    return jax.vmap(one)(*sample_q(spec, state, key, num))


def sample_u(spec: Spec, state: ServerState, key: Array, num: int
             ) -> tuple[Array, Array, Array]:
    """``num`` joint draws of ``(log_beta, Z, u)``: ``u = f(Z) ~ q(u | Z, beta)`` per draw."""
    k_q, k_u = jax.random.split(key)
    lb, Z = sample_q(spec, state, k_q, num)

    def one(lb: Array, Z: Array, eps: Array) -> Array:
        post = _posterior_at(spec, state, lb, Z)[2]
        mean, cov = sgp.moments(post)
        return mean + jnp.linalg.cholesky(cov + 1e-12 * jnp.eye(cov.shape[0])) @ eps

    eps = jax.random.normal(k_u, (num, Z.shape[1]))
    return lb, Z, jax.vmap(one)(lb, Z, eps)


def free_energy(spec: Spec, state: ServerState, X_all: Array, y_all: Array, mask_all: Array,
                key: Array, num: int = 4) -> Array:
    """MC estimate of the global alpha-tempered free energy (all clients' data; KLs to the
    prior): E[sum_n E log p(y_n|f) - KL(q(u)||p(u))] - KL(q(beta)||p) - alpha KL(q(Z)||p~)."""
    def one(lb: Array, Z: Array) -> Array:
        hyper, L, post = _posterior_at(spec, state, lb, Z)
        prior = sgp.posterior(L, jnp.zeros_like(L), jnp.zeros(L.shape[0]))
        mean, var = sgp.predict_f(post, hyper.kernel(X_all, Z),
                                  jnp.full(X_all.shape[0], hyper.variance))
        ell = sgp.expected_log_lik(spec.likelihood, y_all, mean, var, hyper.noise, mask_all)
        return ell - sgp.kl_whitened(post, prior)
    value = jnp.mean(jax.vmap(one)(*sample_q(spec, state, key, num)))
    if spec.learn_hyper:
        value -= g.kl(q_beta(state), state.beta_prior)
    if spec.z_mode == "hvm":
        value -= spec.alpha * jnp.sum(g.kl(q_z(state), state.z_prior))
    return value
