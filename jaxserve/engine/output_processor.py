"""Turns the scheduler's per-step results into `RequestOutput`s: text, logprobs, timings."""

from __future__ import annotations

import dataclasses
import functools
import time

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.runner.model_runner import PromptLogprobsOutput, RunnerOutput
from scheduler import Request, RequestStatus, Scheduler, SpecDecodingStats, StepResult


@dataclasses.dataclass
class RequestGroup:
    """A user request and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    logprobs: list[list[dict[int, float]]]
    cumulative_logprobs: list[float]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled in prompt order

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self._sample: dict[str, tuple[RequestGroup, int]] = {}  # sample request id -> (group, index)
        self._decode_token = functools.lru_cache(maxsize=65536)(self._decode_one)

    def add(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], samples: list[Request], arrival_time: float
    ) -> None:
        p = samples[0].sampling_params
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                p.stop,
                include_stop=p.include_stop_str_in_output,
                min_tokens=p.min_tokens,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
            )
            if self.tokenizer
            else None
            for _ in samples
        ]
        group = RequestGroup(
            request_id,
            prompt,
            prompt_ids,
            samples,
            detoks,
            [[] for _ in samples],
            [0.0] * len(samples),
            RequestMetrics(arrival_time),
            [None] if p.prompt_logprobs is not None else None,
        )
        self.groups[request_id] = group
        for i, req in enumerate(samples):
            self._sample[req.request_id] = (group, i)

    def process(
        self, results: list[StepResult], output: RunnerOutput | None, scheduler: Scheduler
    ) -> list[RequestOutput]:
        now = time.monotonic()
        if output is not None and output.prompt_logprobs is not None:
            self._record_prompt_logprobs(output.prompt_logprobs)
        deltas: dict[str, dict[int, tuple[str, list[int]]]] = {}
        for req, row, num_tokens in results:
            if req.request_id not in self._sample:
                continue  # aborted by the user
            group, i = self._sample[req.request_id]
            text, new_ids = "", []
            if row is not None:
                first = len(req.output_token_ids) - num_tokens  # more than one: accepted draft tokens
                detok = group.detokenizers[i]
                # As vLLM: the EOS or stop token that ended it is not text, unless include_stop_str_in_output.
                hide_stop_token = self._ended_by_token(req) and not req.sampling_params.include_stop_str_in_output
                text_end = len(req.output_token_ids) - int(hide_stop_token)  # the tokens before it are text
                for j, token in enumerate(req.output_token_ids[first:]):
                    new_ids.append(token)
                    self._record_logprobs(
                        group, i, req, token, output, row, j if output.num_tokens is not None else None
                    )
                    self._record_time(group, i, now)
                    if detok is not None and first + j < text_end:
                        text += detok.push(token)
                        if detok.stop_reason is not None:
                            self._stop_on_string(req, detok.stop_reason, scheduler)
                            if j + 1 < num_tokens:  # as if the accepted drafts after it were never sampled
                                req.drop_outputs_after(first + j + 1)
                            break
            if req.is_finished and group.detokenizers[i] is not None:
                text += group.detokenizers[i].finish()
            deltas.setdefault(group.request_id, {})[i] = (text, new_ids)

        outputs = []
        for request_id, changed in deltas.items():
            group = self.groups[request_id]
            outputs.append(self._request_output(group, changed, now))
            if group.finished:
                self._forget(group)
        return outputs

    def _record_logprobs(self, group, i, req, token, output, row, position) -> None:
        """`position`: which of the row's verified positions the token is (None: one token per row)."""
        k = req.sampling_params.logprobs
        if k is not None:
            at = row if position is None else (row, position)
            logprob = float(output.logprobs[at])
            group.cumulative_logprobs[i] += logprob
            entry = {}
            if k and output.top_logprob_ids is not None:
                entry = dict(zip(output.top_logprob_ids[at][:k].tolist(), output.top_logprobs[at][:k].tolist()))
            entry[token] = logprob
            group.logprobs[i].append(entry)

    def _record_prompt_logprobs(self, out: PromptLogprobsOutput) -> None:
        """Append each prompt position's entry in order; one already there (a step computed it
        before the request was preempted and recomputed) is not added twice."""
        k_of = {}
        for n, request_id in enumerate(out.request_ids):
            found = self._sample.get(request_id)
            if found is None:
                continue  # aborted
            group = found[0]
            position = int(out.positions[n])
            if len(group.prompt_logprobs) != position:
                continue
            k = k_of.setdefault(request_id, group.samples[0].sampling_params.prompt_logprobs)
            entry = {
                t: Logprob(v, rank, self._decode_token(t))
                for rank, (t, v) in enumerate(zip(out.top_ids[n][:k].tolist(), out.top_logprobs[n][:k].tolist()), 1)
            }
            token = int(out.token_ids[n])
            entry[token] = Logprob(float(out.logprobs[n]), int(out.ranks[n]), self._decode_token(token))
            group.prompt_logprobs.append(entry)

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    @staticmethod
    def _record_time(group: RequestGroup, i: int, now: float) -> None:
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if i == 0:
            m.token_times.append(now)

    @staticmethod
    def _ended_by_token(req: Request) -> bool:
        """It stopped on an EOS or stop token (its last output token), not on a stop string."""
        return req.status == RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)

    @staticmethod
    def _stop_on_string(req: Request, stop: str, scheduler: Scheduler) -> None:
        if not scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop):
            # It ended this very step for another reason; the stop string still wins.
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop

    def _request_output(
        self, group: RequestGroup, changed: dict[int, tuple[str, list[int]]], now: float
    ) -> RequestOutput:
        completions = []
        for i, req in enumerate(group.samples):
            detok = group.detokenizers[i]
            new_text, new_ids = changed.get(i, ("", []))
            completions.append(
                CompletionOutput(
                    index=i,
                    text=detok.text if detok else "",
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=group.cumulative_logprobs[i]
                    if req.sampling_params.logprobs is not None
                    else None,
                    logprobs=group.logprobs[i] if req.sampling_params.logprobs is not None else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    new_text=new_text,
                    new_token_ids=new_ids,
                )
            )
        group.metrics.first_scheduled_time = group.samples[0].first_scheduled_time
        if group.finished:
            group.metrics.finished_time = now
            drafts = SpecDecodingStats.total([r.spec_stats for r in group.samples])
            group.metrics.spec_decoding = drafts if drafts.num_drafts else None
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            completions,
            group.finished,
            group.samples[0].num_cached_tokens,
            group.metrics,
            group.prompt_logprobs,
        )

    def abort(self, request_id: str) -> RequestGroup | None:
        group = self.groups.get(request_id)
        if group is not None:
            self._forget(group)
        return group

    def _forget(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for req in group.samples:
            self._sample.pop(req.request_id, None)
