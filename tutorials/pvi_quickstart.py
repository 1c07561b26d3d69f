# %% [markdown]
# # PVI quickstart: federated Bayesian logistic regression
#
# A NumPyro model, data split across clients with skew, partitioned variational inference
# (PVI), and a check against global VI on the pooled data. Run it as a script
# (`python tutorials/pvi_quickstart.py`) or open it as a notebook with jupytext.

# %%
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist

import fedppl
from fedppl.guides import PVIGuide

jax.config.update("jax_enable_x64", True)


# %% [markdown]
# ## 1. An ordinary NumPyro model
# Per-datum observations sit in a plate over the data: that is how fedppl masks each client's
# padded rows.

# %%
def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


# %% [markdown]
# ## 2. Clients with skewed data
# Sorting by the first feature and cutting into chunks gives each client a different slice
# of input space: no client alone sees the whole picture.

# %%
rng = np.random.default_rng(0)
X = rng.normal(size=(600, 3))
y = (rng.uniform(size=600) < 1 / (1 + np.exp(-(X @ np.array([2.0, -1.0, 0.5]) - 0.5)))) * 1.0
clients = fedppl.partition.by_feature(X, y, num_clients=6, feature=0)
print("client sizes:", clients.sizes)

# %% [markdown]
# ## 3. PVI: each client refines its own factor of q = p * prod_k t_k

# %%
# The default local step solves each client's problem to a tolerance (natural-gradient
# iterations on fixed Monte Carlo draws), so q stops moving once PVI has converged: `tol` ends
# the run there, and the history says how far q moved and whether every local step converged.
pvi = fedppl.PVI(model, PVIGuide(model, family="fullrank"), schedule="sequential")
result = pvi.run(jax.random.key(0), clients, num_rounds=20, tol=1e-8, progress_bar=False)
print("rounds run:", len(result.history["kl_change"]))
print("KL(q_new || q_old) by round:", result.history["kl_change"])
print("every local step converged:", bool(np.all(result.history["converged"] == 1)))
print("global ELBO by round:", np.round(result.history["elbo"], 2))
print("bytes sent up per round:", result.history["bytes_up"][0])

# %% [markdown]
# ## 4. The answer PVI converges to: global VI on the pooled data

# %%
ref = fedppl.GlobalVI(model, PVIGuide(model, family="fullrank")).run(jax.random.key(1), clients,
                                                                     progress_bar=False)
(m_pvi, c_pvi), (m_ref, c_ref) = result.mean_and_cov(), ref.mean_and_cov()
print("posterior mean  PVI:", np.round(m_pvi, 3))
print("posterior mean  VI :", np.round(m_ref, 3))
print("largest gap in posterior sds:", np.max(np.abs(m_pvi - m_ref) / np.sqrt(np.diag(c_ref))))

# %% [markdown]
# ## 5. Inspect: samples, marginals, ArviZ

# %%
samples = result.sample(jax.random.key(2), 1000)
print({k: v.shape for k, v in samples.items()})
try:  # ArviZ 1.x: to_arviz() is an xarray.DataTree (draws of q as 4 chains)
    import arviz_stats

    print(arviz_stats.summary(result.to_arviz(jax.random.key(3)), var_names=["w", "b"]))
except ImportError:
    print("pip install 'fedppl[arviz]' for the ArviZ summary")
