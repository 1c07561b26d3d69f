"""Ready models written as ordinary NumPyro code."""

from fedppl.models.glm import linear_regression, logistic_regression
from fedppl.models.random_features import feature_regression, urk_regression

__all__ = ["linear_regression", "logistic_regression", "feature_regression", "urk_regression"]
