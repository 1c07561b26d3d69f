"""The federated sparse GPs (dpo with diagonal and full S_k, cpo, fedavg-z, fixed, each in both
schedules; global with a Gaussian and a Bernoulli likelihood) and FSGP (both inducing-point
inits) on small problems: :func:`numbers` gives the final state, the history and the test
predictions of each."""

from __future__ import annotations

import numpy as np

# (name, method, settings); every case runs ROUNDS rounds
SGP_CASES = [
    ("dpo sequential", "dpo", {}),
    ("dpo synchronous", "dpo", {"schedule": "synchronous", "damping": 0.5}),
    ("dpo full S_k sequential", "dpo", {"covariance": "full", "num_samples": 2}),
    ("cpo sequential", "cpo", {}),
    ("cpo synchronous", "cpo", {"schedule": "synchronous", "damping": 0.5}),
    ("fedavg-z sequential", "fedavg-z", {}),
    ("fedavg-z synchronous", "fedavg-z", {"schedule": "synchronous"}),
    ("fixed sequential", "fixed", {}),
    ("fixed synchronous", "fixed", {"schedule": "synchronous", "damping": 0.5}),
    ("global gaussian", "global", {}),
    ("global bernoulli", "global", {"likelihood": "bernoulli"}),
]
FSGP_CASES = [("fsgp client-data", {}), ("fsgp random-normal", {"init_inducing": "random-normal"})]
BASE = {"num_inducing": 5, "local_steps": 15, "inner_steps": 10, "max_pseudo": 10}
ROUNDS, SEED = 4, 3


def data(bernoulli: bool = False):
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (36, 2))
    f = np.sin(2 * X[:, 0]) + 0.5 * X[:, 1]
    y = (f > 0).astype(float) if bernoulli else f + 0.1 * rng.normal(size=36)
    return X, y, np.linspace(-2, 2, 14).reshape(7, 2)


def clients(X, y):
    from fedppl.partition import from_indices

    return from_indices(X, y, [np.arange(0, 10), np.arange(10, 24), np.arange(24, 36)])


# -- each side (run in its own process) ---------------------------------------------------------


def run_new() -> dict:
    import jax
    import optax

    from fedppl.infer.fedavg_gp import FSGP
    from fedppl.infer.sparse_gps import FederatedSGP

    out = {}
    for name, method, extra in SGP_CASES:
        X, y, Xt = data(extra.get("likelihood") == "bernoulli")
        front = FederatedSGP(method, **BASE, **extra, optimizer=optax.adam(1e-2))
        res = front.run(jax.random.key(SEED), clients(X, y), ROUNDS, progress_bar=False)
        local = np.nansum(res.history["local_free_energy"], axis=1)
        out[name] = _sgp_numbers(res, Xt, _new_state, res.history, local)
    for name, extra in FSGP_CASES:
        X, y, Xt = data()
        res = FSGP(num_inducing=5, local_steps=15, **extra).run(
            jax.random.key(SEED), clients(X, y), ROUNDS, progress_bar=False)
        h = res.params.hyper
        out[name] = _fsgp_numbers((h.log_lengthscale, h.log_variance, h.log_noise,
                                   res.params.inducing), res, Xt,
                                  np.asarray(res.history["bound"]), res.rounds_to_convergence())
    return out


def _sgp_numbers(res, Xt, state_fn, history, local) -> dict:
    mean, var = res.predict(Xt)
    numbers = {**state_fn(res.state), "predict mean": mean, "predict var": var,
               "free_energy": history["free_energy"], "local_free_energy": local}
    if res.spec.likelihood == "gaussian":
        numbers["log_likelihood"] = res.log_likelihood(Xt, np.sin(2 * Xt[:, 0]))
    return {k: np.asarray(v, dtype=float) for k, v in numbers.items()}


def _new_state(s) -> dict:
    return _state(s, np.asarray(s.pseudo.s_raw))


def _state(s, s_raw) -> dict:
    return {"t_beta": np.concatenate([s.t_beta.nat1, s.t_beta.prec], -1),
            "t_z": np.concatenate([s.t_z.nat1, s.t_z.prec], -1), "z_point": s.z_point,
            "pseudo V": s.pseudo.V, "pseudo m": s.pseudo.m, "pseudo s_raw": s_raw}


def _fsgp_numbers(params, res, Xt, bound, r2c) -> dict:
    mean, var = res.predict(Xt)
    names = ("log_lengthscale", "log_variance", "log_noise", "inducing")
    out = {n: np.asarray(p, dtype=float) for n, p in zip(names, params, strict=True)}
    out.update({"predict mean": np.asarray(mean), "predict var": np.asarray(var),
                "bound (rounds 1..)": bound, "stats scatter": np.asarray(res.stats.scatter),
                "stats proj": np.asarray(res.stats.proj),
                "rounds_to_convergence": np.asarray(float(r2c))})
    return out


# -- comparing -----------------------------------------------------------------------------------


def numbers() -> dict:
    return run_new()
