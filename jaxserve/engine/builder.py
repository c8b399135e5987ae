"""Building an engine: config, sizing, kernels, mesh, runner, proposer and grammar compiler wired.

`build_parts(loaded, config)` does the wiring once, in this order (each needs the ones
before it):

    generation config, eos ids  ->  KV dtype  ->  mesh  ->  attention and matmul kernels
      ->  KV-cache size (a probe runner first under gpu_memory_utilization, the default on
          a device that reports its memory; see kv_memory_bytes)
      ->  scheduler  ->  runner (warm-up compiles every program)  ->  proposer  ->  grammars

`LLMEngine` keeps the parts and runs them; `load(...)` reads the weights for
`LLMEngine.from_model`, placed straight into their shards on the engine's mesh (a
tensor-parallel size that does not fit the model's heads is refused before that).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.generation_config import GenerationDefaults, read_generation_config
from jaxserve.engine.kv_memory import kv_memory_bytes, require_memory_stats
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import kv_dtype_label, resolve_kv_cache_dtype
from jaxserve.model.sizing import both_units, plan_kv
from jaxserve.parallel.devices import ensure_host_devices, pin_cpu_compute
from jaxserve.parallel.experts import check_expert_parallel
from jaxserve.parallel.sharding import check_tensor_parallel, make_mesh, resident_bytes
from jaxserve.runner.kernels import select_attention, select_matmul
from jaxserve.runner.model_runner import ModelRunner, token_buckets
from jaxserve.spec_decode.build import make_proposer
from jaxserve.spec_decode.context import ProposerContext
from jaxserve.spec_decode.proposers import Proposer
from jaxserve.spec_decode.published_heads import eagle3_feature_layers
from jaxserve.structured import GrammarCompiler
from jaxserve.structured.llguidance import LLGuidanceBackend
from jaxserve.weights.dtype import resolve_dtype
from jaxserve.weights.load import (
    LoadedModel,
    default_cache_dir,
    load_model,
    read_hf_config,
    resolve_source,
    weights_digest,
)
from scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineParts:
    """What an engine runs, wired for one loaded model and one EngineConfig."""

    generation: GenerationDefaults
    eos_token_ids: tuple[int, ...]
    kv_dtype: jnp.dtype
    mesh: jax.sharding.Mesh
    attention_backend: str
    matmul_backend: str
    max_model_len: int  # the config's, or less when the KV cache cannot hold one such sequence
    scheduler: Scheduler
    runner: ModelRunner
    proposer: Proposer | None
    grammars: GrammarCompiler


def _log_calibrated_kv_scales(mcfg: ModelConfig, kv_cache_dtype: str) -> None:
    if mcfg.kv_scales is not None and kv_cache_dtype in (None, "auto"):
        logger.info(
            "the checkpoint ships calibrated %s KV-cache scales: --kv-cache-dtype %s stores K and V with them",
            mcfg.kv_scales,
            mcfg.kv_scales,
        )


def build_parts(loaded: LoadedModel, config: EngineConfig, progress: bool = False) -> EngineParts:
    """Wire an engine's parts (see the module docstring for the order); `progress`: a bar while it compiles."""
    pin_cpu_compute(config.cpu_compute_cores)  # a no-op after load(); else it says that jax started too soon
    mcfg = loaded.config
    generation = read_generation_config(loaded.source, config.generation_config)
    eos_token_ids = tuple(dict.fromkeys(mcfg.eos_token_ids + generation.eos_token_ids))
    dtype = loaded.model.dtype
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    _log_calibrated_kv_scales(mcfg, config.kv_cache_dtype)
    spec = config.speculative_config
    num_spec = spec.num_draft_tokens if spec else 0
    max_model_len = config.resolve_max_model_len(mcfg.max_position_embeddings)
    if max_model_len > mcfg.max_position_embeddings:
        logger.warning(
            "max_model_len %d is longer than the model's %d (allowed): output past %d tokens is unreliable",
            max_model_len,
            mcfg.max_position_embeddings,
            mcfg.max_position_embeddings,
        )
    tp = config.tensor_parallel_size
    check_tensor_parallel(mcfg, tp)
    if config.enable_expert_parallel:
        check_expert_parallel(mcfg, tp)
    mesh = make_mesh(tp, config.device_ids)
    invariant = config.batch_invariant
    attention_backend, attention = select_attention(
        config.attention_backend, mcfg, dtype, config.block_size, kv_dtype, mesh=mesh, batch_invariant=invariant
    )
    # before the runner takes the model
    matmul_backend = select_matmul(config.matmul_backend, loaded.model, mesh=mesh, batch_invariant=invariant)
    make_runner = functools.partial(
        ModelRunner,
        loaded.model,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        attention=attention,
        kv_dtype=kv_dtype,
        buckets=step_token_buckets(config, num_spec),
        num_speculative_tokens=num_spec,
        draft_distributions=spec is not None and spec.method == "draft_model",
        draft_tree=spec and spec.tree,
        keep_step_hidden=spec is not None and spec.method == "eagle",
        feature_layers=eagle3_feature_layers(spec.model, mcfg) if spec is not None and spec.method == "eagle3" else (),
        mesh=mesh,
        expert_parallel=config.enable_expert_parallel,
        expert_dispatch=config.expert_dispatch,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
    )
    memory_bytes = kv_memory_bytes(config, make_runner, max_model_len, mesh, progress)
    kv_plan = plan_kv(
        mcfg,
        kv_dtype,
        context=max_model_len,
        block_size=config.block_size,
        memory_bytes=memory_bytes,
        num_blocks=config.num_blocks,
        tp=tp,
    )
    num_blocks, capacity = kv_plan.num_blocks, kv_plan.usable_tokens
    if kv_plan.max_sequences == 0:
        logger.warning(
            "the KV cache (%d tokens) cannot hold one sequence of max_model_len %d tokens (%s); "
            "using max_model_len %d: for the full length give the cache more memory (--kv-cache-memory, "
            "--gpu-memory-utilization; python -m jaxserve.plan sizes it) or a smaller --max-model-len",
            capacity,
            max_model_len,
            both_units(kv_plan.bytes_per_sequence),
            capacity,
        )
        max_model_len = capacity
    else:
        logger.info(
            "plan: %d sequences of max_model_len %d fit in the KV cache at once (%s each)",
            kv_plan.max_sequences,
            max_model_len,
            both_units(kv_plan.bytes_per_sequence),
        )
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_prefix_caching=config.enable_prefix_caching,
            num_speculative_tokens=num_spec,
            draft_tree=spec and spec.tree,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
    )
    runner = make_runner(num_blocks=num_blocks, max_model_len=max_model_len)
    logger.info(
        "KV cache: %d blocks of %d tokens, %d tokens in all, %s (%.1f MiB)",
        num_blocks,
        config.block_size,
        capacity,
        kv_dtype_label(kv_dtype, mcfg.kv_scales),
        runner.kv.nbytes / 2**20,
    )
    log_resident_bytes(runner)
    if runner.compiler_options:
        logger.info(
            "XLA options of the engine's programs: %s", " ".join(f"{k}={v}" for k, v in runner.compiler_options.items())
        )
    proposer = None
    if spec:
        context = ProposerContext(
            model=loaded.model,
            model_config=mcfg,
            runner=runner,
            scheduler=scheduler,
            kv_dtype=kv_dtype,
            attention_backend=config.attention_backend,
            warm_up=config.warm_up,
        )
        proposer = make_proposer(spec, context)
        logger.info("speculative decoding: %s, %d tokens per step", spec.method, num_spec)
    # NOTE: a factory that does not hold the engine: a reference cycle would keep every
    # dropped engine (and its compiled programs' memory maps) alive until a full GC.
    grammars = GrammarCompiler(functools.partial(grammar_backend, loaded.tokenizer, eos_token_ids, mcfg.vocab_size))
    if config.warm_up:
        runner.warm_up(progress=progress)
    return EngineParts(
        generation=generation,
        eos_token_ids=eos_token_ids,
        kv_dtype=kv_dtype,
        mesh=mesh,
        attention_backend=attention_backend,
        matmul_backend=matmul_backend,
        max_model_len=max_model_len,
        scheduler=scheduler,
        runner=runner,
        proposer=proposer,
        grammars=grammars,
    )


