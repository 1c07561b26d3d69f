# %% [markdown]
# # Any NumPyro model: random intercepts per hospital
#
# A hierarchical logistic model written as NumPyro users write it: a HalfCauchy group scale,
# Laplace weights, and each hospital's intercept in a plate over groups, with the number of
# groups a static keyword argument. Each hospital is a client; its intercept is a local site
# that never leaves it. Run it as a script (`python tutorials/any_model.py`) or open it as a
# notebook with jupytext.

# %%
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist

import fedppl
from fedppl.guides import PVIGuide

jax.config.update("jax_enable_x64", True)


# %% [markdown]
# ## The model
# `a` is the hospital's own intercept: a local site. `mu`, `tau` and `w` are shared.


# %%
def model(X, y=None, *, n_groups=1):
    mu = numpyro.sample("mu", dist.Normal(0, 2))
    tau = numpyro.sample("tau", dist.HalfCauchy(1))
    w = numpyro.sample("w", dist.Laplace(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", dist.Normal(mu, tau))    # the hospital's own intercept
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + a[0]), obs=y)


# %% [markdown]
# ## Five hospitals of unequal sizes, with shifted covariates

# %%
rng = np.random.default_rng(0)
hospitals = []
for k in range(5):                                      # unequal sizes, shifted covariates
    X = rng.normal(size=(60 + 30 * k, 3)) + 0.2 * k
    logits = X @ np.array([1.0, -0.5, 0.0]) + rng.normal(0.5, 0.7)
    hospitals.append((X, (rng.random(len(X)) < 1 / (1 + np.exp(-logits))).astype(float)))
clients = fedppl.Clients.from_list(hospitals, names=[f"hospital {k}" for k in range(5)])


# %% [markdown]
# ## PVI, then each hospital's view of the posterior

# %%
guide = PVIGuide(model, global_sites=["mu", "tau", "w"], family="fullrank")
result = fedppl.PVI(model, guide).run(jax.random.key(0), clients, 20, tol=1e-8,
                                      progress_bar=False, n_groups=1)
draws = result.sample(jax.random.key(1), 2000, client="hospital 3")   # mu, tau, w and its a
pred = result.predictive(jax.random.key(2), hospitals[3][0][:5], num_samples=500,
                         client="hospital 3", n_groups=1)["y"]
print("rounds:", len(result.history["seconds"]))
print("tau:", float(np.median(draws["tau"])), " hospital 3's intercept:",
      float(draws["a"].mean()), "+-", float(draws["a"].std()))
print("P(y = 1) for hospital 3's first five patients:", np.round(pred.mean(0), 2))
