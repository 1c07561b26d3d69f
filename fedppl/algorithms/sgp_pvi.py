"""PVI for sparse GPs with a hierarchical variational model over the inducing locations.

Pure functions on a :class:`SGPState` (every client's factors stacked on axis 0):

* :func:`init` builds the prior, the initial factors and the pseudo-observations;
* :func:`client_update` maximises client ``k``'s local free energy (Eq. 7 of the paper, with the
  alpha-scaled Z KL) over its own factor parameters with Adam under ``lax.scan`` and returns a
  :class:`Message` (its new ``t_k(beta)``, ``t_k(Z)``, pseudo-observations and, for FedAvg-Z, its
  local Z); the server sends it every other client's factors (pseudo-observations included);
* :func:`server_update` accepts finite, proper updates, damps and stores them, and averages Z
  for FedAvg-Z (Alg. 1); a rejected client leaves the state untouched.

``Spec.z_mode``: ``"hvm"`` (q(Z), PVI on its factors), ``"fixed"`` (Z a fixed point) or
``"train"`` (Z a point optimised by the client: FedAvg-Z, and global VI with one client).

Example::

    >>> state = init(spec, key, X_stack, mask, sizes, num_inducing=20, ...)
    >>> msg, fe = client_update(spec, state, k, (X_stack[k], y_stack[k], mask[k]), key)
    >>> state, ok = server_update(spec, state, expand(msg), jnp.array([k]))
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from numpyro.infer import TraceMeanField_ELBO

from fedppl.algorithms import fedavg
from fedppl.families.gaussian import DiagGaussian, to_moments
from fedppl.guides import sgp_guide as sg
from fedppl.handlers.tempered import tempered
from fedppl.models import sparse_gp as sgp

__all__ = ["Spec", "SGPState", "Message", "init", "client_update", "server_update",
           "free_energy", "sample_q", "predictive_samples", "expand"]


class Spec(NamedTuple):
    """Static (hashable) settings: one compiled program per Spec."""

    factor: str = "dpo"          # dpo | cpo | opt
    covariance: str = "diag"     # DPO S_k: diag | full
    likelihood: str = "gaussian"
    z_mode: str = "hvm"          # hvm | fixed | train
    learn_hyper: bool = True
    alpha: float = 0.1
    learning_rate: float = 1e-2
    local_steps: int = 200
    inner_steps: int = 0         # FedAvg-Z: joint (factor, Z) steps after local_steps
    num_samples: int = 1
    damping: float = 1.0
    input_dim: int = 1
    jitter: float = sgp.JITTER   # relative jitter on K_ZZ


class SGPState(NamedTuple):
    beta_prior: DiagGaussian     # over log beta, (P,)
    t_beta: DiagGaussian         # (K, P)
    z_prior: DiagGaussian        # p~(Z) = N(0, I), (M, D)
    t_z: DiagGaussian            # (K, M, D)
    z_point: jax.Array           # (M, D): the point Z of fixed / train modes
    log_beta_fixed: jax.Array    # (P,): used when not spec.learn_hyper
    pseudo: sg.Pseudo            # stacked (K, ...)
    pseudo_mask: jax.Array       # (K, M_max) booleans
    sizes: jax.Array             # (K,) data counts
    round: jax.Array


class Message(NamedTuple):
    """What client k sends: new factors over beta and Z, its pseudo-observations, its local Z."""

    t_beta: DiagGaussian
    t_z: DiagGaussian
    pseudo: sg.Pseudo
    z_point: jax.Array


def expand(tree):
    """Add a leading axis of length 1 (a single sequential message)."""
    return jax.tree_util.tree_map(lambda x: x[None], tree)


# -- initialisation ------------------------------------------------------------------------------


def init(spec: Spec, key: jax.Array, X_stack: np.ndarray, mask: np.ndarray, sizes: np.ndarray,
         num_inducing: int, num_pseudo: np.ndarray, init_precision: float = 100.0,
         pseudo_from_data: bool = True, z_init: np.ndarray | None = None,
         log_beta_fixed: np.ndarray | None = None, pseudo: sg.Pseudo | None = None) -> SGPState:
    """Initial state (App. D). q(beta) starts at mean 0 (beta = 1) with precision
    ``init_precision``, q(Z) at mean ``Z0 ~ N(0, I)`` (a random draw: all-zero means would make
    the inducing points coincide) with precision ``init_precision``; the precision above the
    prior's unit precision is split evenly among the K factors. ``z_init`` overrides Z0."""
    K, _, D = X_stack.shape
    P = sgp.num_hyper(D, spec.likelihood)
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    Z0 = rng.standard_normal((num_inducing, D)) if z_init is None else np.asarray(z_init, float)
    share = max(init_precision - 1.0, 0.0) / K
    t_beta = DiagGaussian(jnp.zeros((K, P)), jnp.full((K, P), share))
    t_z = DiagGaussian(jnp.broadcast_to(Z0 * (1.0 + share * K) / K, (K,) + Z0.shape),
                       jnp.full((K,) + Z0.shape, share))
    if pseudo is not None:
        pmask = np.asarray(mask)
    elif spec.factor == "cpo":
        one = sg.init_cpo(num_inducing, D)
        pseudo = jax.tree_util.tree_map(lambda a: np.broadcast_to(a, (K,) + a.shape), one)
        pmask = np.ones((K, num_inducing), bool)
    else:
        m_max = int(np.max(num_pseudo))
        parts = [sg.init_dpo(rng, np.asarray(X_stack[k, : sizes[k]]), int(num_pseudo[k]), m_max,
                             spec.covariance, pseudo_from_data) for k in range(K)]
        pseudo = jax.tree_util.tree_map(lambda *a: np.stack(a), *[p for p, _ in parts])
        pmask = np.stack([m for _, m in parts])
    fixed = np.zeros(P) if log_beta_fixed is None else np.asarray(log_beta_fixed, float)
    return SGPState(DiagGaussian(jnp.zeros(P), jnp.ones(P)), t_beta,
                    DiagGaussian(jnp.zeros(Z0.shape), jnp.ones(Z0.shape)), t_z, jnp.asarray(Z0),
                    jnp.asarray(fixed), jax.tree_util.tree_map(jnp.asarray, pseudo),
                    jnp.asarray(pmask), jnp.asarray(sizes), jnp.asarray(0))