def load(
    model: str | None,
    *,
    dtype="auto",
    cache_dir=None,
    progress: bool = True,
    quantization: str | None = None,
    tokenizer: str | None = None,
    **engine_kwargs,
) -> tuple[LoadedModel, EngineConfig]:
    """Read `model`'s weights (None: the embedded default) and check `engine_kwargs` (EngineConfig
    fields) before that: ask jax for the CPU devices they need, refuse what cannot work here."""
    config = EngineConfig(**engine_kwargs)
    ensure_host_devices(config.tensor_parallel_size if config.device_ids is None else max(config.device_ids) + 1)
    pin_cpu_compute(config.cpu_compute_cores)  # starts jax's backends
    if config.gpu_memory_utilization is not None and config.kv_cache_memory is None and config.num_blocks is None:
        require_memory_stats(jax.devices()[0])  # before the weights load: fail fast on the CPU
    mesh = load_mesh(model, config.tensor_parallel_size, config.device_ids, config)
    enable_compilation_cache(cache_dir)
    dtype = resolve_dtype(dtype, model)
    loaded = load_model(
        model,
        dtype=jnp.dtype(dtype),
        cache_dir=cache_dir,
        progress=progress,
        quantization=quantization,
        tokenizer=tokenizer,
        mesh=mesh,
        expert_parallel=config.enable_expert_parallel,
    )
    return loaded, config


