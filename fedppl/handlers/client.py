"""``client``: scope a model to one client's padded, masked data.

Clients hold different numbers of points; fedppl pads them to a common length so that all clients
run through one compiled function. This handler masks the padded rows out of every observed site
inside the data plate, and optionally rescales the likelihood when the call sees a minibatch of
the client's ``num_data`` points (scale ``num_data / batch``). A data plate that subsamples
(``numpyro.plate("data", N, subsample_size=b)``) gets the mask rows of its subsample; numpyro
scales the batch by ``N / b``. Given ``draw`` (the index of one of a local step's Monte Carlo
draws), the handler picks that minibatch itself: consecutive slices of one fixed permutation, so
that the step's draws together see every row about equally often. A ``numpyro.factor`` in no
plate is a term of the prior, which the server counts once
(:func:`fedppl.sites.prior_correction`), so clients drop it. A site observed through
``numpyro.handlers.condition`` is masked like one with ``obs=``, in either nesting.

Example::

    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer.util import log_density
    >>> def model(X, y=None):
    ...     w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with numpyro.plate("data", X.shape[0]):
    ...         numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> # X_k, y_k padded to N_max rows; mask_k marks the real ones
    >>> X_k = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    >>> y_k = jnp.array([0.5, -0.5, 0.0, 0.0, 0.0])
    >>> mask_k = jnp.array([True, True, True, False, False])
    >>> with client(mask=mask_k):
    ...     tr = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(X_k, y_k)
    >>> (tr["y"]["fn"].log_prob(y_k) != 0).tolist()       # padded rows contribute nothing
    [True, True, True, False, False]

    The padded client's log density is that of its three real rows alone:

    >>> params = {"w": jnp.array([0.5, 0.5])}
    >>> padded, _ = log_density(client(model, mask=mask_k), (X_k, y_k), {}, params)
    >>> real, _ = log_density(model, (X_k[:3], y_k[:3]), {}, params)
    >>> round(float(padded), 3) == round(float(real), 3)
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from numpyro.primitives import Messenger

from fedppl.handlers._observed import observation
from fedppl.sites import innermost, is_prior_factor

__all__ = ["client"]


class client(Messenger):
    """Mask padded rows (and optionally rescale) at the observed sites of the data plate.

    :param fn: a NumPyro model.
    :param mask: boolean array ``(N_max,)``, True for the client's real data points.
    :param plate: name of the plate over data points; by default the plate whose size is
        ``N_max``. Every observed site must sit inside it.
    :param num_data: if given, the client's total number of points; the likelihood is scaled by
        ``num_data / mask.sum()`` (for minibatches).
    :param draw: the Monte Carlo draw this call belongs to; a subsampling data plate then takes
        the draw's slice of a fixed permutation instead of a random minibatch.
    """

    def __init__(self, fn=None, mask: Array | np.ndarray | None = None, plate: str | None = None,
                 num_data: int | Array | None = None, draw: int | Array | None = None):
        if mask is None:
            raise ValueError("client needs a mask over the padded data points")
        if jnp.ndim(mask) != 1:
            raise ValueError(f"mask must be one-dimensional, got shape {jnp.shape(mask)}")
        self.mask = mask
        self.plate = plate
        self.num_data = num_data
        self.draw = draw
        self._subsamples: dict = {}
        super().__init__(fn)

    # The data plate's subsample indices (numpyro.plate(..., subsample_size=b)) are seen in its
    # "plate" message; they index the mask. Per-call state lives between __enter__ and __exit__.
    def __enter__(self):
        self._subsamples = {}
        return super().__enter__()

    def __exit__(self, *args, **kwargs):
        self._subsamples = {}
        return super().__exit__(*args, **kwargs)

    def postprocess_message(self, msg):
        if msg["type"] == "plate" and self._is_data_plate(msg["name"], msg["args"][0]):
            self._subsamples[msg["name"]] = msg["value"]

    def _balanced(self, msg):
        """Draw ``s``'s minibatch: rows ``s b, ..., s b + b - 1`` (mod N) of one fixed
        permutation, so that the draws of a local step cover the client's rows evenly."""
        size, batch = msg["args"][0], msg["args"][1]
        perm = jax.random.permutation(jax.random.key(0), size)
        start = (jnp.asarray(self.draw) * batch) % size
        msg["value"] = perm[(start + jnp.arange(batch)) % size]

    def _is_data_plate(self, name: str, size: int) -> bool:
        return name == self.plate if self.plate is not None else size == jnp.shape(self.mask)[0]

    def process_message(self, msg):
        if (msg["type"] == "plate" and self.draw is not None and msg["value"] is None
                and msg["args"][1] is not None and msg["args"][1] < msg["args"][0]
                and self._is_data_plate(msg["name"], msg["args"][0])):
            self._balanced(msg)
            return
        if msg["type"] != "sample" or not observation(self, msg)[0]:  # obs= or `condition`
            return
        if is_prior_factor(msg):  # a factor in no plate is the prior's, counted by the server
            msg["fn"] = msg["fn"].mask(False)
            return
        n = jnp.shape(self.mask)[0]
        subsamples = self._subsamples
        frame = next((f for f in msg["cond_indep_stack"]
                      if f.name in subsamples or (f.name == self.plate if self.plate is not None
                                                  else f.size == n)), None)
        if frame is None:
            which = f"named '{self.plate}'" if self.plate else f"of size {n}"
            if n in innermost(msg["fn"]).event_shape:  # one likelihood over all the points
                raise ValueError(
                    f"observed site '{msg['name']}' is one distribution over all {n} data points "
                    f"(event shape {tuple(msg['fn'].event_shape)}): it couples every data point, "
                    "so it does not split over clients, and inside a data plate it would be "
                    f"{n} copies of itself, another model. For a federated GP use the sparse "
                    "GPs: fedppl.FederatedSGP or fedppl.FSGP"
                )
            raise ValueError(
                f"observed site '{msg['name']}' is not inside a plate {which}; put per-datum "
                "observations inside `with numpyro.plate('data', X.shape[0]):` (or name the "
                "data plate with plate=...)"
            )
        mask = self.mask
        if frame.name in subsamples:
            mask = mask[subsamples[frame.name]]
        elif frame.size != n:
            raise ValueError(
                f"the data plate '{frame.name}' has size {frame.size} but the mask has {n} rows"
            )
        m = jnp.reshape(mask, (jnp.shape(mask)[0],) + (1,) * (-frame.dim - 1))
        msg["fn"] = msg["fn"].mask(m)
        if self.num_data is not None:
            factor = self.num_data / jnp.maximum(jnp.sum(self.mask), 1)
            # in the precision of the site's parameters (no float64 scale on float32 densities)
            floats = [jnp.result_type(leaf) for leaf in jax.tree.leaves(msg["fn"])
                      if jnp.issubdtype(jnp.result_type(leaf), jnp.floating)]
            if floats:
                factor = factor.astype(jnp.result_type(*floats))
            msg["scale"] = factor if msg["scale"] is None else msg["scale"] * factor
