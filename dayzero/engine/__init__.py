"""The engine: requests, the continuous-batching scheduler, the runner, sampling and stop
conditions, and the offline API (`LLM`)."""

from dayzero.engine.request import Request, RequestStatus
from dayzero.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
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
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
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
