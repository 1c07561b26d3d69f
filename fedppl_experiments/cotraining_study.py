"""The co-training study of thesis Ch. 4: a factorial grid of runs and its stratified tables.

Each run co-trains two parties (:class:`fedppl.CoTraining`) for ``rounds`` rounds on simulated
two-view data (:func:`fedppl_experiments.cotraining_data.simulate_two_views`) or on CCPP split
into two views (:func:`~fedppl_experiments.cotraining_data.ccpp_two_views`) and records both
parties' test RMSE before and after. A configuration's ``seed`` draws the data and, as
``jax.random.key(seed)``, the run's DP noise. Tables 4.3-4.15 of the thesis are means and
standard deviations of those RMSEs stratified by some of the factors (combination, uncertainty
integration, masking, n_obs, DP, r, conditional independence); :func:`stratified_table` makes
any of them.

Example::

    >>> rows = [run_one(Config("noisy", u, masked=True, r=0.9, n_obs=8, seed=0), rounds=2,
    ...                 fit_steps=20) for u in ("none", "full")]
    >>> print(stratified_table(rows, by=["masked"], columns="uncertainty").splitlines()[0])
    | masked | none | full |
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from fedppl.algorithms import cotraining as ct
from fedppl.clients import Clients
from fedppl.infer.co_training import CoTraining, CoTrainingResult
from fedppl_experiments import cotraining_data as data

__all__ = ["Config", "DEFAULT_DP", "Parties", "parties_of", "run_config", "run_one", "grid",
           "stratified_table"]

# the thesis's setting (Sec. 4.4): epsilon = 1, delta = 0.00625; one label moves by at most d = 1
# (standardised targets); the exact RKHS sensitivity, since fitted kernel variances exceed 1
DEFAULT_DP = ct.DPSettings(epsilon=1.0, delta=0.00625, d=1.0, sensitivity="rkhs")


class Config(NamedTuple):
    combination: str = "noisy"
    uncertainty: str = "full"
    masked: bool = False
    cond_indep: bool = True
    r: float = 0.9
    n_obs: int = 25
    dp: bool = False
    seed: int = 0
    dataset: str = "simulated"  # or a path to the UCI power-plant folder


class Parties(NamedTuple):
    """A co-training problem as :meth:`fedppl.CoTraining.run` takes it: the parties' private
    ``(X, y)`` as clients, and per party its pool view and test inputs, with the test targets."""

    clients: Clients
    pool: tuple[np.ndarray, ...]
    test: tuple[np.ndarray, ...]
    y_test: np.ndarray


def parties_of(problem: data.TwoViewData) -> Parties:
    """The co-training inputs of a two-view problem (party ``v`` is named ``party v``)."""
    V = problem.n_views
    clients = Clients.from_list([problem.party(v) for v in range(V)],
                                names=[f"party {v}" for v in range(V)])
    return Parties(clients, tuple(problem.pool), tuple(problem.X_test),
                   np.asarray(problem.y_test))


def _problem(cfg: Config) -> data.TwoViewData:
    if cfg.dataset == "simulated":
        return data.simulate_two_views(cfg.r, cfg.cond_indep, cfg.masked, cfg.n_obs,
                                       seed=cfg.seed)
    return data.ccpp_two_views(cfg.dataset, cfg.n_obs, cfg.masked, seed=cfg.seed)


def run_config(cfg: Config, rounds: int = 25, dp: ct.DPSettings = DEFAULT_DP,
               fit_steps: int = 300, progress_bar: bool = False) -> CoTrainingResult:
    """One co-training run of a configuration (DP settings ``dp`` where ``cfg.dp``)."""
    p = parties_of(_problem(cfg))
    method = CoTraining(cfg.combination, cfg.uncertainty, dp if cfg.dp else None,
                        fit_steps=fit_steps)
    return method.run(jax.random.key(cfg.seed), p.clients, rounds, pool=p.pool, test=p.test,
                      y_test=p.y_test, progress_bar=progress_bar)


def run_one(cfg: Config, rounds: int = 25, dp: ct.DPSettings = DEFAULT_DP,
            fit_steps: int = 300) -> dict:
    """One co-training run; a flat dict of the configuration and the results."""
    t0 = time.perf_counter()
    out = run_config(cfg, rounds, dp, fit_steps)
    row = cfg._asdict()
    row.update(rmse_before=out.rmse_before, rmse_after=out.rmse_after,
               rmse=float(np.mean(out.rmse_after)), epsilon=out.epsilon,
               seconds=time.perf_counter() - t0)
    return row


def grid(combinations: Sequence[str] = ct.COMBINATIONS,
         uncertainties: Sequence[str] = ct.UNCERTAINTIES, masked: Sequence[bool] = (False, True),
         cond_indep: Sequence[bool] = (False, True), rs: Sequence[float] = (0.5, 0.75, 0.9, 0.99),
         n_obs: Sequence[int] = (25, 50, 200), dp: Sequence[bool] = (False, True),
         seeds: Iterable[int] = range(10), dataset: str = "simulated") -> list[Config]:
    """The full factorial design (the thesis's, by default)."""
    return [Config(c, u, m, ci, r, n, d, s, dataset) for c, u, m, ci, r, n, d, s in
            itertools.product(combinations, uncertainties, masked, cond_indep, rs, n_obs, dp,
                              list(seeds))]


def stratified_table(rows: Sequence[dict], by: Sequence[str], value: str = "rmse",
                     columns: str = "combination") -> str:
    """Markdown table of mean ± sd of ``value`` over runs, rows by ``by``, columns by
    ``columns`` (the layout of Tables 4.3-4.12)."""
    cols = list(dict.fromkeys(r[columns] for r in rows))
    keys = sorted({tuple(r[b] for b in by) for r in rows})
    head = "| " + " | ".join(list(by) + [str(c) for c in cols]) + " |"
    lines = [head, "|" + "---|" * len(by) + "---:|" * len(cols)]
    for key in keys:
        cells = []
        for c in cols:
            vals = [_value(r, value) for r in rows
                    if r[columns] == c and tuple(r[b] for b in by) == key]
            cells.append(f"{np.mean(vals):.3f} ± {np.std(vals):.3f}" if vals else "")
        lines.append("| " + " | ".join([str(k) for k in key] + cells) + " |")
    return "\n".join(lines)


def _value(row: dict, value: str) -> float:
    """``rmse_after_0`` / ``rmse_before_1`` pick one party; other names are row entries."""
    for stem in ("rmse_after_", "rmse_before_"):
        if value.startswith(stem):
            return float(row[stem[:-1]][int(value[len(stem):])])
    return float(row[value])
