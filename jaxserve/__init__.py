"""jaxserve: an LLM inference and serving engine in JAX.

from jaxserve import LLM, SamplingParams
LLM().generate("The capital of France is", SamplingParams(temperature=0))
"""

# NOTE: importing jaxserve changes no process-wide setting (no XLA_FLAGS, no jax config, no
# environment variable): the engine passes its XLA options to its own programs
# (jaxserve/runner/compile_options.py), and the commands set up logging (jaxserve/logs.py).

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
]


def __getattr__(name):
    # Imported on first use, so `python -m jaxserve.generate --help` stays quick.
    if name in ("LLM", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput"):
        from jaxserve import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "StructuredOutputsParams"):
        import scheduler

        return getattr(scheduler, name)
    if name == "LoRARequest":
        from jaxserve.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
