"""Private GP co-training on small problems (two parties in every combination with one
uncertainty mode each, three parties, two DP settings): :func:`numbers` gives what the parties
end with (fitted hyperparameters, queried pool points, every released mean and reported
covariance row, test predictions and RMSE before and after, the DP epsilon)."""

from __future__ import annotations

import numpy as np

ROUNDS, FIT_STEPS, SEED = 4, 120, 3
CASES = {  # name: (combination, uncertainty, dp?, parties)
    "noisy-full": ("noisy", "full", None, 2),
    "hybrid-marginal": ("hybrid", "marginal", None, 2),
    "blocky-none": ("blocky", "none", None, 2),
    "noisy-full-3-parties": ("noisy", "full", None, 3),
    "noisy-full-dp-rkhs": ("noisy", "full", "rkhs", 2),
    "hybrid-marginal-dp-smith": ("hybrid", "marginal", "smith", 2),
}


def problem(parties: int) -> dict:
    """Two-view Gaussian data (r = 0.9), masked labelled halves; a third party (if any) sees
    view 1 unmasked."""
    rng = np.random.default_rng(11)

    def draw(n):
        y = rng.normal(size=n)
        views = [(0.9 * y + np.sqrt(1 - 0.81) * rng.normal(size=n))[:, None] for _ in range(2)]
        return views, y

    out = {"X": [], "y": []}
    for v in range(parties):
        views, y = draw(18)
        if v < 2:
            sign = np.where((1 - 2 * v) * views[v][:, 0] < 0, -1.0, 1.0)
            views, y = [x * sign[:, None] for x in views], y * sign
        out["X"].append(views[v % 2])
        out["y"].append(y)
    pool, _ = draw(40)
    test, y_test = draw(60)
    out.update(pool=[pool[v % 2] for v in range(parties)],
               test=[test[v % 2] for v in range(parties)], y_test=y_test)
    return out


def _dp(sensitivity):
    return None if sensitivity is None else dict(epsilon=1.0, delta=0.01,
                                                  sensitivity=sensitivity)


def new_run() -> dict:
    import jax
    import optax

    import fedppl
    from fedppl.algorithms import cotraining as ct

    out = {}
    for name, (comb, unc, sens, K) in CASES.items():
        d = problem(K)
        clients = fedppl.Clients.from_list(list(zip(d["X"], d["y"], strict=True)))
        dp = None if sens is None else ct.DPSettings(**_dp(sens))
        res = fedppl.CoTraining(comb, unc, dp, optimizer=optax.adam(0.05),
                                fit_steps=FIT_STEPS).run(
            jax.random.key(SEED), clients, ROUNDS, pool=d["pool"], test=d["test"],
            y_test=d["y_test"], progress_bar=False)
        pred = [res.predict(v, d["test"][v]) for v in range(K)]
        out[name] = _summary(res.messages, [p.params for p in res.parties], pred,
                             res.rmse_before, res.rmse_after, res.epsilon, K)
    return out


def _summary(messages, params, pred, before, after, eps, K) -> dict:
    """Arrays to compare; responses by (querier, responder) in protocol order."""
    qs = [m for m in messages if type(m).__name__ == "Query"]
    rs = [m for m in messages if type(m).__name__ == "Response"]  # both logs: protocol order
    cov = [np.asarray(m.cov_row) for m in rs if m.cov_row is not None]
    return {"queried": np.array([[q.pool_index for q in qs if q.sender == v] for v in range(K)],
                                float),
            "released_mean": np.array([m.mean for m in rs]),
            "dp_noise_std": np.array([m.dp_noise_std for m in rs]),
            "cov_rows": np.concatenate(cov) if cov else np.zeros(0),
            "hyperparameters": np.concatenate([np.concatenate([np.ravel(np.asarray(x))
                                                               for x in p]) for p in params]),
            "test_mean": np.concatenate([np.asarray(m) for m, _ in pred]),
            "test_var": np.concatenate([np.asarray(v) for _, v in pred]),
            "rmse_before": np.asarray(before, float), "rmse_after": np.asarray(after, float),
            "epsilon": np.array([np.nan if e is None else e for e in eps], float)}


def numbers() -> dict:
    return new_run()
