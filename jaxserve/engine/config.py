"""The engine's settings: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses

from jaxserve.spec_decode.config import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for K and V of all layers
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8" or "int8" (see jaxserve.model.kv_cache)
    num_blocks: int | None = None  # overrides kv_cache_memory
    # vLLM's: the fraction of the device's memory the engine may use; the KV cache gets what
    # the weights and the largest step leave (measured, see builder.kv_memory_for_utilization).
    # Overrides kv_cache_memory; num_blocks overrides it. Needs a device that reports its memory.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    attention_backend: str | None = None  # None: $JAXSERVE_ATTENTION_BACKEND or auto
    matmul_backend: str | None = None  # quantized matmuls; None: $JAXSERVE_MATMUL_BACKEND or auto
    token_buckets: tuple[int, ...] | None = None  # None: powers of two up to max_num_batched_tokens
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

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        u = self.gpu_memory_utilization
        if u is not None and not (isinstance(u, (int, float)) and 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        if self.device_ids is not None:
            object.__setattr__(self, "device_ids", tuple(self.device_ids))
        if self.tensor_parallel_size > 1:
            spec = self.speculative_config
            if spec is not None and spec.method != "ngram":
                raise ValueError(
                    f"speculative decoding with {spec.method!r} does not run with tensor parallelism yet; ngram does"
                )
            if u is not None:
                raise ValueError(
                    "gpu_memory_utilization does not work with tensor parallelism yet; "
                    "give kv_cache_memory (per device)"
                )
