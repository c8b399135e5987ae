"""jaxserve: an LLM inference and serving engine in JAX.

from jaxserve import LLM, SamplingParams
LLM().generate("The capital of France is", SamplingParams(temperature=0))
"""

import os

# XLA's CPU backend vectorizes a float reduction (every matmul row, every norm) only if it
# may reassociate the sum; without that, decode on a CPU runs about 25% slower. These flags
# allow reassociation and nothing else: NaN, Inf, division and library functions keep
# IEEE semantics (the attention masks rely on -inf). Each is appended only if XLA_FLAGS
# does not set it already (the user's value wins); JAXSERVE_NO_XLA_FLAGS=1 appends none.
# NOTE: they must be in place before jax creates its CPU client, hence here.
_CPU_REASSOCIATION_FLAGS = (
    "--xla_cpu_enable_fast_math=true",
    "--xla_cpu_fast_math_honor_infs=true",
    "--xla_cpu_fast_math_honor_nans=true",
    "--xla_cpu_fast_math_honor_division=true",
    "--xla_cpu_fast_math_honor_functions=true",
)


def _with_default_flags(user_flags: str, defaults) -> str:
    """`user_flags` plus each of `defaults` whose name (`--name=`) it does not set."""
    set_names = {f.lstrip("-").split("=", 1)[0] for f in user_flags.split()}
    missing = [f for f in defaults if f.lstrip("-").split("=", 1)[0] not in set_names]
    return " ".join([user_flags.strip(), *missing]).strip()


if os.environ.get("JAXSERVE_NO_XLA_FLAGS") != "1":
    os.environ["XLA_FLAGS"] = _with_default_flags(os.environ.get("XLA_FLAGS", ""), _CPU_REASSOCIATION_FLAGS)

# transformers is used here for tokenizers only; without torch it would advise, at every
# start, that its models are unavailable.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
]


def __getattr__(name):
    # Imported on first use, so `python -m jaxserve.generate --help` stays quick.
    if name in ("LLM", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput"):
        from jaxserve import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "StructuredOutputsParams"):
        import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
