"""The PVI trio and its local solvers, in torch (the NumPyro core's ``fedppl.algorithms``)."""
