"""What a proposer may see of the target: the narrow view the engine hands it.

A proposer never holds the engine. It gets the target's model (a self-draft shares its
layers; heads read its config and dtype), the runner (its KV-cache geometry, buckets and
devices; Medusa and EAGLE read the hidden states it keeps), and the scheduler (the block
tables a draft model or an EAGLE head writes its own cache through).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.decoder import DecoderLM
    from jaxserve.runner.model_runner import ModelRunner
    from scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class ProposerContext:
    model: DecoderLM  # the target, as loaded
    model_config: ModelConfig
    runner: ModelRunner  # the target's runner
    scheduler: Scheduler
    kv_dtype: Any  # the target's KV-cache dtype; a proposer's own cache uses the same
    attention_backend: str | None  # as EngineConfig.attention_backend: a draft model selects its kernel alike
    warm_up: bool  # compile every program at start-up, as the target does
