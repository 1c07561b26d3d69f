# %% [markdown]
# # Federated sparse GP on five partitions: PVI with an HVM over inducing locations vs FedAvg-Z
#
# The 1-D experiment of the federated sparse GP paper (Sec. 6.1, Fig. 1). Five clients each
# hold a cluster of points; the hyperparameters are fixed at their true values. Both methods use
# DPO factors; FedAvg-Z learns one set of inducing locations by averaging the clients' local
# optima (Alg. 1), PVI keeps a distribution q(Z) refined by every client (Alg. 2). After 10 and
# 20 communications we plot the posterior and the inducing locations (triangles; arrows at the
# edge mark locations outside the plotted range), and measure how far the inducing locations
# sit from the data and how well each posterior predicts the noiseless function.
#
# What we see (quick settings, seed 0): PVI's fit improves from 10 to 20 communications (test
# log-likelihood of f -0.30 -> -0.25), FedAvg-Z's gets worse (-0.60 -> -1.06) as the averaged
# locations bunch together and the factors, learnt at each client's own locations, no longer
# fit at the averaged ones. In our runs FedAvg-Z's locations stay within the data range; the
# paper's locations moving *away* from the data is not reproduced at this J.
#
# Run `python tutorials/sgp_synthetic.py` (writes `sgp-synthetic.png`); set
# `FEDPPL_TUTORIAL_FULL=1` for the paper's longer inner loop.

# %%
from __future__ import annotations

import os

import jax
import matplotlib.pyplot as plt
import numpy as np

from fedppl.infer.sparse_gps import FederatedSGP, SGPConfig
from fedppl_experiments.sgp_synthetic import TRUE_HYPER, five_partitions, inducing_drift

jax.config.update("jax_enable_x64", True)

FULL = os.environ.get("FEDPPL_TUTORIAL_FULL") == "1"
data = five_partitions(seed=0)
config = SGPConfig(num_inducing=15, local_steps=300 if FULL else 100,
                   inner_steps=1000 if FULL else 200, fixed_hyper=TRUE_HYPER)

# %% [markdown]
# ## Ten and twenty communications of each method

# %%
fits, drift = {}, {}
for method in ("dpo", "fedavg-z"):
    sgp = FederatedSGP(method, config)  # one compiled round per method
    for rounds in (10, 20):
        res = sgp.run(jax.random.key(0), data.clients, rounds, progress_bar=False)
        fits[method, rounds] = res
        drift[method, rounds] = inducing_drift(np.asarray(res.inducing()[0]), data.X)

print("| method | communications | mean distance of Z to data | share of Z > 1 lengthscale away |"
      " test log-lik (f) |")
print("|---|---:|---:|---:|---:|")
for (method, rounds), res in fits.items():
    mean, var = res.predict(data.X_test, rng_key=jax.random.key(1))
    mean, var = np.asarray(mean), np.asarray(var)
    ll = np.mean(-0.5 * np.log(2 * np.pi * var) - 0.5 * (data.f_test - mean) ** 2 / var)
    d = drift[method, rounds]
    print(f"| {method} | {rounds} | {d['mean']:.3f} | {d['far']:.2f} | {ll:.3f} |")

# %% [markdown]
# ## The posteriors and where the inducing locations went

# %%
fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True, sharey=True)
for ax, ((method, rounds), res) in zip(axes.T.ravel(), fits.items(), strict=True):
    mean, var = (np.asarray(a) for a in res.predict(data.X_test, rng_key=jax.random.key(1)))
    sd = np.sqrt(var)
    for k, (Xk, yk) in enumerate(data.clients.data):
        ax.plot(Xk[:, 0], yk, ".", ms=3, color=f"C{k}")
    ax.plot(data.X_test[:, 0], data.f_test, "k:", lw=1, label="truth")
    ax.plot(data.X_test[:, 0], mean, "k", lw=1.5, label="posterior mean")
    ax.fill_between(data.X_test[:, 0], mean - 2 * sd, mean + 2 * sd, color="k", alpha=0.15)
    z = np.asarray(res.inducing()[0])[:, 0]
    lo, hi = data.X_test[0, 0] - 0.3, data.X_test[-1, 0] + 0.3
    inside = (z > lo) & (z < hi)
    ax.plot(z[inside], np.full(inside.sum(), -3.6), "k^", ms=6)
    ax.plot(np.full((z < lo).sum(), lo + 0.05), np.full((z < lo).sum(), -3.6), "k<", ms=7)
    ax.plot(np.full((z > hi).sum(), hi - 0.05), np.full((z > hi).sum(), -3.6), "k>", ms=7)
    ax.set_xlim(lo, hi)
    name = "PVI + HVM (DPO)" if method == "dpo" else "FedAvg-Z (DPO)"
    ax.set_title(f"{name}, {rounds} communications")
axes[0, 0].legend(loc="upper left", fontsize=8)
fig.tight_layout()
fig.savefig("sgp-synthetic.png", dpi=120)
print("wrote sgp-synthetic.png")