# -- q and cavities ------------------------------------------------------------------------------


def _q(prior: DiagGaussian, t: DiagGaussian) -> DiagGaussian:
    return DiagGaussian(prior.nat1 + t.nat1.sum(0), prior.prec + t.prec.sum(0))


def _cavity(prior: DiagGaussian, t: DiagGaussian, k) -> DiagGaussian:
    q = _q(prior, t)
    return DiagGaussian(q.nat1 - t.nat1[k], q.prec - t.prec[k])


def _proper(cav: DiagGaussian, q: DiagGaussian, floor: float = 1e-2) -> DiagGaussian:
    """The cavity with its precision floored at ``floor`` where it is not proper (possible
    mid-run when other factors have negative precision), centred there at q's mean."""
    bad = cav.prec < floor
    mean = q.nat1 / q.prec
    return DiagGaussian(jnp.where(bad, floor * mean, cav.nat1), jnp.where(bad, floor, cav.prec))


def _loc_scale(g: DiagGaussian) -> tuple[jax.Array, jax.Array]:
    mean, var = to_moments(g)
    return mean, jnp.sqrt(var)


def _take(tree, k):
    return jax.tree_util.tree_map(lambda x: x[k], tree)


# -- the local free energy, expressed through NumPyro ----------------------------------------------


def _u_term(spec: Spec, state: SGPState, k, own: sg.Pseudo, data, log_beta, Z):
    """E_q[log p(y_k | f)] - KL(q(u|Z,beta) || q_cavity(u|Z,beta)) for one (beta, Z)."""
    X, y, mask = data
    hyper = sgp.split_hyper(log_beta, spec.input_dim)
    L = jnp.linalg.cholesky(sgp.kzz(Z, hyper, spec.jitter))
    nclients = state.sizes.shape[0]
    w = jnp.ones(nclients).at[k].set(0.0)
    A_c, c_c = sg.summed_stats(spec.factor, spec.covariance, state.pseudo, state.pseudo_mask,
                               w, Z, hyper, L)
    A_k, c_k = sg.summed_stats(spec.factor, spec.covariance, expand(own),
                               state.pseudo_mask[k][None], jnp.ones(1), Z, hyper, L)
    post = sgp.posterior(L, A_c + A_k, c_c + c_k)
    cav = sgp.posterior(L, A_c, c_c)
    mean, var = sgp.predict_f(post, sgp.se(X, Z, hyper.lengthscale, hyper.variance),
                              jnp.full(X.shape[0], hyper.variance))
    ell = sgp.expected_log_lik(spec.likelihood, y, mean, var, hyper.noise, mask)
    return ell - sgp.kl_whitened(post, cav)