# EngineConfig fields nodes of several may differ in: what only node 0's scheduler reads, and the machine's own.
_LEADER_ONLY = {
    "enable_prefix_caching",
    "long_prefill_token_threshold",
    "generation_config",
    "async_scheduling",
    "seed",
    "cpu_compute_cores",  # which cores of its own machine a node computes on
}


def node_fingerprint(model: str | None, *, dtype="auto", quantization: str | None = None, **engine_kwargs) -> dict:
    """What must be the same on every node of several (jaxserve.parallel.multihost) for their
    programs to match: the weights, dtype, quantization, every engine setting that shapes a
    program, and the versions that compile them. JSON values, compared by name."""
    from importlib.metadata import version

    import jaxlib

    config = EngineConfig(**engine_kwargs)
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _LEADER_ONLY}
    fingerprint = {
        "weights": weights_digest(resolve_source(model)),
        "dtype": str(resolve_dtype(dtype, model)),
        "quantization": quantization,
        **settings,
        "JAXSERVE_ATTENTION_BACKEND": os.environ.get("JAXSERVE_ATTENTION_BACKEND"),
        "JAXSERVE_MATMUL_BACKEND": os.environ.get("JAXSERVE_MATMUL_BACKEND"),
        # With these the engine's XLA options (jaxserve.runner.compile_options) are the same too.
        "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
        "JAXSERVE_NO_XLA_FLAGS": os.environ.get("JAXSERVE_NO_XLA_FLAGS"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jaxserve": version("jaxserve"),
    }
    return json.loads(json.dumps(fingerprint, default=str))  # as the other node reads it


def load_mesh(
    model: str | None,
    tensor_parallel_size: int = 1,
    device_ids=None,
    config: EngineConfig | None = None,
    expert_parallel: bool = False,
) -> jax.sharding.Mesh:
    """The mesh `load_model` places `model`'s weights on, once its config (read without the
    weights) shows that its heads (with `expert_parallel` or config's enable_expert_parallel,
    its experts) split over `tensor_parallel_size` devices (and that `config`'s max_model_len
    is not past the model's): what does not fit is refused before anything heavy is read."""
    hf_config, _ = read_hf_config(model)
    model_config = ModelConfig.from_hf_dict(hf_config)
    check_tensor_parallel(model_config, tensor_parallel_size)
    if expert_parallel or (config is not None and config.enable_expert_parallel):
        check_expert_parallel(model_config, tensor_parallel_size)
    if config is not None:
        config.resolve_max_model_len(model_config.max_position_embeddings)
    return make_mesh(tensor_parallel_size, device_ids)


def log_resident_bytes(runner: ModelRunner) -> None:
    """One line: what each device holds of the weights and of the KV cache."""
    weights, kv = resident_bytes(runner.params), resident_bytes(runner.kv)
    logger.info(
        "resident per device: weights %s; KV cache %s",
        ", ".join(f"{d}: {b / 2**20:.1f} MiB" for d, b in weights.items()),
        ", ".join(f"{d}: {b / 2**20:.1f} MiB" for d, b in kv.items()),
    )


def step_token_buckets(config: EngineConfig, num_spec: int) -> list[int] | None:
    """The configured buckets; by default the runner's (`token_buckets`), plus one for a
    single sequence verifying its drafts (1 + k tokens: no padding at batch 1)."""
    if config.token_buckets:
        return list(config.token_buckets)
    if not num_spec:
        return None
    return sorted(set(token_buckets(config.max_num_batched_tokens, config.max_num_seqs)) | {num_spec + 1})


def grammar_backend(tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int) -> LLGuidanceBackend:
    """The grammar engine over a model's tokenizer (made on the first compile); a
    ValueError saying why when there is none it can read."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer, and this model has none")
    try:
        return LLGuidanceBackend(tokenizer, eos_token_ids, vocab_size)
    except ValueError as e:
        raise ValueError(f"structured output needs a tokenizer the grammar engine can read: {e}") from None


def enable_compilation_cache(cache_dir=None) -> None:
    """Keep compiled XLA programs on disk next to the converted weights, so a second start
    skips most of the warm-up compile."""
    path = Path(cache_dir or default_cache_dir()) / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
