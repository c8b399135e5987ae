"""Host-side scheduling: requests, the KV block manager and continuous batching.

Pure Python and NumPy: nothing here imports jax (a test checks).
"""

from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats, StepResult
from scheduler.spec_stats import SpecDecodingStats
from scheduler.step_batch import SamplingBatch, StepBatch

__all__ = [
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "SamplingBatch",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SpecDecodingStats",
    "StepBatch",
    "StepResult",
    "StructuredOutputsParams",
]
