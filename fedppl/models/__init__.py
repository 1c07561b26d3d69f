"""Ready models written as ordinary NumPyro code."""

from fedppl.models.glm import linear_regression, logistic_regression

__all__ = ["linear_regression", "logistic_regression"]
