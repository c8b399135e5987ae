"""One request's state: counters that catch up, not phases.

A request's tokens are its prompt followed by what it has generated. Each step the
scheduler gives it some of the tokens it has not computed yet (a prefill chunk, a whole
prompt, or the one token sampled last step); `num_computed_tokens` catches up to
`num_tokens`, and whenever it reaches it the step samples one more token.

The scheduler counts a step's tokens as computed when it schedules them, and a sampled
token exists from then on too, as a pending token: with the overlapped step loop the
next step is scheduled before this one's tokens reach the host, and a pending token is
fed to it from the device. `all_token_ids` holds the known ids; the pending ones follow.

    all_token_ids   [p0 p1 p2 p3 | o0 o1]  pending: [o2]      num_tokens = 7
                     prompt        known outputs   sampled by the step in flight
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from scheduler.sampling_params import SamplingParams
from scheduler.spec_stats import DraftLength, SpecDecodingStats


class Grammar(Protocol):
    """What the scheduler asks of a request's grammar (jaxserve.structured's RequestGrammar)."""

    bitmask_words: int  # int32 words of a row's packed token mask
    error: str | None  # why the grammar engine gave up, or None

    def fill_bitmask(self, row: np.ndarray, ahead: Sequence[int] = ()) -> None: ...

    def accept(self, token_id: int) -> None: ...


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3  # an end-of-sequence token, a stop token or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the model's context
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


_arrival_counter = itertools.count()
SEED_BITS = 64  # a seed is two uint32 words on the device (a threefry key's own data)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        fork_of: Request | None = None,
        sample_index: int = 0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # Prompt then output, kept as one list: the hot paths read it every step.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority  # lower is served first
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = next(_arrival_counter)  # ties in arrival_time break by this
        # n > 1: the other samples wait for this one's prompt, then share its blocks.
        self.fork_of = fork_of
        # The random stream of this sample alone, never dependent on the batch: the sampler
        # draws from fold_in(fold_in(key(seed), sample_index), output index).
        seed = sampling_params.seed if sampling_params.seed is not None else secrets.randbits(SEED_BITS)
        self.seed = seed % 2**SEED_BITS
        self.sample_index = sample_index
        self.cache_salt = cache_salt  # requests with different salts never share cached KV
        self.lora_id = lora_id  # the LoRA adapter it runs with (None: the base model); part of its cache key
        self.output_token_ids: list[int] = []
        # Draft tokens proposed to follow the last token (speculative decoding), verified by
        # the next step that runs this request; the scheduler clears them once it has.
        self.spec_token_ids: list[int] = []
        self.spec_stats = SpecDecodingStats()  # this request's verified drafts
        self.draft_length = DraftLength()  # how many drafts pay for it (adaptive draft length)
        self.max_drafts: int | None = None  # this step's cap on its drafts (None: the proposer's)
        self.num_computed_tokens = 0
        self.num_pending = 0  # sampled tokens whose ids the host does not know yet (steps in flight)
        self.pending_row = 0  # the row of the latest step that samples one: where the device has it
        self.first_scheduled_time: float | None = None  # when it first ran: its time in the queue ends
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        # Structured output: the matcher of the output's grammar (jaxserve.structured's
        # RequestGrammar: `fill_bitmask(row, ahead)`, `accept(token)`), set by the engine.
        self.grammar: Grammar | None = None

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, status: RequestStatus) -> None:
        if status == RequestStatus.RUNNING and self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()
        self._status = status

    def append_output(self, token_id: int) -> None:
        """The oldest pending token's id has arrived (or a verified draft token)."""
        assert self.num_pending > 0, f"{self.request_id}: a token arrived that no step sampled"
        self.num_pending -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def drop_outputs_after(self, num_outputs: int) -> None:
        """Forget the generated tokens after the first `num_outputs` (a finished request's
        accepted draft tokens that came after its stop string)."""
        assert self.is_finished and self.num_pending == 0
        del self.output_token_ids[num_outputs:]
        del self.all_token_ids[self.num_prompt_tokens + num_outputs :]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, pending ones included."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are still to be computed: asked for (once per request, by its
        first sample) and no token sampled yet (after that, a recompute needs none)."""
        return self.sampling_params.prompt_logprobs is not None and self.fork_of is None and self.num_output_tokens == 0

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Service order: priority, then first come first served."""
        return (self.priority, self.arrival_time, self.arrival_order)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, out={self.num_output_tokens})"
        )
