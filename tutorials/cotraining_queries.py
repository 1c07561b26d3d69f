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
import matplotlib.pyplot as plt
import numpy as np

import fedppl
from fedppl_experiments import cotraining_data as data
from fedppl_experiments.cotraining_study import parties_of

jax.config.update("jax_enable_x64", True)

# %%
problem = data.simulate_two_views(r=0.9, cond_indep=True, masked=True, n_obs=25, seed=0)
p = parties_of(problem)
method = fedppl.CoTraining("noisy", "full", fit_steps=150)
out = method.run(jax.random.key(0), p.clients, 8, pool=p.pool, test=p.test, y_test=p.y_test,
                 progress_bar=False)
print("test RMSE before:", np.round(out.rmse_before, 3), "after:", np.round(out.rmse_after, 3))
print("oracle (masked, individual):", round(data.oracle_unexplained_sd(0.9, True, True, False), 3))

# %% [markdown]
# Every message is kept, in protocol order: each round, each party's `Query`, then the other's
# `Response` to it.

# %%
out.messages[:2]

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
grid = np.linspace(-3, 3, 200)[:, None]
for v, ax in enumerate(axes):
    for alone, label, style in [(True, "before", "--"), (False, "after 8 rounds", "-")]:
        mean, var = out.predict(v, grid, alone=alone)
        ax.plot(grid[:, 0], mean, style, label=f"mean {label}")
        if not alone:
            sd = np.sqrt(var)
            ax.fill_between(grid[:, 0], mean - 2 * sd, mean + 2 * sd, alpha=0.2)
    X, y = p.clients.client(v)
    ax.plot(X[:, 0], y, "kx", label="private labelled")
    state = out.parties[v]  # what the other party answered, in order
    ax.plot(p.pool[v][state.got_index[1 - v], 0], state.got_mean[1 - v], "r+", ms=10, mew=2,
            label="queried (other party's answer)")
    ax.set(title=f"party {v + 1} (view {v + 1})", xlabel=f"x{v + 1}")
axes[0].set_ylabel("y")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig("cotraining-queries.png", dpi=110)
print("wrote cotraining-queries.png")
