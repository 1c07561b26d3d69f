"""Reference posteriors for the model gallery, computed on the pooled data without fedppl.

For a gallery :class:`~examples.gallery.Entry` the clients' arrays are concatenated and two
references are fitted to the pooled data:

* :func:`nuts_reference`: NumPyro NUTS (dense mass matrix, 2 chains of 1000 warmup and 3000
  draws, run one after the other), the ground truth; its Monte Carlo error in a mean is about
  0.015 posterior sd per coordinate, so differences below ~0.05 sd are at its noise level;
* :func:`svi_reference`: NumPyro ``SVI`` with ``AutoMultivariateNormal`` (family ``"fullrank"``)
  or ``AutoNormal`` (``"meanfield"``), ``Trace_ELBO(num_particles=16)`` and optax Adam on an
  exponentially decaying step size (50000 steps, iterates averaged over the last 30%), the
  Gaussian-VI optimum a federated Gaussian method aims at. Two fits with different seeds agree to
  under 0.01 posterior sd in every mean (``--check-svi``).

Both return constrained draws keyed by site for all latent sites, global and local (deterministic
and observed/factor sites excluded). A model whose kwargs carry a subsample ``batch`` is run with
``batch=None`` (the full-data model). :func:`compare` reduces two sets of draws to the worst
standardised mean difference and worst sd ratio over every scalar coordinate.

Results are cached under ``benchmarks/results/gallery_refs/``: NUTS draws (float32) and the SVI
guide's parameters (its 20000 draws are regenerated from them with a fixed key), keyed by model,
data seed, inference seed and ``quick``; a cache file whose settings, model source or data differ
(:func:`fingerprint`) is recomputed.

Run as a script to fill the cache and print the SVI-vs-NUTS table::

    python benchmarks/gallery_references.py [--models a,b] [--quick] [--check-svi]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import numpyro
import optax
from numpyro import handlers
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

jax.config.update("jax_enable_x64", True)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.gallery import GALLERY, Entry  # noqa: E402

BENCHMARK = {
    "summary": ("the model gallery's pooled references (NUTS, and SVI as the Gaussian-VI "
                "optimum), cached for model_gallery; prints NUTS diagnostics and SVI against NUTS"),
    "data": None,
    "quick": ["--quick", "--models", "poisson_regression"],
    "full": [[]],
    "out": None,
    "cost": "quick ~1 min; full ~1 h (cached under benchmarks/results/gallery_refs/)",
}

DRAW_SEED = 20240  # one key for every reference draw: two fits differ only by their parameters
CACHE_DIR = ROOT / "benchmarks" / "results" / "gallery_refs"

NUTS_SETTINGS = {"num_warmup": 1000, "num_samples": 3000, "num_chains": 2,
                 "target_accept_prob": 0.9, "dense_mass": True}
NUTS_QUICK = {"num_warmup": 300, "num_samples": 300, "num_chains": 1,
              "target_accept_prob": 0.9, "dense_mass": True}
SVI_SETTINGS = {"steps": 50000, "lr": 0.01, "final_lr": 5e-5, "num_particles": 16,
                "average_last": 0.3, "num_draws": 20000}
SVI_QUICK = {"steps": 8000, "lr": 0.02, "final_lr": 2e-4, "num_particles": 8,
             "average_last": 0.3, "num_draws": 20000, "init_scale": 0.02}


# -- data ----------------------------------------------------------------------------------------


def pooled(clients_arrays) -> tuple[np.ndarray, ...]:
    """Concatenate the clients' positional arrays."""
    arity = len(clients_arrays[0])
    return tuple(np.concatenate([c[i] for c in clients_arrays]) for i in range(arity))


def full_data_kwargs(model_kwargs: dict) -> dict:
    """The kwargs of the full-data model: a subsample ``batch`` becomes ``None``."""
    return {**model_kwargs, "batch": None} if "batch" in model_kwargs else dict(model_kwargs)


def pooled_problem(entry: Entry, data_seed: int = 0) -> tuple[tuple[np.ndarray, ...], dict]:
    clients_arrays, model_kwargs = entry.make_data(data_seed)
    return pooled(clients_arrays), full_data_kwargs(model_kwargs)


def latent_sites(model, args, kwargs) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the latent sample sites (not observed, not factor, not deterministic)."""
    tr = handlers.trace(handlers.seed(model, 0)).get_trace(*args, **kwargs)
    return {name: tuple(np.shape(site["value"])) for name, site in tr.items()
            if site["type"] == "sample" and not site["is_observed"]}


# -- caching -------------------------------------------------------------------------------------


def _cache_path(entry: Entry, kind: str, seed: int, data_seed: int, quick: bool) -> Path:
    tail = "_quick" if quick else ""
    return CACHE_DIR / f"{entry.name}_d{data_seed}_{kind}_s{seed}{tail}.npz"


def fingerprint(entry: Entry, data_seed: int) -> str:
    """A hash of the model's source and its pooled data: a cache entry is stale when it changes."""
    h = hashlib.sha256(inspect.getsource(entry.model).encode())
    args, kwargs = pooled_problem(entry, data_seed)
    for a in args:
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(json.dumps(kwargs, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _load(path: Path, settings: dict, stamp: str):
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["__meta__"]))
        if meta.get("settings") != settings or meta.get("fingerprint") != stamp:
            return None
        arrays = {k: np.asarray(f[k]) for k in f.files if k != "__meta__"}
    return arrays, meta


