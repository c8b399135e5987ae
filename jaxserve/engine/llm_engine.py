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
is dropped, never shown.

Some batches need the tokens of the one in flight on the host before they are built:
requests with penalties need their whole history, a request with a grammar (structured
output) its latest token to build its mask, and a proposer of draft tokens (speculative
decoding) the latest tokens to guess the next ones. Then the step first waits for batch
N and writes its tokens back, and still turns them into text after dispatching N+1:

    overlapped:  schedule(N+1) -> dispatch(N+1) -> fetch(N) -> update(N) -> detokenize(N)
    waiting:     fetch(N) -> update(N) -> schedule(N+1) -> dispatch(N+1) -> detokenize(N)
    device:      ...[ step N ][ step N+1 ]...

A step that verified drafts is always waited for (how many of them were accepted decides
the next batch). The n-gram proposer keeps nothing on the device, so with it the loop
overlaps every step in which no request is about to draft (NgramProposer.wants_known_tokens);
proposers that follow each step on the device (draft models, Medusa and EAGLE heads) run
the serial loop, which waits for each batch before building the next.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from concurrent.futures import Future
from typing import NamedTuple

from jaxserve.engine import builder
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.profiling import NullProfiler, StepProfiler
from jaxserve.engine.tokenization import encode_prompt
from jaxserve.lora.host_cache import LoRAHostCache
from jaxserve.lora.peft_adapter import LoRAAdapter
from jaxserve.lora.request import LoRARequest
from jaxserve.model.kv_cache import KVHandoff, kv_dtype_label
from jaxserve.parallel.sharding import resident_bytes
from jaxserve.runner.model_runner import StepHandle
from jaxserve.spec_decode.step_costs import StepCosts
from jaxserve.weights.load import LoadedModel
from scheduler import Request, SamplingParams, StepBatch, StructuredOutputsParams
from scheduler.request import SEED_BITS

