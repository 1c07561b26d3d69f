"""``fedppl demo``: federated Bayesian logistic regression on the breast-cancer data.

The Wisconsin breast-cancer data (569 patients, 30 features; shipped with scikit-learn) are
standardised, split 80/20 into train and test, and the training part is cut into K clients by
sorting on the feature most correlated with the label (skewed clients). The demo fits PVI with
both schedules, global VI on the pooled data and each client alone, prints a table and writes a
plot of the local free energies over rounds and of posterior marginals.

Example::

    $ fedppl demo --clients 10 --rounds 10 --plot fedppl-demo.png
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedppl import partition
from fedppl.families import gaussian as g
from fedppl.guides import PVIGuide
from fedppl.infer.variational import PVI, GlobalVI, PVIResult
from fedppl.models import logistic_regression

__all__ = ["run_demo", "demo_task", "load_breast_cancer", "RUNTIMES"]

RUNTIMES = ("embedded", "flower", "flower-deployment")


@dataclass
class Row:
    method: str
    accuracy: float
    log_lik: float
    elbo: float
    rounds: int
    seconds: float
    history: dict[str, Any] = field(default_factory=dict, repr=False)  # the run's, if any
    rejected: list[Any] = field(default_factory=list, repr=False)


def load_breast_cancer(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Standardised train/test arrays ``X_train, y_train, X_test, y_test`` (80/20)."""
    from sklearn.datasets import load_breast_cancer as sk_load

    X, y = sk_load(return_X_y=True)
    perm = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = perm[:cut], perm[cut:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    return (X[tr] - mu) / sd, y[tr].astype(float), (X[te] - mu) / sd, y[te].astype(float)


def predictive(samples: dict, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Test accuracy and average log predictive density of the posterior draws."""
    logits = samples["w"] @ X.T + samples["b"][:, None]
    logp1 = jax.nn.log_sigmoid(logits)
    logp0 = jax.nn.log_sigmoid(-logits)
    lp = jnp.where(y[None, :] > 0.5, logp1, logp0)
    log_pred = jax.scipy.special.logsumexp(lp, axis=0) - jnp.log(lp.shape[0])
    prob = jnp.mean(jnp.exp(logp1), axis=0)
    return float(jnp.mean((prob > 0.5) == (y > 0.5))), float(jnp.mean(log_pred))


def demo_task(run_config: dict[str, Any]):
    """The demo's PVI run as a :class:`fedppl.runtime.flower.Task` (from its run config: clients,
    rounds, local-steps, seed, schedule, damping): what every runtime runs."""
    from fedppl.runtime.task import Task

    jax.config.update("jax_enable_x64", True)
    K, seed = int(run_config["clients"]), int(run_config["seed"])
    Xtr, ytr, _, _ = load_breast_cancer(seed)
    clients = partition.by_feature(Xtr, ytr, K)
    model = logistic_regression
    pvi = PVI(model, PVIGuide(model, family="meanfield"), schedule=str(run_config["schedule"]),
              damping=float(run_config["damping"]),
              local_steps=int(run_config["local-steps"]))
    return Task(pvi, clients.client, K, int(run_config["rounds"]), seed=seed)


def _on_flower(runtime: str, config: dict[str, Any]) -> PVIResult:
    from fedppl.runtime.flower import FlowerApp

    if runtime == "flower":
        return FlowerApp(demo_task).simulate(config)
    if runtime != "flower-deployment":
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    import tempfile

    from fedppl.runtime.deployment import LocalDeployment, write_app

    K = int(config["clients"])
    with tempfile.TemporaryDirectory() as tmp, LocalDeployment(K) as fed:
        app = write_app(Path(tmp) / "app", "fedppl_experiments.demo:demo_task",
                        {**config, "result-dir": ""})
        fed.run(app, {"result-dir": str(Path(tmp) / "out")}, timeout=3600)
        history = json.loads((Path(tmp) / "out" / "result.json").read_text())["history"]
        with np.load(Path(tmp) / "out" / "state.npz") as f:
            leaves = [f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))]
    # the server's last state, in the shape the method's own set-up gives it, as a result
    task = demo_task(config)
    clients = partition.by_feature(*load_breast_cancer(int(config["seed"]))[:2], K)
    state = task.method.init(jax.random.key(task.seed), clients)
    server = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state.server),
                                          [jnp.asarray(a) for a in leaves])
    assert state.plan is not None  # init's state
    return state.plan.result(state._replace(server=server),
                               {k: np.asarray(v, float) for k, v in history.items()}, [])


def run_demo(num_clients: int = 10, num_rounds: int = 10, local_steps: int = 100,
             out: str | None = "fedppl-demo.png", seed: int = 0, progress_bar: bool = True,
             runtime: str = "embedded") -> list[Row]:
    """Run the comparison, print the table, write the plot; returns the table rows (each with
    its run's history; ``fedppl demo --json`` writes them). ``runtime`` runs the PVI rows on the
    embedded runtime, Flower's Simulation Engine (``"flower"``) or a local Deployment Engine
    (``"flower-deployment"``). :func:`fedppl_experiments.demo_pyro.run_demo_pyro` runs the
    same comparison with the Pyro port."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    jax.config.update("jax_enable_x64", True)
    Xtr, ytr, Xte, yte = load_breast_cancer(seed)
    clients = partition.by_feature(Xtr, ytr, num_clients)
    model = logistic_regression
    key = jax.random.key(seed)
    rows, runs = [], {}

    def record(name, result: PVIResult, rounds, seconds):
        acc, ll = predictive(result.sample(jax.random.key(1), 2000), Xte, yte)
        rows.append(Row(name, acc, ll, float(result.history["elbo"][-1]), rounds, seconds,
                        dict(result.history), list(result.rejected)))
        runs[name] = result

    for schedule, damping in [("sequential", 1.0), ("synchronous", 0.5)]:
        t0 = time.perf_counter()
        config = {"clients": num_clients, "rounds": num_rounds, "local-steps": local_steps,
                  "seed": seed, "schedule": schedule, "damping": damping}
        if runtime == "embedded":
            res = demo_task(config).method.run(key, clients, num_rounds,
                                               progress_bar=progress_bar)
        else:
            res = _on_flower(runtime, config)
        record(f"PVI {schedule}" + (f" (damping {damping})" if damping < 1 else ""), res,
               num_rounds, time.perf_counter() - t0)

    t0 = time.perf_counter()
    ref = GlobalVI(model, PVIGuide(model, family="meanfield"), num_steps=10 * local_steps).run(
        key, clients, progress_bar=progress_bar)
    record("global VI (pooled data)", ref, 1, time.perf_counter() - t0)

    rows.extend(_clients_alone(model, clients, local_steps, key, Xte, yte))
    _print_table(rows, clients)
    if out:
        _plot(runs, out)
        print(f"plot written to {out}")
    return rows


def _clients_alone(model, clients, local_steps, key, Xte, yte) -> list[Row]:
    """Each client's own VI posterior: one undamped synchronous round from the prior gives
    q_k = prior * t_k, the optimum of client k's ELBO on its data alone."""
    guide = PVIGuide(model, family="meanfield")
    t0 = time.perf_counter()
    res = PVI(model, guide, schedule="synchronous", local_steps=local_steps,
              elbo_samples=0).run(key, clients, 1, progress_bar=False)
    seconds = time.perf_counter() - t0
    scores = []
    for k in range(clients.num_clients):
        factor = jax.tree_util.tree_map(lambda x, k=k: x[k], res.factors)
        q_k = g.product(guide.prior, factor)
        scores.append(predictive(guide.sample(jax.random.key(2), q_k, 2000), Xte, yte))
    acc, ll = np.array(scores).T
    return [Row("client alone (mean of K)", acc.mean(), ll.mean(), np.nan, 1, seconds),
            Row("client alone (worst)", acc.min(), ll.min(), np.nan, 1, seconds)]


def _print_table(rows: list[Row], clients) -> None:
    print(f"\nBayesian logistic regression, breast cancer, {clients.num_clients} clients "
          f"(sizes {clients.sizes.min()}-{clients.sizes.max()}, sorted by one feature)\n")
    print(f"| {'method':<32} | {'test acc':>8} | {'test log-lik':>12} | {'ELBO':>9} | "
          f"{'rounds':>6} | {'seconds':>7} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 14}|{'-' * 11}|{'-' * 8}|{'-' * 9}|")
    for r in rows:
        elbo = "" if np.isnan(r.elbo) else f"{r.elbo:.2f}"
        print(f"| {r.method:<32} | {r.accuracy:>8.3f} | {r.log_lik:>12.4f} | {elbo:>9} | "
              f"{r.rounds:>6} | {r.seconds:>7.1f} |")
    print()


def _plot(runs: dict[str, PVIResult], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    seq = runs["PVI sequential"]
    fe = seq.history["free_energy"]
    for k in range(fe.shape[1]):
        axes[0].plot(np.arange(1, fe.shape[0] + 1), fe[:, k], lw=1)
    axes[0].set(title="local free energy per client (sequential)", xlabel="round",
                ylabel="F_k")
    for name, res in runs.items():
        if name.startswith("PVI"):
            axes[1].plot(np.arange(1, len(res.history["elbo"]) + 1), res.history["elbo"],
                         marker="o", ms=3, label=name)
    axes[1].axhline(runs["global VI (pooled data)"].history["elbo"][-1], color="k", ls="--",
                    label="global VI")
    axes[1].set(title="global ELBO", xlabel="round")
    axes[1].legend(fontsize=8)
    xs = np.linspace(-3, 3, 400)
    for name, res in runs.items():
        mean, var = res.mean_and_cov()
        var = np.diag(var) if np.ndim(var) == 2 else var
        for j, ls in zip(range(3), ["-", "--", ":"], strict=True):
            axes[2].plot(xs, np.exp(-0.5 * (xs - mean[j]) ** 2 / var[j])
                         / np.sqrt(2 * np.pi * var[j]), ls=ls,
                         label=f"{name.split(' (')[0]} w[{j}]", lw=1.2)
    axes[2].set(title="posterior marginals of w[0..2]", xlabel="value")
    axes[2].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