def _save(path: Path, arrays: dict, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, __meta__=np.array(json.dumps(meta)), **arrays)
    tmp.replace(path)


# -- NUTS ----------------------------------------------------------------------------------------


def nuts_reference(entry: Entry, seed: int = 0, *, data_seed: int = 0, quick: bool = False,
                   use_cache: bool = True, with_info: bool = False):
    """NUTS on the pooled data: ``{site: (draws, *shape)}`` for all latent sites.

    ``with_info=True`` also returns a dict with seconds, divergences, min ESS and max R-hat.
    """
    settings = dict(NUTS_QUICK if quick else NUTS_SETTINGS)
    path = _cache_path(entry, "nuts", seed, data_seed, quick)
    stamp = fingerprint(entry, data_seed)
    hit = _load(path, settings, stamp) if use_cache else None
    if hit is None:
        args, kwargs = pooled_problem(entry, data_seed)
        sites = latent_sites(entry.model, args, kwargs)
        kernel = NUTS(entry.model, target_accept_prob=settings["target_accept_prob"],
                      dense_mass=settings["dense_mass"])
        mcmc = MCMC(kernel, num_warmup=settings["num_warmup"],
                    num_samples=settings["num_samples"], num_chains=settings["num_chains"],
                    chain_method="sequential", progress_bar=False)
        t0 = time.perf_counter()
        mcmc.run(jax.random.key(seed), *args, extra_fields=("diverging",), **kwargs)
        grouped = mcmc.get_samples(group_by_chain=True)
        jax.block_until_ready(grouped)
        seconds = time.perf_counter() - t0
        with np.errstate(invalid="ignore", divide="ignore"):  # constant entries of L_omega
            diag = numpyro.diagnostics.summary({k: grouped[k] for k in sites},
                                               group_by_chain=True)
        ess = min(float(np.nanmin(v["n_eff"])) for v in diag.values())
        rhat = max(float(np.nanmax(v["r_hat"])) for v in diag.values())
        draws = {k: np.asarray(grouped[k]).reshape((-1,) + sites[k]).astype(np.float32)
                 for k in sites}
        info = {"seconds": seconds,
                "divergences": int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum()),
                "min_ess": ess, "max_rhat": rhat if np.isfinite(rhat) else None}
        meta = {"settings": settings, "fingerprint": stamp, "info": info}
        if use_cache:
            _save(path, draws, meta)
    else:
        draws, meta = hit
    draws = {k: v.astype(np.float64) for k, v in draws.items()}
    return (draws, meta["info"]) if with_info else draws


# -- SVI -----------------------------------------------------------------------------------------


def _guide(entry: Entry, init_scale: float = 0.1):
    cls = AutoNormal if entry.family == "meanfield" else AutoMultivariateNormal
    return cls(entry.model, init_scale=init_scale)


def _draw(entry: Entry, params: dict, args, kwargs, num_draws: int) -> dict:
    guide = _guide(entry)
    handlers.seed(guide, 0)(*args, **kwargs)  # sets up the guide's prototype trace
    params = {k: jax.numpy.asarray(v) for k, v in params.items()}
    sample = jax.jit(lambda key: guide.sample_posterior(key, params, sample_shape=(num_draws,)))
    out = sample(jax.random.key(DRAW_SEED))
    sites = latent_sites(entry.model, args, kwargs)
    return {k: np.asarray(out[k], dtype=np.float64) for k in sites}


