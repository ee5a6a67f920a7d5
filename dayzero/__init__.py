"""dayzero: day-0 inference and serving for sparse frontier Mixture-of-Experts models."""

__version__ = "0.1.0"
