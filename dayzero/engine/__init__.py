"""The engine: per-request sampling and stop conditions (planned: scheduler, runner, the step loop)."""

from dayzero.engine.sampling import (
    GREEDY_TEMPERATURE,
    MAX_LOGPROBS,
    Sampler,
    SamplerOutput,
    SamplingParams,
    SamplingState,
    StopChecker,
    StopDecision,
    TokenLogprobs,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_LOGPROBS",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingState",
    "StopChecker",
    "StopDecision",
    "TokenLogprobs",
]
