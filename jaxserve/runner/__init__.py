"""Running a scheduler `StepBatch` on the device: `ModelRunner` (pad to buckets, dispatch,
fetch) and `kernels` (which attention and matmul kernels run, decided once at start-up)."""

from jaxserve.runner.kernels import select_attention, select_matmul
from jaxserve.runner.model_runner import ModelRunner, RunnerOutput, StepHandle

__all__ = ["ModelRunner", "RunnerOutput", "StepHandle", "select_attention", "select_matmul"]
