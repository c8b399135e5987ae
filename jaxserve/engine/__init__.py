"""The engine: requests in, scheduled and jitted steps, text out (`LLMEngine`), and the
library's front door on top of it (`LLM`)."""

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.llm import LLM
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput"]
