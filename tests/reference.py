"""Pooled-data references for tests: numpyro's own SVI with the same Gaussian family, and the
exact posterior of random intercepts by quadrature (:func:`grid_posterior`).

``pooled_svi`` fits ``AutoMultivariateNormal`` (``family="fullrank"``) or ``AutoNormal``
(``"meanfield"``) to the pooled data with numpyro's ``SVI`` and returns, per site, the mean and
standard deviation of the fitted guide in the unconstrained space, the space where fedppl's q
lives; :func:`unconstrained_moments` reads the same from a fedppl result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from numpyro.infer import SVI, Trace_ELBO, init_to_median, init_to_value
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from scipy import stats


def pooled_svi(model, args, kwargs=None, family="fullrank", steps=6000, particles=16, seed=0,
               lr=2e-2, init=None):
    """Per-site unconstrained ``(mean, sd)`` of numpyro's SVI fit (adam, exponential decay to
    1% of ``lr``); ``init`` (constrained values by site) picks the mode of a multimodal
    posterior to start from."""
    kwargs = kwargs or {}
    init_fn = init_to_median if init is None else init_to_value(values=init)
    guide = (AutoMultivariateNormal(model, init_loc_fn=init_fn) if family == "fullrank"
             else AutoNormal(model, init_loc_fn=init_fn))
    schedule = optax.exponential_decay(lr, steps, 0.01)
    svi = SVI(model, guide, optax.adam(schedule), Trace_ELBO(num_particles=particles))
    res = svi.run(jax.random.key(seed), steps, *args, progress_bar=False, **kwargs)
    p = res.params
    if family == "fullrank":
        tril = p["auto_scale_tril"]
        sd = jnp.sqrt(jnp.sum(tril**2, axis=-1))
        means, sds = guide._unpack_latent(p["auto_loc"]), guide._unpack_latent(sd)
    else:
        names = [k[: -len("_auto_loc")] for k in p if k.endswith("_auto_loc")]
        means = {n: p[f"{n}_auto_loc"] for n in names}
        sds = {n: p[f"{n}_auto_scale"] for n in names}
    return {n: (np.ravel(means[n]), np.ravel(sds[n])) for n in means}


def unconstrained_moments(result, client=None):
    """Per-site unconstrained ``(mean, sd)`` of a fedppl result's q (and, with ``client``, of
    that client's local sites under its joint)."""
    from fedppl.families import gaussian as g

    guide = result.guide
    mean, cov = result.mean_and_cov()
    var = cov if cov.ndim == 1 else jnp.diagonal(cov)
    out = {s.name: (np.asarray(mean[s.slice]), np.sqrt(np.asarray(var[s.slice])))
           for s in guide.layout.sites}
    if client is not None and result.local is not None:
        local = jax.tree_util.tree_map(lambda x: x[client], result.local)
        joint = g.join(result.q, local, guide.client_diag)
        jm, jc = g.to_moments(joint)
        jv = jc if jc.ndim == 1 else jnp.diagonal(jc)
        D = guide.layout.dim
        for s in guide.local_layout.sites:
            sl = slice(D + s.start, D + s.start + s.size)
            out[s.name] = (np.asarray(jm[sl]), np.sqrt(np.asarray(jv[sl])))
    return out


def worst_gap(ours, ref):
    """Worst ``|mean - mean_ref| / sd_ref`` and worst ``|sd / sd_ref - 1|`` over shared sites."""
    mean_gap = max(float(np.max(np.abs(ours[n][0] - ref[n][0]) / ref[n][1])) for n in ref
                   if n in ours)
    sd_gap = max(float(np.max(np.abs(ours[n][1] / ref[n][1] - 1))) for n in ref if n in ours)
    return mean_gap, sd_gap


def grid_posterior(groups):
    """Mean and sd of ``(mu, log tau)`` by quadrature of the exact marginal likelihood."""
    mu = np.linspace(-2.5, 3.5, 241)
    lt = np.linspace(-7, 2.5, 381)
    M, L = np.meshgrid(mu, lt, indexing="ij")
    T2 = np.exp(2 * L)
    logp = stats.norm.logpdf(M) + stats.norm.logpdf(L)  # LogNormal(0, 1) in log tau, with Jacobian
    for yj in groups:
        n, s, ss = len(yj), yj.sum(), (yj**2).sum()
        # N(mu 1, I + tau^2 11'): inverse I - c 11' with c = tau^2 / (1 + n tau^2)
        c = T2 / (1 + n * T2)
        quad = ss - 2 * M * s + n * M**2 - c * (s - n * M) ** 2
        logp += -0.5 * (quad + np.log1p(n * T2) + n * np.log(2 * np.pi))
    w = np.exp(logp - logp.max())
    w /= w.sum()
    mean = np.array([np.sum(w * M), np.sum(w * L)])
    sd = np.sqrt(np.array([np.sum(w * M**2), np.sum(w * L**2)]) - mean**2)
    return mean, sd