def svi_reference(entry: Entry, seed: int = 0, *, data_seed: int = 0, quick: bool = False,
                  use_cache: bool = True, with_info: bool = False):
    """Gaussian VI on the pooled data: ``{site: (num_draws, *shape)}`` constrained draws.

    Adam on an exponentially decaying step size (``lr`` to ``final_lr``); the guide parameters
    returned are the average over the last ``average_last`` fraction of the steps (Polyak), which
    removes most of the optimiser's noise.
    """
    settings = dict(SVI_QUICK if quick else SVI_SETTINGS)
    path = _cache_path(entry, "svi", seed, data_seed, quick)
    args, kwargs = pooled_problem(entry, data_seed)
    stamp = fingerprint(entry, data_seed)
    hit = _load(path, settings, stamp) if use_cache else None
    if hit is None:
        steps = settings["steps"]
        schedule = optax.exponential_decay(settings["lr"], transition_steps=steps,
                                           decay_rate=settings["final_lr"] / settings["lr"])
        guide = _guide(entry, settings.get("init_scale", 0.1))  # AutoGuide default 0.1
        svi = SVI(entry.model, guide, optax.adam(schedule),
                  Trace_ELBO(num_particles=settings["num_particles"]))
        tail = max(1, int(settings["average_last"] * steps))

        def body(carry, _):
            state, acc = carry
            state, loss = svi.update(state, *args, **kwargs)
            p = svi.get_params(state)
            i = state.optim_state[0]
            w = (i > steps - tail).astype(float)
            acc = jax.tree_util.tree_map(lambda a, x: a + w * x, acc, p)
            return (state, acc), loss

        @jax.jit
        def fit(state):
            acc = jax.tree_util.tree_map(jax.numpy.zeros_like, svi.get_params(state))
            (state, acc), losses = jax.lax.scan(body, (state, acc), None, length=steps)
            return jax.tree_util.tree_map(lambda a: a / tail, acc), losses

        t0 = time.perf_counter()
        # init outside jit: the guide's latent layout is then in trace order, as in _draw
        params, losses = fit(svi.init(jax.random.key(seed), *args, **kwargs))
        jax.block_until_ready(params)
        seconds = time.perf_counter() - t0
        params = {k: np.asarray(v) for k, v in params.items()}
        losses = np.asarray(losses)
        info = {"seconds": seconds, "final_loss": float(np.mean(losses[-tail:])),
                "loss_sd_tail": float(np.std(losses[-tail:]))}
        meta = {"settings": settings, "fingerprint": stamp, "info": info}
        if use_cache:
            _save(path, params, meta)
    else:
        params, meta = hit
    draws = _draw(entry, params, args, kwargs, settings["num_draws"])
    return (draws, meta["info"]) if with_info else draws


# -- comparison ----------------------------------------------------------------------------------


def _coord(site: str, shape: tuple[int, ...], i: int) -> str:
    if not shape:
        return site
    return f"{site}[{','.join(str(j) for j in np.unravel_index(i, shape))}]"


def compare(draws: dict, reference: dict) -> dict:
    """Worst ``|mean diff| / reference sd`` and worst sd ratio (max of r and 1/r) over every scalar
    coordinate of every site present in both; coordinates constant in the reference (e.g. the
    fixed entries of a Cholesky factor) are skipped."""
    worst_mean, mean_at, worst_sd, sd_at, n = 0.0, None, 1.0, None, 0
    for site in sorted(set(draws) & set(reference)):
        a, r = np.asarray(draws[site], float), np.asarray(reference[site], float)
        shape = r.shape[1:]
        if a.shape[1:] != shape:
            raise ValueError(f"site {site!r}: shapes {a.shape[1:]} and {shape} differ")
        a, r = a.reshape(len(a), -1), r.reshape(len(r), -1)
        r_sd, a_sd = r.std(0), a.std(0)
        for i in np.nonzero(r_sd > 1e-9 * (1.0 + np.abs(r.mean(0))))[0]:
            n += 1
            m = abs(a[:, i].mean() - r[:, i].mean()) / r_sd[i]
            ratio = a_sd[i] / r_sd[i]
            s = max(ratio, 1.0 / ratio) if ratio > 0 else np.inf
            if m >= worst_mean:
                worst_mean, mean_at = float(m), _coord(site, shape, i)
            if s >= worst_sd:
                worst_sd, sd_at = float(s), _coord(site, shape, i)
    return {"mean_error": worst_mean, "mean_at": mean_at, "sd_ratio": worst_sd, "sd_at": sd_at,
            "coordinates": n}


def local_reference(reference: dict, local_sites, k: int) -> dict:
    """Group ``k``'s slice (first axis after the draws) of each local site of a pooled reference."""
    return {s: reference[s][:, k] for s in local_sites if s in reference}


# -- script --------------------------------------------------------------------------------------


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated gallery names (default all)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--check-svi", action="store_true",
                   help="also fit SVI with seed 1 and compare it with seed 0")
    a = p.parse_args(argv)
    names = a.models.split(",") if a.models else list(GALLERY)
    print("| model | NUTS s | div | min ESS | max R-hat | SVI s | SVI mean err (sd) | at "
          "| SVI sd ratio | at |" + (" seed 0 vs 1 mean | sd ratio |" if a.check_svi else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if a.check_svi else ""))
    for name in names:
        entry = GALLERY[name]
        nuts, ni = nuts_reference(entry, 0, data_seed=a.data_seed, quick=a.quick, with_info=True)
        svi, si = svi_reference(entry, 0, data_seed=a.data_seed, quick=a.quick, with_info=True)
        c = compare(svi, nuts)
        rhat = "-" if ni["max_rhat"] is None else f"{ni['max_rhat']:.3f}"
        row = (f"| {name} | {ni['seconds']:.1f} | {ni['divergences']} | {ni['min_ess']:.0f} "
               f"| {rhat} | {si['seconds']:.1f} | {c['mean_error']:.3f} | {c['mean_at']} "
               f"| {c['sd_ratio']:.3f} | {c['sd_at']} |")
        if a.check_svi:
            c2 = compare(svi_reference(entry, 1, data_seed=a.data_seed, quick=a.quick), svi)
            row += f" {c2['mean_error']:.4f} | {c2['sd_ratio']:.4f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
