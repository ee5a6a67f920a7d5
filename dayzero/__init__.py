"""dayzero: day-0 inference and serving for sparse frontier Mixture-of-Experts models."""

__version__ = "0.1.0"


def __getattr__(name):  # `from dayzero import LLM, SamplingParams` without importing torch at package import
    if name == "LLM":
        from dayzero.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dayzero.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dayzero' has no attribute {name!r}")
