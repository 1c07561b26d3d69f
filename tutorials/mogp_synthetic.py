# %% [markdown]
# # Mixed regression and classification across clients with pFed-Mul
#
# Fig. 2 of the pFed-Mul paper. Five clients each observe noisy values of a regression function
# and 0/1 labels of a classification function; both functions come from one two-kernel LMC
# prior (the paper's hyperparameters). pFed-Mul models the two tasks jointly on each client
# (Pólya-Gamma CAVI) and learns the shared prior on the server; pFed-St fits each task on its
# own. The plot shows, on client 0, the posterior mean ± 2 sd of both latent functions against
# the truth: the labels alone say little about the classification function, and the correlated
# regression data pins it down.
#
# Run `python tutorials/mogp_synthetic.py` (quick settings; `--full` for 20 rounds and 40 points
# per task): it writes `mogp-synthetic.png`.

# %%
from __future__ import annotations

import sys

import jax

jax.config.update("jax_enable_x64", True)

import matplotlib.pyplot as plt  # noqa: E402

from fedppl_experiments import mogp_synthetic as ms  # noqa: E402

FULL = "--full" in sys.argv
settings = dict(seed=0, rounds=20 if FULL else 3, n_per_task=40 if FULL else 30,
                num_inducing=30 if FULL else 20)

# %%
if __name__ == "__main__":
    results = {m: ms.run(m, **settings) for m in ("pfed-mul", "pfed-st")}
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    for row, (method, res) in enumerate(results.items()):
        for col, (t, name) in enumerate([(0, "regression"), (1, "classification")]):
            ax, (m, v) = axes[row, col], res["post"][t][0]
            ax.plot(res["grid"], res["f_true"][t], "k--", label="truth")
            ax.plot(res["grid"], m, "C0", label="posterior mean")
            ax.fill_between(res["grid"], m - 2 * v**0.5, m + 2 * v**0.5, color="C1", alpha=0.3,
                            label="+- 2 sd")
            ax.set_title(f"{method}: {name} (RMSE {res[['reg', 'cls'][t] + '_rmse']:.2f})")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig("mogp-synthetic.png", dpi=100)
    print("wrote mogp-synthetic.png")
    for method, res in results.items():
        print(f"{method:9s} classification RMSE {res['cls_rmse']:.3f}, mean var "
              f"{res['cls_var']:.3f}; regression RMSE {res['reg_rmse']:.3f}")
