"""The engine's settings: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import os

from jaxserve.spec_decode.config import SpeculativeConfig

# The KV cache's size when none is given: vLLM's fraction of an accelerator's memory, and a
# fixed size on the CPU (which reports no memory, and is often a machine shared with others).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
ALLOW_LONG_MAX_MODEL_LEN_ENV = "JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN"
# How expert parallelism's tokens reach their experts (jaxserve.parallel.experts; the first is the default)
EXPERT_DISPATCHES = ("all-reduce", "all-to-all")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # A max_model_len past the model's own is refused unless this (or $JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN=1)
    allow_long_max_model_len: bool = False
    block_size: int = 16
    # Bytes for K and V of all layers, per device; None: gpu_memory_utilization where the
    # device reports its memory, else DEFAULT_CPU_KV_CACHE_MEMORY (see builder.kv_memory_bytes).
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8" or "int8" (see jaxserve.model.kv_cache)
    num_blocks: int | None = None  # overrides kv_cache_memory
    # vLLM's: the fraction of each device's memory the engine may use; the KV cache gets what
    # the weights and the largest step leave (measured, see builder.kv_memory_for_utilization).
    # None: DEFAULT_GPU_MEMORY_UTILIZATION on a device that reports its memory (not the CPU).
    # kv_cache_memory and num_blocks override it.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    attention_backend: str | None = None  # None: $JAXSERVE_ATTENTION_BACKEND or auto
    matmul_backend: str | None = None  # quantized matmuls; None: $JAXSERVE_MATMUL_BACKEND or auto
    # Every row's logits independent of its batch mates, chunking and prefix hits (kernels in a
    # fixed summation order, CPU or Hopper GPU; docs/batch-invariance.md); off: the faster defaults.
    batch_invariant: bool = False
    token_buckets: tuple[int, ...] | None = None  # None: model_runner.token_buckets
    warm_up: bool = True  # compile every step program at start-up; False (--enforce-eager): each on first use
    # vLLM's seed: requests without a seed draw theirs from a stream this starts (None: from the OS)
    seed: int | None = None
    generation_config: str = "auto"  # "auto", "vllm" or a folder (see jaxserve.engine.generation_config)
    async_scheduling: bool = True  # overlap the host's work for step N with the device's step N+1
    # Draft tokens verified in the step (vLLM's --speculative-config: a SpeculativeConfig, a dict or its JSON)
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Tensor parallelism (jaxserve.parallel.sharding): the model split over this many devices; the KV
    # cache memory (kv_cache_memory) is per device, as in python -m jaxserve.plan.
    tensor_parallel_size: int = 1
    device_ids: tuple[int, ...] | None = None  # which of jax.devices() (default the first tensor_parallel_size)
    # vLLM's: a mixture of experts' experts split whole over the tensor_parallel_size devices (E / tp
    # each, jaxserve.parallel.experts) instead of each expert split on its F axis; other layers as without it
    enable_expert_parallel: bool = False
    # With it, how tokens reach their experts' devices: "all-reduce" (every device runs its experts'
    # rows of the whole batch, one psum combines) or "all-to-all" (each device sends its slice of the
    # tokens to their experts' devices and back); same results, docs/benchmarks.md measures them
    expert_dispatch: str = EXPERT_DISPATCHES[0]
    # On the CPU, vLLM's split: jax's threads on this many cores, the host (scheduler, tokenizers, HTTP) on
    # the rest (jaxserve.parallel.devices.pin_cpu_compute; set before jax starts). None: all share all cores.
    cpu_compute_cores: int | None = None
    # LoRA adapters (jaxserve.lora), vLLM's names and defaults: requests may name a PEFT adapter;
    # max_loras of them sit in device slots at once, each of rank up to max_lora_rank, and
    # max_cpu_loras (None: max_loras) stay read in host memory.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        u = self.gpu_memory_utilization
        if u is not None and not (isinstance(u, (int, float)) and 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        if self.expert_dispatch not in EXPERT_DISPATCHES:
            raise ValueError(f"expert_dispatch must be one of {EXPERT_DISPATCHES}, got {self.expert_dispatch!r}")
        if self.enable_lora:
            self._check_lora()
        if self.device_ids is not None:
            object.__setattr__(self, "device_ids", tuple(self.device_ids))
        if self.tensor_parallel_size > 1:
            spec = self.speculative_config
            if spec is not None and spec.method != "ngram":
                raise ValueError(
                    f"speculative decoding with {spec.method!r} does not run with tensor parallelism yet; ngram does"
                )

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras={self.max_loras} and max_lora_rank={self.max_lora_rank} must be >= 1")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if self.speculative_config is not None:
            raise ValueError("enable_lora does not run with speculative decoding yet (speculative_config)")
        if self.batch_invariant:  # the adapters' products run through XLA, not the fixed-order kernels
            raise ValueError("enable_lora does not run with batch_invariant yet")

    def resolve_max_model_len(self, model_len: int) -> int:
        """max_model_len, or the model's own length (`model_len`: max_position_embeddings);
        one past the model's is refused (vLLM's rule) unless allowed by allow_long_max_model_len
        or $JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN=1: positions the model never saw in training
        give unreliable output."""
        if not self.max_model_len:  # None (or 0, as before): the model's
            return model_len
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_model_len > model_len:
            if not (self.allow_long_max_model_len or allow_long_from_env()):
                raise ValueError(
                    f"max_model_len {self.max_model_len} is longer than the model's {model_len} "
                    f"(max_position_embeddings in its config): positions past {model_len} were never trained, "
                    f"and the output there is unreliable. Give at most {model_len}, or allow it anyway with "
                    f"--allow-long-max-model-len (allow_long_max_model_len=True, or ${ALLOW_LONG_MAX_MODEL_LEN_ENV}=1)"
                )
        return self.max_model_len


def allow_long_from_env() -> bool:
    """$JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN set to 1 or true (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    return os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "0").strip().lower() in ("1", "true")