logger = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """A dispatched step: its batch (None when nothing was scheduled), its device handle,
    when it was scheduled (time.perf_counter) and whether after the step before's tokens."""

    batch: StepBatch | None
    handle: StepHandle | None
    scheduled_at: float = 0.0
    waited: bool = True  # scheduled after the step before's tokens arrived


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), *, progress: bool = False):
        """`progress`: a bar on stderr while the warm-up compiles (one step per bucket)."""
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        parts = builder.build_parts(loaded, config, progress)
        self.generation, self.eos_token_ids = parts.generation, parts.eos_token_ids
        self.kv_dtype, self.mesh, self.max_model_len = parts.kv_dtype, parts.mesh, parts.max_model_len
        self.attention_backend, self.matmul_backend = parts.attention_backend, parts.matmul_backend
        self.scheduler, self.runner, self.proposer = parts.scheduler, parts.runner, parts.proposer
        self.grammars = parts.grammars
        self.async_scheduling = config.async_scheduling
        self.outputs = OutputProcessor(self.tokenizer)
        self._seeds = random.Random(config.seed) if config.seed is not None else None  # for unseeded requests
        self._in_flight: InFlight | None = None
        # Speculation with an overlapping proposer: the engine's pure decode step times, which
        # say whether drafts pay at the batch running (see spec_decode.step_costs).
        spec = config.speculative_config
        measured = spec is not None and spec.disable_by_measured_cost and self.proposer.overlaps
        self.step_costs = StepCosts(self._token_bucket) if measured else None
        self._steps = 0  # schedules so far: the step the drafting decision is for
        self._last_ready = 0.0  # when the latest step's tokens reached the host
        self._exports: dict[str, tuple[list[int], str | None]] = {}  # add_request(export_kv=True): prompt, salt
        # Set a jaxserve.engine.profiling.StepProfiler here to time each step's phases.
        self.profiler: StepProfiler | NullProfiler = NullProfiler()
        # LoRA: the adapters requests named, read on the host (device slots: the scheduler's LoRASlots).
        self.loras = (
            LoRAHostCache(loaded.config, config.max_lora_rank, config.max_cpu_loras, loaded.model.dtype)
            if config.enable_lora
            else None
        )

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache's settings, as /metrics shows them (vLLM's cache_config_info labels)."""
        kv = self.runner.kv
        return {
            "block_size": str(kv.block_size),
            "cache_dtype": self.config.kv_cache_dtype,
            "kv_cache_dtype": kv_dtype_label(kv.dtype, self.runner.config.kv_scales),
            "num_gpu_blocks": str(kv.num_blocks - 1),
            "kv_cache_bytes": str(kv.nbytes),
            "tokens": str((kv.num_blocks - 1) * kv.block_size),
        }

    def device_bytes(self) -> dict[str, dict[int, int]]:
        """Bytes each device holds (by device id) of the weights ("weights") and of the KV
        cache ("kv_cache"), as /metrics shows them."""
        return {"weights": resident_bytes(self.runner.params), "kv_cache": resident_bytes(self.runner.kv)}

    @classmethod
    def from_model(
        cls,
        model: str | None = None,
        *,
        dtype="auto",
        cache_dir=None,
        progress: bool = True,
        quantization: str | None = None,
        tokenizer: str | None = None,
        **engine_kwargs,
    ) -> LLMEngine:
        """Load `model` (None: the embedded default) and build an engine; kwargs: EngineConfig fields.
        `dtype` "auto": the checkpoint's on a GPU, float32 on the CPU (jaxserve.weights.dtype).
        `quantization`: "int4", "int8", "fp8" or "gguf" (see jaxserve.model.quantization); None: as the checkpoint is.
        `tokenizer`: a folder whose tokenizer replaces the model's (weights without one).
        `progress`: bars on stderr while the weights convert and the programs compile."""
        loaded, config = builder.load(
            model,
            dtype=dtype,
            cache_dir=cache_dir,
            progress=progress,
            quantization=quantization,
            tokenizer=tokenizer,
            **engine_kwargs,
        )
        return cls(loaded, config, progress=progress)

    def replica(self, device_ids: tuple[int, ...]) -> LLMEngine:
        """An engine like this one on other devices (a data-parallel replica), from the same
        loaded weights: nothing is read from disk again (its runner copies them device to
        device, shard by shard, onto its own mesh)."""
        return LLMEngine(self.loaded, dataclasses.replace(self.config, device_ids=tuple(device_ids)))

    # -- requests -----------------------------------------------------------------------

    def compile_grammar(self, spec: StructuredOutputsParams) -> Future:
        """Compile a structured_outputs spec in the background (cached by the spec); the
        Future's exception is a GrammarError saying what is wrong. A server awaits it
        before add_request, so a slow grammar never holds up the step loop."""
        return self.grammars.compile(spec)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | dict | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        kv_handoff: KVHandoff | None = None,
        export_kv: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for bad input; nothing is queued then.

        Prefill/decode disaggregation: `kv_handoff` (another engine's export_prefix of this
        prompt) goes into the prefix cache first, so only the rest is computed; with
        `export_kv` the finished output carries the prompt's KV (`RequestOutput.kv_handoff`).

        A text prompt gets the tokenizer's special tokens (its BOS) unless
        `add_special_tokens` is False; token ids are used as they are. Requests with
        different `cache_salt`s never share prefix-cache blocks. `params` None means
        the model's defaults (`default_sampling_params`). `lora_request`: the LoRA adapter it
        runs with (needs enable_lora; an adapter that cannot be served is a ValueError here).
        """
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        params = params or self.default_sampling_params()
        if params.seed is None and self._seeds is not None:
            params = params.replace(seed=self._seeds.getrandbits(SEED_BITS))
        vocab = self.loaded.config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be below the vocabulary size {vocab}, got {list(params.stop_token_ids)}"
            )
        params.check_token_ids(vocab)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words must be tokenized, and this model has no tokenizer")
            params = params.with_bad_words_tokenized(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        lora_id = self._register_lora(lora_request)
        # Waits for the grammar unless it is compiled already (the server's case, see compile_grammar).
        grammar = self.compile_grammar(params.structured_outputs).result() if params.structured_outputs else None
        prompt_ids = encode_prompt(self.tokenizer, prompt, vocab, add_special_tokens=add_special_tokens)
        prompt_text = prompt if isinstance(prompt, str) else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            samples.append(
                Request(
                    request_id if i == 0 else f"{request_id}#{i}",
                    prompt_ids,
                    params,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    arrival_time=arrival,
                    fork_of=samples[0] if i else None,
                    sample_index=i,
                    cache_salt=cache_salt,
                    lora_id=lora_id,
                )
            )
        for req in samples:  # validate all before queueing any
            self.scheduler.check_request(req)
        budget = params.thinking_token_budget
        for req in samples:  # each sample follows its own output
            if budget is not None:  # the end of the thinking is forced past the budget
                req.grammar = self.grammars.request_grammar(grammar, params.thinking_end_token_id, budget)
            elif grammar is not None:
                req.grammar = self.grammars.request_grammar(grammar, params.structured_outputs.after_token_id)
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

    def register_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Read and check an adapter now (a ValueError if it cannot be served), before a request
        names it; `adapter`: read already (`self.loras.read`, from any thread)."""
        if self.loras is None:
            raise ValueError("a lora_request needs LoRA enabled (enable_lora=True, --enable-lora)")
        self.loras.register(lora_request, adapter)

    def _register_lora(self, lora_request: LoRARequest | None) -> int | None:
        if lora_request is None:
            return None
        self.register_lora(lora_request)
        return lora_request.lora_int_id

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
        return True

    # -- KV handed between engines (prefill/decode disaggregation) -------------------------

    def export_prefix(self, prompt_ids: list[int], cache_salt: str | None = None) -> KVHandoff:
        """The KV of the longest prefix of `prompt_ids` in this engine's prefix cache, in whole
        blocks (exactly those: no padding travels), with their handoff digests: what a prefill
        engine hands over once a request for the prompt has run. Call it right after the step
        that finished the request (later steps may evict the blocks; the handoff then holds
        fewer, and the other engine computes the rest)."""
        self._check_handoff()
        blocks = self.scheduler.kv.lookup_prefix(list(prompt_ids), cache_salt)
        digests = self.scheduler.kv.handoff_digests(list(prompt_ids), cache_salt, len(blocks))
        kv = self.runner.read_blocks([b.block_id for b in blocks])
        return KVHandoff(len(blocks), kv, tuple(digests), cache_salt)

    def import_prefix(self, prompt_ids: list[int], handoff: KVHandoff, cache_salt: str | None = None) -> int:
        """Put another engine's export_prefix into this engine's prefix cache, so a request for
        `prompt_ids` (with the same cache_salt) added next computes only the rest. The two may
        split the model differently (tensor parallelism); the cache's dtype, block size and
        shape per layer must match, and the handoff's digests must be those of `prompt_ids`
        and `cache_salt` (KV computed for another prompt is never written: a ValueError).
        Returns the tokens written (blocks cached here already, or that find no free block,
        are not)."""
        self._check_handoff()
        have, want = handoff.kv, self.runner.kv
        heads = sorted((have.k.shape[3], want.k.shape[3]))  # a tensor-parallel engine may repeat its KV heads
        checks = {
            "KV dtype": (have.dtype, want.dtype),
            "block size": (have.block_size, want.block_size),
            "layers": (have.k.shape[0], want.k.shape[0]),
            "head size": (have.k.shape[-1], want.k.shape[-1]),
            "KV heads": (heads[1] % heads[0], 0),
            "block count": (have.k.shape[1], handoff.num_blocks),
        }
        mismatch = [name for name, (a, b) in checks.items() if a != b]
        if mismatch:
            raise ValueError(f"the handed-over KV does not fit this engine's cache: its {', '.join(mismatch)} differ")
        if list(handoff.digests) != self.scheduler.kv.handoff_digests(list(prompt_ids), cache_salt, handoff.num_blocks):
            raise ValueError("the handed-over KV was computed for another prompt (or cache_salt): its digests differ")
        writes = self.scheduler.kv.adopt_prefix(list(prompt_ids), cache_salt, handoff.num_blocks)
        self.runner.write_blocks(writes, handoff.kv)
        return len(writes) * want.block_size

    def _check_handoff(self) -> None:
        if not self.config.enable_prefix_caching:
            raise ValueError("handing KV between engines goes through the prefix cache: enable_prefix_caching")
        if self.runner.broadcast is not None:
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
        if self.async_scheduling and (self.proposer is None or self.proposer.overlaps):
            return self._step_overlapped()
        return self._collect(self._schedule_and_dispatch())

    def _step_overlapped(self) -> list[RequestOutput]:
        """Dispatch step N+1, then wait for step N and report it (vLLM's step_with_batch_queue);
        where N+1 needs N's tokens, wait for them first and report N after the dispatch. A
        step with nothing scheduled reports at once."""
        previous = self._take_in_flight()
        known = None
        if previous is not None and self._needs_known_tokens(previous.batch):
            known = self._wait_and_update(previous)
        self._in_flight = self._schedule_and_dispatch(waited=known is not None)
        outputs = []
        if previous is not None:
            outputs = self._report(*(known if known is not None else self._wait_and_update(previous)))
        if self._in_flight.batch is None:
            outputs += self._collect(self._take_in_flight())
        return outputs

    def _schedule_and_dispatch(self, waited: bool = True) -> InFlight:
        """Propose drafts, schedule the next batch and enqueue it on the device (no wait).
        `waited`: the step before's tokens are on the host (the serial loop, or the
        overlapped loop's waiting step)."""
        profiler = self.profiler
        scheduled_at = time.perf_counter()
        self._steps += 1
        if self.proposer is not None:
            with profiler.phase("propose"):
                self.proposer.propose(self.scheduler.running)
                if self.proposer.overlaps and self.step_costs is not None:
                    self._decline_drafts_that_do_not_pay(waited)
        with profiler.phase("schedule"):
            batch = self.scheduler.schedule()
        if batch is None:
            return InFlight(None, None)
        with profiler.phase("dispatch"):
            for slot, lora_id in batch.lora_loads:  # adapters the scheduler gave a device slot this step
                self.runner.load_lora(slot, self.loras.slot_arrays(lora_id))
            draft_probs = self.proposer.draft_probs(batch) if self.proposer is not None else None
            handle = self.runner.dispatch(batch, draft_probs)
            if self.proposer is not None:
                self.proposer.follow(batch, handle)
        profiler.dispatched_step(batch, handle.out.token_ids)
        return InFlight(batch, handle, scheduled_at, waited)

    def _decline_drafts_that_do_not_pay(self, waited: bool) -> None:
        running = self.scheduler.running
        drafting = [(r, len(r.spec_token_ids)) for r in running if r.spec_token_ids]
        if drafting and not self.step_costs.drafts_pay(self._steps, len(running), drafting, waited):
            for req, _ in drafting:
                req.spec_token_ids = []

    def _token_bucket(self, num_tokens: int) -> int:
        """The token bucket of the program a step of `num_tokens` runs in."""
        return next((t for t in self.runner.buckets if t >= num_tokens), num_tokens)

    def _take_in_flight(self) -> InFlight | None:
        in_flight, self._in_flight = self._in_flight, None
        return in_flight

    def _collect(self, in_flight: InFlight) -> list[RequestOutput]:
        """Wait for a dispatched step, write its tokens back and report them."""
        return self._report(*self._wait_and_update(in_flight))

    def _wait_and_update(self, in_flight: InFlight):
        """Wait for a dispatched step and write its tokens back: (the scheduler's results, the step's output)."""
        batch, handle, scheduled_at, waited = in_flight
        profiler = self.profiler
        with profiler.phase("wait"):
            output = handle.fetch() if handle is not None else None
        if output is not None and self.step_costs is not None:
            self._time_step(batch, scheduled_at, waited)
        with profiler.phase("update"):
            if output is None:
                return self.scheduler.update(batch), None
            return self.scheduler.update(batch, output.token_ids, output.num_tokens), output

    def _time_step(self, batch: StepBatch, scheduled_at: float, waited: bool) -> None:
        """A pure decode step's time, from its predecessor's tokens (or its own scheduling, if
        later) to its own: a step that waited for its predecessor pays the host's time between."""
        ready = time.perf_counter()
        if batch.num_tokens == batch.num_seqs + int(batch.num_spec_tokens.sum()):
            seconds = ready - max(self._last_ready, scheduled_at)
            self.step_costs.observe(batch.verify is not None, waited, batch.num_tokens, seconds)
        self._last_ready = ready

    def _report(self, results, output) -> list[RequestOutput]:
        with self.profiler.phase("detokenize"):
            return self.outputs.process(results, output, self.scheduler)

    def _needs_known_tokens(self, in_flight: StepBatch | None) -> bool:
        """The next batch needs the tokens of the one in flight on the host: it verified
        drafts, or a running request has penalties, bad words or a grammar, or the
        proposer is about to draft."""
        if in_flight is not None and in_flight.verify is not None:
            return True
        running = self.scheduler.running
        if any(
            r.sampling_params.uses_penalties or r.sampling_params.bad_words or r.grammar is not None for r in running
        ):
            return True
        if self.proposer is None:
            return False
        drafting = self.proposer.wants_known_tokens(running)
        if not drafting or self.step_costs is None:
            return bool(drafting)
        return self.step_costs.drafts_pay(self._steps + 1, len(running), drafting, waited=False)

    def generate_all(self) -> list[RequestOutput]:
        """Step until every request is done; the final output of each, in finishing order."""
        finished = []
        while self.has_unfinished():
            finished += [o for o in self.step() if o.finished]
        return finished

    @property
    def compilations(self) -> int:
        return self.runner.compilations.count