def local_free_energy(spec: Spec, state: SGPState, k, data, params, key) -> jax.Array:
    """Client k's alpha-tempered local free energy (one MC estimate over (beta, Z))."""
    lq, own, z_point = params
    if spec.factor == "opt":
        own = jax.lax.stop_gradient(own)
    cav_b = (_loc_scale(_proper(_cavity(state.beta_prior, state.t_beta, k),
                                _q(state.beta_prior, state.t_beta)))
             if spec.learn_hyper else None)
    cav_z = (_loc_scale(_proper(_cavity(state.z_prior, state.t_z, k), _q(state.z_prior, state.t_z)))
             if spec.z_mode == "hvm" else None)
    model = partial(sgp.local_model, partial(_u_term, spec, state, k, own, data), cav_b, cav_z,
                    state.log_beta_fixed, z_point)
    guide = partial(sg.hvm_guide, lq, spec.learn_hyper, spec.z_mode == "hvm")
    stochastic = spec.learn_hyper or spec.z_mode == "hvm"
    elbo = TraceMeanField_ELBO(num_particles=spec.num_samples if stochastic else 1)
    return -elbo.loss(key, {}, tempered(model, spec.alpha, ["Z"]),
                      tempered(guide, spec.alpha, ["Z"]))


def _adam(loss, params, steps: int, lr: float, key):
    opt = optax.adam(lr)

    def step(carry, sk):
        p, s = carry
        value, g = jax.value_and_grad(loss)(p, sk)
        upd, s = opt.update(g, s, p)
        return (optax.apply_updates(p, upd), s), value

    (params, _), values = jax.lax.scan(step, (params, opt.init(params)),
                                       jax.random.split(key, steps))
    return params, values


def client_update(spec: Spec, state: SGPState, k, data, key) -> tuple[Message, jax.Array]:
    """Optimise client k's factors (``local_steps`` Adam steps; FedAvg-Z then ``inner_steps``
    joint steps with its local Z). Returns the message and the final local free energy."""
    cav_b = _cavity(state.beta_prior, state.t_beta, k)
    cav_z = _cavity(state.z_prior, state.t_z, k)
    lq = sg.local_q_from(_q(state.beta_prior, state.t_beta), _q(state.z_prior, state.t_z))
    params = (lq, _take(state.pseudo, k), state.z_point)
    fe = partial(local_free_energy, spec, state, k, data)
    k1, k2 = jax.random.split(key)
    train_z_first = spec.z_mode == "train" and spec.inner_steps == 0

    def loss(train_z, p, sk):
        if not train_z:
            p = (p[0], p[1], jax.lax.stop_gradient(p[2]))
        return -fe(p, sk)

    params, values = _adam(partial(loss, train_z_first), params, spec.local_steps,
                           spec.learning_rate, k1)
    if spec.z_mode == "train" and spec.inner_steps > 0:
        params, values = _adam(partial(loss, True), params, spec.inner_steps,
                               spec.learning_rate, k2)
    lq, own, z_point = params
    t_b, t_z = sg.to_factors(lq, cav_b, cav_z)
    return Message(t_b, t_z, own, z_point), -values[-1]


# -- server ----------------------------------------------------------------------------------------


def _accept(state: SGPState, msgs: Message, idx, rho: float) -> jax.Array:
    """Accept, in order, each finite message whose (damped) factors keep q(beta) and q(Z)
    proper given the messages accepted before it (a scan: synchronous updates can be proper one
    at a time and improper together)."""
    finite = fedavg.all_finite(msgs)
    flat = lambda a: a.reshape(a.shape[0], -1)  # noqa: E731
    olds = jnp.concatenate([flat(state.t_beta.prec[idx]), flat(state.t_z.prec[idx])], 1)
    news = jnp.concatenate([flat(msgs.t_beta.prec), flat(msgs.t_z.prec)], 1)
    news = jnp.where(jnp.isfinite(news), news, 0.0)
    total = jnp.concatenate([_q(state.beta_prior, state.t_beta).prec.reshape(-1),
                             _q(state.z_prior, state.t_z).prec.reshape(-1)])

    def step(tot, xs):
        old, new, fin = xs
        cand = tot + rho * (new - old)
        ok = fin & jnp.all(cand > 0)
        return jnp.where(ok, cand, tot), ok

    return jax.lax.scan(step, total, (olds, news, finite))[1]


