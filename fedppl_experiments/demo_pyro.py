"""``fedppl demo --ppl pyro``: the demo's comparison with the Pyro port.

The same data, split, model (Bayesian logistic regression, written in Pyro:
:func:`fedppl.pyro.models.logistic_regression`), guide family (mean-field), local step (the
natural-gradient solver), schedules, table and plot as :mod:`fedppl_experiments.demo`, with
:mod:`fedppl.pyro` doing the inference in float64 torch. The figures agree with the NumPyro demo's
within Monte Carlo error (the two draw their fixed base draws and ELBO samples from different
generators).

Example::

    $ fedppl demo --ppl pyro --clients 10 --rounds 10
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import numpyro
import torch

from fedppl import partition
from fedppl.pyro import PVI, GlobalVI, PVIGuide, PVIResult
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.models import logistic_regression
from fedppl_experiments.demo import Row, _plot, _print_table, load_breast_cancer

__all__ = ["run_demo_pyro", "predictive"]


def predictive(samples: dict, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Test accuracy and average log predictive density of the posterior draws."""
    w, b = samples["w"].double(), samples["b"].double()
    logits = w @ torch.as_tensor(X).T + b[:, None]
    logp1, logp0 = torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits)
    lp = torch.where(torch.as_tensor(y)[None, :] > 0.5, logp1, logp0)
    log_pred = torch.logsumexp(lp, 0) - math.log(lp.shape[0])
    prob = logp1.exp().mean(0)
    return (float(((prob > 0.5) == torch.as_tensor(y > 0.5)).double().mean()),
            float(log_pred.mean()))


class _AsNumpy:
    """A result as the plot reads it (history and moments as NumPy arrays)."""

    def __init__(self, result: PVIResult):
        self.history = result.history
        self._moments = tuple(x.numpy() for x in result.mean_and_cov())

    def mean_and_cov(self):
        return self._moments


def run_demo_pyro(num_clients: int = 10, num_rounds: int = 10, local_steps: int = 100,
                  out: str | None = "fedppl-demo.png", seed: int = 0, progress_bar: bool = True
                  ) -> list[Row]:
    """The demo with :mod:`fedppl.pyro` (see :func:`fedppl_experiments.demo.run_demo`)."""
    before = torch.get_default_dtype()
    # torch float64 over JAX's float64 (the core runs the algebra, torch the model)
    numpyro.enable_x64()
    torch.set_default_dtype(torch.float64)
    try:
        return _run(num_clients, num_rounds, local_steps, out, seed, progress_bar)
    finally:
        torch.set_default_dtype(before)


def _run(num_clients, num_rounds, local_steps, out, seed, progress_bar) -> list[Row]:
    Xtr, ytr, Xte, yte = load_breast_cancer(seed)
    clients = partition.by_feature(Xtr, ytr, num_clients)
    model = logistic_regression
    rows: list[Row] = []
    runs: dict[str, Any] = {}

    def key():
        return torch.Generator().manual_seed(seed)

    def record(name: str, result: PVIResult, rounds: int, seconds: float) -> None:
        acc, ll = predictive(result.sample(torch.Generator().manual_seed(1), 2000), Xte, yte)
        rows.append(Row(name, acc, ll, float(result.history["elbo"][-1]), rounds, seconds,
                        dict(result.history), list(result.rejected)))
        runs[name] = _AsNumpy(result)

    for schedule, damping in [("sequential", 1.0), ("synchronous", 0.5)]:
        t0 = time.perf_counter()
        res = PVI(model, PVIGuide(model, family="meanfield"), schedule, damping,
                  local_steps=local_steps).run(key(), clients, num_rounds,
                                               progress_bar=progress_bar)
        record(f"PVI {schedule}" + (f" (damping {damping})" if damping < 1 else ""), res,
               num_rounds, time.perf_counter() - t0)
    t0 = time.perf_counter()
    ref = GlobalVI(model, PVIGuide(model, family="meanfield"), num_steps=10 * local_steps).run(
        key(), clients)
    record("global VI (pooled data)", ref, 1, time.perf_counter() - t0)
    rows.extend(_clients_alone(model, clients, local_steps, key(), Xte, yte))
    _print_table(rows, clients)
    print("(fedppl.pyro: the Pyro port, torch float64)\n")
    if out:
        _plot(runs, out)
        print(f"plot written to {out}")
    return rows


def _clients_alone(model, clients, local_steps, key, Xte, yte) -> list[Row]:
    """Each client's own VI posterior: one undamped synchronous round from the prior."""
    guide = PVIGuide(model, family="meanfield")
    t0 = time.perf_counter()
    res = PVI(model, guide, "synchronous", local_steps=local_steps, elbo_samples=0).run(
        key, clients, 1, progress_bar=False)
    seconds = time.perf_counter() - t0
    scores = []
    for k in range(clients.num_clients):
        q_k = g.product(guide.prior, g.index(res.factors, k))
        scores.append(predictive(guide.sample(torch.Generator().manual_seed(2), q_k, 2000),
                                 Xte, yte))
    acc, ll = np.array(scores).T
    return [Row("client alone (mean of K)", acc.mean(), ll.mean(), np.nan, 1, seconds),
            Row("client alone (worst)", acc.min(), ll.min(), np.nan, 1, seconds)]
