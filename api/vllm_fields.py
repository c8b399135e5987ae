"""Every request field of vLLM's ChatCompletionRequest and CompletionRequest, and what this
server does with it: data, not code. `benchmarks/check_vllm_fields.py` compares the names
with an installed vLLM's request models (run it where vLLM is installed; a drift exits
non-zero), and tests/api/test_vllm_fields.py checks the server against this table.

- honoured: a field of the request models in api/protocol.py, which does what vLLM does;
- refused: a 400 naming the field unless its value is one of `harmless` (vLLM's default):
  dropping it would return other output than vLLM would;
- ignored: accepted and named in the `x-ignored-fields` header, for fields that cannot
  change the output (`reason` says why).

`in_vllm=False` marks our own fields (OpenAI's older ones, vLLM's removed ones) that the
checker does not expect in vLLM's models. Checked against vLLM 0.32.0 (its CPU build):
no difference.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple


class FieldUse(NamedTuple):
    handling: Literal["honoured", "refused", "ignored"]
    harmless: tuple[Any, ...] = ()  # refused: the values taken (None: the field left out)
    reason: str = ""
    in_vllm: bool = True


def honoured(in_vllm: bool = True) -> FieldUse:
    return FieldUse("honoured", in_vllm=in_vllm)


def refused(*harmless: Any, reason: str = "", in_vllm: bool = True) -> FieldUse:
    return FieldUse("refused", (None, *harmless), reason, in_vllm)


def ignored(reason: str) -> FieldUse:
    return FieldUse("ignored", reason=reason)


_HONOURED_BOTH = (
    "model n temperature top_p presence_penalty frequency_penalty seed stop stream stream_options logit_bias "
    "top_k min_p repetition_penalty ignore_eos min_tokens stop_token_ids include_stop_str_in_output "
    "allowed_token_ids bad_words skip_special_tokens spaces_between_special_tokens priority add_special_tokens "
    "cache_salt kv_transfer_params prompt_logprobs truncate_prompt_tokens truncation_side return_token_ids "
    "response_format structured_outputs max_tokens logprobs"
).split()

_SHARED: dict[str, FieldUse] = {
    **{name: honoured() for name in _HONOURED_BOTH},
    # vLLM's structured-output fields before `structured_outputs` (removed from vLLM since).
    **{name: honoured(in_vllm=False) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "user": ignored("an end-user id for the caller's records; vLLM ignores it too"),
    "request_id": ignored("names vLLM's response id; this server makes its own (a client's could collide)"),
    "session_id": ignored("a routing hint shared by related requests; no effect on one request's output"),
    "return_token_offsets": ignored("vLLM honours it on the /render endpoints only, as here: none"),
    "return_mm_kwargs": ignored("vLLM honours it on the /render endpoints only"),
    "routed_experts_prompt_start": ignored("shapes routed_experts, which this server never returns (no MoE)"),
    "ec_transfer_params": ignored("the encoder cache of multimodal inputs, which this server does not take"),
    "stream_interval": ignored("how many tokens a streamed chunk gathers; the text is the same"),
    "use_beam_search": refused(False),
    "length_penalty": refused(1.0),
    "watermarking": refused(False),
    "logprob_token_ids": refused(reason="logprobs of chosen token ids"),
    "return_tokens_as_token_ids": refused(False),
    "vllm_xargs": refused({}, reason="this server has no extensions to take them"),
    "repetition_detection": refused(reason="it would end a repetitive output early"),
    "mm_payload": refused(reason="multimodal inputs; prompts here are text or token ids"),
    # Fields of older vLLM releases, which a client may still send.
    "logits_processors": refused(in_vllm=False),
    "guided_decoding_backend": refused(in_vllm=False),
    "guided_whitespace_pattern": refused(in_vllm=False),
    "structural_tag": refused(in_vllm=False),
}

COMPLETIONS: dict[str, FieldUse] = {
    **_SHARED,
    "prompt": honoured(),
    "echo": honoured(),
    "best_of": honoured(in_vllm=False),  # must equal n
    "suffix": refused(""),
    "thinking_token_budget": refused(reason="a completion has no reasoning parser's thinking to cut short"),
    "prompt_embeds": refused(reason="prompts are text or token ids here"),
}

CHAT: dict[str, FieldUse] = {
    **_SHARED,
    **{
        name: honoured()
        for name in (
            "messages max_completion_tokens top_logprobs add_generation_prompt continue_final_message chat_template "
            "chat_template_kwargs tools tool_choice parallel_tool_calls reasoning_effort include_reasoning "
            "thinking_token_budget"
        ).split()
    },
    "functions": refused([], reason="use tools", in_vllm=False),  # OpenAI's older name
    "echo": refused(False),
    "documents": refused(reason="the chat template is not given documents"),
    "return_prompt_text": refused(False),
    "media_io_kwargs": ignored("multimodal inputs only; messages here are text"),
    "mm_processor_kwargs": ignored("multimodal inputs only; messages here are text"),
}

# stream_options, in both endpoints (vLLM's StreamOptions).
STREAM_OPTIONS: dict[str, FieldUse] = {"include_usage": honoured(), "continuous_usage_stats": honoured()}

ENDPOINTS: dict[str, dict[str, FieldUse]] = {"completions": COMPLETIONS, "chat": CHAT}


def refused_fields(endpoint: str) -> dict[str, FieldUse]:
    return {name: use for name, use in ENDPOINTS[endpoint].items() if use.handling == "refused"}