def server_update(spec: Spec, state: SGPState, msgs: Message, idx) -> tuple[SGPState, jax.Array]:
    """Apply the accepted messages of clients ``idx`` (messages stacked on axis 0).

    A message is rejected (its client's factors stay as they were) when any leaf is non-finite
    or it would make q(beta) or q(Z) improper (checked in order, see :func:`_accept`). Factors over beta and Z are damped in natural
    parameters; DPO/CPO pseudo-observation parameters are interpolated linearly (a heuristic;
    exact when damping = 1). FedAvg-Z: Z <- weighted average of the old Z (weight N - sum N_k)
    and the clients' Z (weights N_k), via :func:`fedppl.algorithms.fedavg.server_update`."""
    rho = spec.damping
    ok = _accept(state, msgs, idx, rho)
    keep = lambda a: ok.reshape(ok.shape + (1,) * (a.ndim - 1))  # noqa: E731

    def upd(old, new):
        prev = old[idx]
        cand = (1.0 - rho) * prev + rho * jnp.where(keep(new), new, prev)
        return old.at[idx].set(jnp.where(keep(new), cand, prev))

    t_beta = jax.tree_util.tree_map(upd, state.t_beta, msgs.t_beta)
    t_z = jax.tree_util.tree_map(upd, state.t_z, msgs.t_z)
    pseudo = jax.tree_util.tree_map(upd, state.pseudo, msgs.pseudo)
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


# -- sampling q, the global free energy and predictions --------------------------------------------


def sample_q(spec: Spec, state: SGPState, key, num: int) -> tuple[jax.Array, jax.Array]:
    """``num`` draws of (log_beta, Z) from q (point values where they are not random)."""
    kb, kz = jax.random.split(key)
    if spec.learn_hyper:
        mb, sb = _loc_scale(_q(state.beta_prior, state.t_beta))
        lb = mb + sb * jax.random.normal(kb, (num,) + mb.shape)
    else:
        lb = jnp.broadcast_to(state.log_beta_fixed, (num,) + state.log_beta_fixed.shape)
    if spec.z_mode == "hvm":
        mz, sz = _loc_scale(_q(state.z_prior, state.t_z))
        Z = mz + sz * jax.random.normal(kz, (num,) + mz.shape)
    else:
        Z = jnp.broadcast_to(state.z_point, (num,) + state.z_point.shape)
    return lb, Z


def _posterior_at(spec: Spec, state: SGPState, log_beta, Z):
    hyper = sgp.split_hyper(log_beta, spec.input_dim)
    L = jnp.linalg.cholesky(sgp.kzz(Z, hyper, spec.jitter))
    A, c = sg.summed_stats(spec.factor, spec.covariance, state.pseudo, state.pseudo_mask,
                           jnp.ones(state.sizes.shape[0]), Z, hyper, L)
    return hyper, L, sgp.posterior(L, A, c)


def predictive_samples(spec: Spec, state: SGPState, X, key, num: int):
    """Per-sample latent mean, variance (num, N) and noise variance (num,) at ``X``."""
    def one(lb, Z):
        hyper, _, post = _posterior_at(spec, state, lb, Z)
        mean, var = sgp.predict_f(post, sgp.se(X, Z, hyper.lengthscale, hyper.variance),
                                  jnp.full(X.shape[0], hyper.variance))
        return mean, var, hyper.noise**2
    return jax.vmap(one)(*sample_q(spec, state, key, num))


def free_energy(spec: Spec, state: SGPState, X_all, y_all, mask_all, key, num: int = 4):
    """MC estimate of the global alpha-tempered free energy (all clients' data; KLs to the
    prior): E[sum_n E log p(y_n|f) - KL(q(u)||p(u))] - KL(q(beta)||p) - alpha KL(q(Z)||p~)."""
    def one(lb, Z):
        hyper, L, post = _posterior_at(spec, state, lb, Z)
        prior = sgp.posterior(L, jnp.zeros_like(L), jnp.zeros(L.shape[0]))
        mean, var = sgp.predict_f(post, sgp.se(X_all, Z, hyper.lengthscale, hyper.variance),
                                  jnp.full(X_all.shape[0], hyper.variance))
        ell = sgp.expected_log_lik(spec.likelihood, y_all, mean, var, hyper.noise, mask_all)
        return ell - sgp.kl_whitened(post, prior)
    value = jnp.mean(jax.vmap(one)(*sample_q(spec, state, key, num)))
    if spec.learn_hyper:
        value -= _kl_diag(_q(state.beta_prior, state.t_beta), state.beta_prior)
    if spec.z_mode == "hvm":
        value -= spec.alpha * _kl_diag(_q(state.z_prior, state.t_z), state.z_prior)
    return value


def _kl_diag(q: DiagGaussian, p: DiagGaussian) -> jax.Array:
    mq, vq = to_moments(q)
    mp, vp = to_moments(p)
    return 0.5 * jnp.sum(vq / vp + (mq - mp) ** 2 / vp - 1.0 - jnp.log(vq / vp))
