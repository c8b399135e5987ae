"""The engine: requests in, one scheduled and jitted step at a time, outputs out.

    engine = LLMEngine.from_model()                # the embedded default model
    engine.add_request("r1", "The capital of France is", SamplingParams(temperature=0))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.outputs[0].new_text, end="")

Each step is the design's three lines: `scheduler.schedule()`, `runner.dispatch(batch)`,
`scheduler.update(batch, tokens)`; then the output processor turns tokens into text.

The loop is overlapped (`async_scheduling`, on by default): a step schedules and
dispatches batch N+1 first and only then waits for batch N's tokens and turns them into
text, so the device never waits for the host between steps. Batch N+1 is built before the
host knows N's tokens; the device feeds them in (see scheduler/request.py, pending
tokens). A request that ended in step N may have had one more token computed in N+1: it
is dropped, never shown. Requests with penalties need their whole history on the host,
and a request with a grammar (structured output) needs its latest token to build its
mask, so while one runs, a step first waits for the batch in flight (the serial loop).

Speculative decoding (`speculative_config`) runs the serial loop: a proposer needs each
request's latest tokens to guess the next ones, and a step that verifies k drafts
advances a request by up to k + 1 tokens, so the host's work per token shrinks anyway.

    step k:   schedule(N+1) -> dispatch(N+1) -> fetch(N) -> update(N) -> detokenize(N)
    device:   ...[ step N ][ step N+1 ]...
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import time
from concurrent.futures import Future
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.weights.dtype import resolve_dtype
from jaxserve.runner.kernels import select_attention, select_matmul
from jaxserve.parallel.devices import ensure_host_devices
from jaxserve.engine.generation_config import read_generation_config
from jaxserve.model.kv_cache import KVHandoff, kv_dtype_label, resolve_kv_cache_dtype
from jaxserve.runner.model_runner import ModelRunner, StepHandle, token_buckets
from jaxserve.parallel.multihost import Leader
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.profiling import NullProfiler, StepProfiler
from jaxserve.parallel.sharding import check_tensor_parallel, make_mesh
from jaxserve.model.sizing import both_units, kv_budget_for_utilization, plan_kv
from jaxserve.spec_decode import SpeculativeConfig
from jaxserve.spec_decode.build import make_proposer
from jaxserve.spec_decode.context import ProposerContext
from jaxserve.spec_decode.proposers import Proposer
from jaxserve.structured import GrammarCompiler
from jaxserve.structured.llguidance import LLGuidanceBackend
from jaxserve.engine.tokenization import encode_prompt
from jaxserve.weights import LoadedModel, load_model
from jaxserve.weights.load import default_cache_dir
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig, StepBatch, StructuredOutputsParams
from scheduler.request import SEED_BITS

logger = logging.getLogger(__name__)


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
    # the weights and the largest step leave (measured, see _kv_memory_for_utilization).
    # Overrides kv_cache_memory; num_blocks overrides it. Needs a device that reports its memory.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    attention_backend: str | None = None  # None: $JAXSERVE_ATTENTION_BACKEND or auto
    matmul_backend: str | None = None  # quantized matmuls; None: $JAXSERVE_MATMUL_BACKEND or auto
    token_buckets: tuple[int, ...] | None = None  # None: powers of two up to max_num_batched_tokens
    warm_up: bool = True
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
                raise ValueError(f"speculative decoding with {spec.method!r} does not run with tensor parallelism "
                                 "yet; ngram does")
            if u is not None:
                raise ValueError("gpu_memory_utilization does not work with tensor parallelism yet; "
                                 "give kv_cache_memory (per device)")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig()):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.generation = read_generation_config(loaded.source, config.generation_config)
        self.eos_token_ids = tuple(dict.fromkeys(mcfg.eos_token_ids + self.generation.eos_token_ids))
        dtype = loaded.model.dtype
        self.kv_dtype = kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        spec = config.speculative_config
        num_spec = spec.num_draft_tokens if spec else 0
        max_model_len = config.max_model_len or mcfg.max_position_embeddings
        tp = config.tensor_parallel_size
        check_tensor_parallel(mcfg, tp)
        self.mesh = make_mesh(tp, config.device_ids)
        self.attention_backend, attention = select_attention(config.attention_backend, mcfg, dtype, config.block_size,
                                                             kv_dtype, mesh=self.mesh)
        self.matmul_backend = select_matmul(config.matmul_backend, loaded.model, mesh=self.mesh)  # before the runner splits it
        make_runner = functools.partial(
            ModelRunner, loaded.model, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, attention=attention,
            kv_dtype=kv_dtype, buckets=self._token_buckets(num_spec),
            num_speculative_tokens=num_spec, draft_distributions=spec is not None and spec.method == "draft_model",
            draft_tree=spec and spec.tree, keep_step_hidden=spec is not None and spec.method == "eagle",
            mesh=self.mesh,
        )
        memory_bytes = config.kv_cache_memory
        if config.gpu_memory_utilization is not None and config.num_blocks is None:
            memory_bytes = self._kv_memory_for_utilization(make_runner, max_model_len)
        kv_plan = plan_kv(mcfg, kv_dtype, context=max_model_len, block_size=config.block_size,
                          memory_bytes=memory_bytes, num_blocks=config.num_blocks, tp=tp)
        num_blocks, capacity = kv_plan.num_blocks, kv_plan.usable_tokens
        if kv_plan.max_sequences == 0:
            logger.warning("the KV cache (%d tokens) cannot hold one sequence of max_model_len %d tokens (%s); "
                           "using max_model_len %d (python -m jaxserve.plan sizes the cache)", capacity,
                           max_model_len, both_units(kv_plan.bytes_per_sequence), capacity)
            max_model_len = capacity
        else:
            logger.info("plan: %d sequences of max_model_len %d fit in the KV cache at once (%s each)",
                        kv_plan.max_sequences, max_model_len, both_units(kv_plan.bytes_per_sequence))
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_prefix_caching=config.enable_prefix_caching, num_speculative_tokens=num_spec,
            draft_tree=spec and spec.tree,
        ))
        self.runner = make_runner(num_blocks=num_blocks, max_model_len=max_model_len)
        self.proposer: Proposer | None = None
        if spec:
            context = ProposerContext(model=loaded.model, model_config=mcfg, runner=self.runner,
                                      scheduler=self.scheduler, kv_dtype=kv_dtype,
                                      attention_backend=config.attention_backend, warm_up=config.warm_up)
            self.proposer = make_proposer(spec, context)
        self.async_scheduling = config.async_scheduling and spec is None
        self.outputs = OutputProcessor(self.tokenizer)
        # NOTE: a factory that does not hold the engine: a reference cycle would keep every
        # dropped engine (and its compiled programs' memory maps) alive until a full GC.
        self.grammars = GrammarCompiler(functools.partial(grammar_backend, self.tokenizer, self.eos_token_ids,
                                                          mcfg.vocab_size))
        self._in_flight: tuple[StepBatch | None, StepHandle | None] | None = None
        # On node 0 of several (jaxserve.parallel.multihost): the other nodes, which replay every call
        # that changes state, so all nodes dispatch the same steps.
        self.followers: Leader | None = None
        self._exports: dict[str, tuple[list[int], str | None]] = {}  # add_request(export_kv=True): prompt, salt
        # Set a jaxserve.engine.profiling.StepProfiler here to time each step's phases.
        self.profiler: StepProfiler | NullProfiler = NullProfiler()
        if spec:
            logger.info("speculative decoding: %s, %d tokens per step", spec.method, num_spec)
        logger.info("KV cache: %d blocks of %d tokens, %d tokens in all, %s (%.1f MiB)", num_blocks,
                    config.block_size, capacity, kv_dtype_label(kv_dtype), self.runner.kv.nbytes / 2**20)
        if config.warm_up:
            self.runner.warm_up()

    def _kv_memory_for_utilization(self, make_runner, max_model_len: int) -> int:
        """The KV cache's bytes under gpu_memory_utilization, as vLLM sizes it.

        The order matters: the activations of the largest step are known only once it has
        run, and running needs a cache. So a probe runner with the smallest cache (the null
        block and one more) compiles and runs every step shape first (warm-up, the largest
        included); the device's peak in use then is the weights plus the largest step's
        activations plus that small cache. The cache gets `utilization * bytes_limit` less
        that peak (the probe's cache excepted); the probe is freed before the real runner
        allocates it. Its programs compile again for the real cache's shape (the persistent
        compilation cache keeps both for the next start). A peak from loading the weights
        (jax cannot reset it) only makes the figure smaller, never too large. Not counted: a
        draft model (speculative_config), which loads after the cache is sized."""
        utilization = self.config.gpu_memory_utilization
        device = self.mesh.devices.flat[0]
        require_memory_stats(device)
        probe = make_runner(num_blocks=2, max_model_len=max_model_len)
        probe.warm_up()
        stats = device_memory_stats(device)
        probe_kv = probe.kv.nbytes
        jax.tree.map(lambda a: a.delete(), probe.kv)
        del probe
        budget = kv_budget_for_utilization(utilization, total_bytes=stats["bytes_limit"],
                                           peak_bytes=stats["peak_bytes_in_use"] - probe_kv)
        logger.info("gpu_memory_utilization %s of %s: weights and activations peaked at %s; KV cache budget %s",
                    utilization, both_units(stats["bytes_limit"]), both_units(stats["peak_bytes_in_use"] - probe_kv),
                    both_units(budget))
        return budget

    def _token_buckets(self, num_spec: int) -> list[int] | None:
        """The configured buckets; by default the runner's powers of two, plus one for a
        single sequence verifying its drafts (1 + k tokens: no padding at batch 1)."""
        if self.config.token_buckets:
            return list(self.config.token_buckets)
        if not num_spec:
            return None
        return sorted(set(token_buckets(self.config.max_num_batched_tokens)) | {num_spec + 1})

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache's settings, as /metrics shows them (vLLM's cache_config_info labels)."""
        kv = self.runner.kv
        return {"block_size": str(kv.block_size), "cache_dtype": self.config.kv_cache_dtype,
                "kv_cache_dtype": kv_dtype_label(kv.dtype), "num_gpu_blocks": str(kv.num_blocks - 1),
                "kv_cache_bytes": str(kv.nbytes), "tokens": str((kv.num_blocks - 1) * kv.block_size)}

    @classmethod
    def from_model(cls, model: str | None = None, *, dtype="auto", cache_dir=None, progress: bool = True,
                   quantization: str | None = None, tokenizer: str | None = None, **engine_kwargs) -> LLMEngine:
        """Load `model` (None: the embedded default) and build an engine; kwargs: EngineConfig fields.
        `dtype` "auto": the checkpoint's on a GPU, float32 on the CPU (jaxserve.weights.dtype).
        `quantization`: "int4", "fp8" or "gguf" (see jaxserve.model.quantization); None: as the checkpoint is.
        `tokenizer`: a folder whose tokenizer replaces the model's (weights without one)."""
        tp = engine_kwargs.get("tensor_parallel_size", 1)
        ensure_host_devices(tp if engine_kwargs.get("device_ids") is None else max(engine_kwargs["device_ids"]) + 1)
        if engine_kwargs.get("gpu_memory_utilization") is not None:
            require_memory_stats(jax.devices()[0])  # before the weights load: fail fast on the CPU
        enable_compilation_cache(cache_dir)
        dtype = resolve_dtype(dtype, model)
        loaded = load_model(model, dtype=jnp.dtype(dtype), cache_dir=cache_dir, progress=progress,
                            quantization=quantization, tokenizer=tokenizer)
        return cls(loaded, EngineConfig(**engine_kwargs))

    def replica(self, device_ids: tuple[int, ...]) -> LLMEngine:
        """An engine like this one on other devices (a data-parallel replica), from the same
        loaded weights: nothing is read from disk again."""
        return LLMEngine(self.loaded, dataclasses.replace(self.config, device_ids=tuple(device_ids)))

    # -- requests -----------------------------------------------------------------------

    def compile_grammar(self, spec: StructuredOutputsParams) -> Future:
        """Compile a structured_outputs spec in the background (cached by the spec); the
        Future's exception is a GrammarError saying what is wrong. A server awaits it
        before add_request, so a slow grammar never holds up the step loop."""
        return self.grammars.compile(spec)


    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | dict | None = None,
                    *, priority: int = 0, arrival_time: float | None = None, add_special_tokens: bool = True,
                    cache_salt: str | None = None, kv_handoff: KVHandoff | None = None,
                    export_kv: bool = False) -> None:
        """Queue a request. Raises ValueError for bad input; nothing is queued then.

        Prefill/decode disaggregation: `kv_handoff` (another engine's export_prefix of this
        prompt) goes into the prefix cache first, so only the rest is computed; with
        `export_kv` the finished output carries the prompt's KV (`RequestOutput.kv_handoff`).

        A text prompt gets the tokenizer's special tokens (its BOS) unless
        `add_special_tokens` is False; token ids are used as they are. Requests with
        different `cache_salt`s never share prefix-cache blocks. `params` None means
        the model's defaults (`default_sampling_params`).
        """
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        params = params or self.default_sampling_params()
        if self.followers is not None and params.seed is None:  # every node must draw the same tokens
            params = dataclasses.replace(params, seed=secrets.randbits(SEED_BITS))
        vocab = self.loaded.config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}, "
                             f"got {list(params.stop_token_ids)}")
        params.check_token_ids(vocab)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words must be tokenized, and this model has no tokenizer")
            params = params.with_bad_words_tokenized(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        # Waits for the grammar unless it is compiled already (the server's case, see compile_grammar).
        grammar = self.compile_grammar(params.structured_outputs).result() if params.structured_outputs else None
        prompt_ids = encode_prompt(self.tokenizer, prompt, vocab, add_special_tokens=add_special_tokens)
        prompt_text = prompt if isinstance(prompt, str) else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            samples.append(Request(request_id if i == 0 else f"{request_id}#{i}", prompt_ids, params,
                                   eos_token_ids=self.eos_token_ids, priority=priority, arrival_time=arrival,
                                   fork_of=samples[0] if i else None, sample_index=i, cache_salt=cache_salt))
        for req in samples:  # validate all before queueing any
            self.scheduler.check_request(req)
        for req in samples:  # each sample follows its own output
            req.grammar = self.grammars.request_grammar(grammar) if grammar is not None else None
        if any(r.request_id in self.outputs.groups for r in samples):
            raise ValueError(f"request id {request_id!r} is already in use")
        if kv_handoff is not None:
            self.import_prefix(prompt_ids, kv_handoff, cache_salt)
        if export_kv:
            self._check_handoff()
            self._exports[request_id] = (prompt_ids, cache_salt)
        self.outputs.add(request_id, prompt_text, prompt_ids, samples, arrival)
        for req in samples:
            self.scheduler.add_request(req)
        if self.followers is not None:
            self.followers.send("add_request", request_id, prompt, params, priority=priority, arrival_time=arrival,
                                add_special_tokens=add_special_tokens, cache_salt=cache_salt)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults, then `overrides`."""
        return SamplingParams(**{**self.generation.sampling, **overrides})

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and all its samples, freeing their KV blocks."""
        group = self.outputs.abort(request_id)
        self._exports.pop(request_id, None)
        if group is None:
            return False
        for req in reversed(group.samples):
            self.scheduler.abort_request(req.request_id)
        if self.followers is not None:
            self.followers.send("abort_request", request_id)
        return True

    # -- KV handed between engines (prefill/decode disaggregation) -------------------------

    def export_prefix(self, prompt_ids: list[int], cache_salt: str | None = None) -> KVHandoff:
        """The KV of the longest prefix of `prompt_ids` in this engine's prefix cache, in whole
        blocks: what a prefill engine hands over once a request for the prompt has run. Call
        it right after the step that finished the request (later steps may evict the blocks;
        the handoff then holds fewer, and the other engine computes the rest)."""
        self._check_handoff()
        blocks = self.scheduler.kv.lookup_prefix(list(prompt_ids), cache_salt)
        return KVHandoff(len(blocks), self.runner.read_blocks([b.block_id for b in blocks]))

    def import_prefix(self, prompt_ids: list[int], handoff: KVHandoff, cache_salt: str | None = None) -> int:
        """Put another engine's export_prefix into this engine's prefix cache, so a request for
        `prompt_ids` (with the same cache_salt) added next computes only the rest. The two may
        split the model differently (tensor parallelism); the cache's dtype, block size and
        shape per layer must match. Returns the tokens written (blocks cached here already,
        or that find no free block, are not)."""
        self._check_handoff()
        have, want = handoff.kv, self.runner.kv
        heads = sorted((have.k.shape[3], want.k.shape[3]))  # a tensor-parallel engine may repeat its KV heads
        checks = {"KV dtype": (have.dtype, want.dtype), "block size": (have.block_size, want.block_size),
                  "layers": (have.k.shape[0], want.k.shape[0]), "head size": (have.k.shape[-1], want.k.shape[-1]),
                  "KV heads": (heads[1] % heads[0], 0)}
        mismatch = [name for name, (a, b) in checks.items() if a != b]
        if mismatch:
            raise ValueError(f"the handed-over KV does not fit this engine's cache: its {', '.join(mismatch)} differ")
        writes = self.scheduler.kv.adopt_prefix(list(prompt_ids), cache_salt, handoff.num_blocks)
        self.runner.write_blocks(writes, handoff.kv)
        return len(writes) * want.block_size

    def _check_handoff(self) -> None:
        if not self.config.enable_prefix_caching:
            raise ValueError("handing KV between engines goes through the prefix cache: enable_prefix_caching")
        if self.followers is not None:
            raise ValueError("handing KV between engines does not work over several nodes yet")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    # -- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; outputs for every request that progressed or finished.

        With the overlapped loop these are the outputs of the step dispatched one call
        earlier; the step this call dispatches reports on the next call.
        """
        outputs = self._step()
        if self._exports:  # now, before a later step can evict the finished prompts' blocks
            for out in outputs:
                if out.finished and out.request_id in self._exports:
                    out.kv_handoff = self.export_prefix(*self._exports.pop(out.request_id))
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.followers is not None:
            self.followers.send("step")
        if self._in_flight is not None and self._needs_known_tokens():
            return self._collect()
        profiler = self.profiler
        if self.proposer is not None:
            with profiler.phase("propose"):
                self.proposer.propose(self.scheduler.running)
        with profiler.phase("schedule"):
            batch = self.scheduler.schedule()
        handle = None
        if batch is not None:
            with profiler.phase("dispatch"):
                draft_probs = self.proposer.draft_probs(batch) if self.proposer is not None else None
                handle = self.runner.dispatch(batch, draft_probs)
                if self.proposer is not None:
                    self.proposer.follow(batch, handle)
            profiler.dispatched_step(batch, handle.out.token_ids)
        outputs = self._collect() if self._in_flight is not None else []
        self._in_flight = (batch, handle)
        if batch is None or not self.async_scheduling:
            outputs += self._collect()
        return outputs

    def _collect(self) -> list[RequestOutput]:
        """Wait for the step in flight and write its tokens back."""
        batch, handle = self._in_flight
        self._in_flight = None
        profiler = self.profiler
        with profiler.phase("wait"):
            output = handle.fetch() if handle is not None else None
        with profiler.phase("update"):
            if output is None:
                results = self.scheduler.update(batch)
            else:
                results = self.scheduler.update(batch, output.token_ids, output.num_tokens)
        with profiler.phase("detokenize"):
            return self.outputs.process(results, output, self.scheduler)

    def _needs_known_tokens(self) -> bool:
        """A running request with penalties, bad words or a grammar: the next batch needs its
        last token on the host."""
        return any(r.sampling_params.uses_penalties or r.sampling_params.bad_words or r.grammar is not None
                   for r in self.scheduler.running)

    def generate_all(self) -> list[RequestOutput]:
        """Step until every request is done; the final output of each, in finishing order."""
        finished = []
        while self.has_unfinished():
            finished += [o for o in self.step() if o.finished]
        return finished

    @property
    def compilations(self) -> int:
        return self.runner.compilations.count


def grammar_backend(tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int) -> LLGuidanceBackend:
    """The grammar engine over a model's tokenizer (made on the first compile); a
    ValueError saying why when there is none it can read."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer, and this model has none")
    try:
        return LLGuidanceBackend(tokenizer, eos_token_ids, vocab_size)
    except ValueError as e:
        raise ValueError(f"structured output needs a tokenizer the grammar engine can read: {e}") from None


def device_memory_stats(device) -> dict | None:
    """The device's allocator figures (`bytes_limit`, `peak_bytes_in_use`, ...); None on the CPU."""
    return device.memory_stats()


def require_memory_stats(device) -> None:
    if device_memory_stats(device) is None:
        raise ValueError(f"gpu_memory_utilization needs a device that reports its memory; the {device.platform} "
                         "device does not: size the KV cache with kv_cache_memory (--kv-cache-memory) instead")


def enable_compilation_cache(cache_dir=None) -> None:
    """Keep compiled XLA programs on disk next to the converted weights, so a second start
    skips most of the warm-up compile."""
    path = Path(cache_dir or default_cache_dir()) / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
