"""Checks of our own, loaded by the schemathesis run in test_fuzz.py (its `hooks` setting),
beside schemathesis' built-in ones (`--checks all` runs both)."""

from __future__ import annotations

import json
import re

import schemathesis

# The rules a JSON schema cannot state, so that a request which fits the schema may still be
# refused with a 400 that names one of these parameters:
#   prompt       the prompt tokenizes to nothing (" " without special tokens), or there are
#                more prompts than --max-request-sequences
#   n            prompts x n is over --max-request-sequences
#   min_tokens   more than the max_tokens the request ends up with (the rest of the context)
#   best_of      not equal to n
#   stream_options, top_logprobs: only with stream, with logprobs
#   messages     the chat template refuses the conversation
#   response_format, structured_outputs, guided_json, guided_regex, guided_choice,
#   guided_grammar, tools[i].function.parameters: a JSON schema, regular expression or
#                grammar the grammar engine cannot compile, or more than one of them at once
#                (or with a named tool_choice); structured_outputs with no constraint in it,
#                response_format json_schema without its json_schema
#   tool_choice  "auto" (the default with tools) needs --enable-auto-tool-choice; any choice
#                but "none" needs tools; a named function must be among the tools
#   thinking_token_budget: needs a --reasoning-parser whose end of thinking is one token
#   /v1/responses: input (items of a type this server cannot read, or a conversation the
#                template refuses), and its tools, tool_choice, text.format and
#                structured_outputs by chat's rules above
# plus code context_length_exceeded (the prompt and max_tokens do not fit in the context).
# NOTE: the three rules between fields could be written into the schema (if/then), but then
# schemathesis' coverage phase makes one valid request per operation instead of about 120
# (its boundary values), so they stay rules of the handlers, listed here.
STRUCTURED = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
RUNTIME_RULES = {
    "/v1/completions": {"prompt", "n", "min_tokens", "best_of", "stream_options", *STRUCTURED},
    "/v1/chat/completions": {
        "messages",
        "n",
        "min_tokens",
        "stream_options",
        "top_logprobs",
        "tool_choice",
        "thinking_token_budget",
        *STRUCTURED,
    },
    "/tokenize": {"messages"},
    # input: items of a type this server cannot read, or a conversation the template refuses;
    # tool_choice and text.format as chat's tool_choice and response_format.
    "/v1/responses": {"input", "tool_choice", "text.format", "tools", "structured_outputs"},
    # a folder that is not an adapter this model can serve; a name already served
    "/v1/load_lora_adapter": {"lora_path", "lora_name"},
}
# ... and parameters with an index, as regular expressions.
RUNTIME_RULE_PATTERNS = {
    "/v1/chat/completions": [re.compile(r"tools\[\d+\]\.function\.parameters")],
    "/v1/responses": [re.compile(r"tools\[\d+\]\.parameters"), re.compile(r"input\[\d+\].*")],
}


@schemathesis.check
def valid_requests_are_refused_only_by_runtime_rules(ctx, response, case):
    """A schema-valid request answered 400 must be refused by a rule the schema cannot state,
    never for a range or type the schema could have stated (then the schema is wrong)."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return None
    error = json.loads(response.content)["error"]
    path, param = case.operation.path, error["param"]
    if error["code"] == "context_length_exceeded" or param in RUNTIME_RULES.get(path, ()):
        return None
    if param is not None and any(p.fullmatch(param) for p in RUNTIME_RULE_PATTERNS.get(path, ())):
        return None
    raise AssertionError(f"a request that fits the schema was refused for {error['param']!r}: {error['message']}")


@schemathesis.check
def errors_are_openai_shaped(ctx, response, case):
    """Every error, documented status or not (405, ...), has OpenAI's body."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    assert error["type"] == ("invalid_request_error" if response.status_code < 500 else "server_error"), error
    return None
