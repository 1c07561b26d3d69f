# %% [markdown]
# # Private GP co-training: who asks what
#
# Two statisticians predict the same response from different covariates (views). Each holds
# private labelled data, masked to one half of its covariate space, and both can index a
# shared pool of unlabelled points. In turn, each asks the other for its prediction at the pool
# point where it is least certain, and folds the answer in (the "Noisy" combination: answers
# become heteroscedastic pseudo-observations). The figure shows each party's model before
# and after, with its labelled data (crosses) and the queried points (pluses), as in
# Figs. 4.4-4.5 of the thesis.

# %%
import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedppl.algorithms import cotraining as ct
from fedppl.infer.co_training import run
from fedppl_experiments import cotraining_data as data
from fedppl_experiments.cotraining_study import parties_of

jax.config.update("jax_enable_x64", True)

# %%
problem = data.simulate_two_views(r=0.9, cond_indep=True, masked=True, n_obs=25, seed=0)
parties, y_test = parties_of(problem)
settings = ct.Settings("noisy", "full")
out = run(parties, y_test, settings, rounds=8, seed=0, fit_steps=150)
print("test RMSE before:", np.round(out.rmse_before, 3), "after:", np.round(out.rmse_after, 3))
print("oracle (masked, individual):", round(data.oracle_unexplained_sd(0.9, True, True, False), 3))

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
grid = np.linspace(-3, 3, 200)[:, None]
for v, ax in enumerate(axes):
    state = out.states[v]
    before = ct.init_party(v, parties[v].X, parties[v].y, parties[v].pool, 150)
    for s, label, style in [(before, "before", "--"), (state, "after 8 rounds", "-")]:
        mean, var = ct.predict(s, grid, settings)
        mean, sd = np.asarray(mean), np.sqrt(np.asarray(var))
        ax.plot(grid[:, 0], mean, style, label=f"mean {label}")
        if s is state:
            ax.fill_between(grid[:, 0], mean - 2 * sd, mean + 2 * sd, alpha=0.2)
    ax.plot(parties[v].X[:, 0], parties[v].y, "kx", label="private labelled")
    got = state.received[1 - v]
    ax.plot(parties[v].pool[got.pool_index, 0], got.mean, "r+", ms=10, mew=2,
            label="queried (other party's answer)")
    ax.set(title=f"party {v + 1} (view {v + 1})", xlabel=f"x{v + 1}")
axes[0].set_ylabel("y")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig("cotraining-queries.png", dpi=110)
print("wrote cotraining-queries.png")
