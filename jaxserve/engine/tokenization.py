"""Prompts to token ids, the one way the engine, the API and the CLI all use.

As in Hugging Face and vLLM: a text prompt gets the tokenizer's own special tokens (a
Llama 3 or Mistral tokenizer adds its BOS), unless `add_special_tokens=False`. A chat is
rendered by the model's chat template, which writes any BOS itself, so its text is encoded
without special tokens (no double BOS). Templates render in transformers' sandboxed Jinja
environment; nothing here renders a template any other way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class PromptError(ValueError):
    """The prompt cannot be used (no tokenizer, ids out of range, a template that fails)."""


def encode_prompt(tokenizer, prompt: str | list[int], vocab_size: int, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt, or a token-id prompt checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("this model has no tokenizer: give the prompt as token ids")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise PromptError("a prompt is a string or a list of token ids")
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise PromptError(f"prompt token ids must be in [0, {vocab_size})")
    return list(prompt)


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_vars: dict[str, Any] | None = None,
    **template_kwargs,
) -> str:
    """The conversation as text, by the model's chat template (transformers' sandboxed Jinja).

    `template_kwargs` are apply_chat_template's (chat_template, continue_final_message, ...);
    `template_vars` are variables for the template alone (vLLM's chat_template_kwargs, e.g.
    enable_thinking): a caller keeps apply_chat_template's own names out of them.
    """
    if tokenizer is None or not (template_kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)):
        raise PromptError("this model has no chat template")
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
            **(template_vars or {}),
        )
    except Exception as e:  # the template rejects the conversation, or the sandbox refused an operation
        raise PromptError(f"the chat template could not render these messages: {e}") from None


def encode_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    vocab_size: int,
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    template_vars: dict[str, Any] | None = None,
    **template_kwargs,
) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids (the template decides BOS by default)."""
    text = render_chat(
        tokenizer, messages, add_generation_prompt=add_generation_prompt, template_vars=template_vars, **template_kwargs
    )
    return text, encode_prompt(tokenizer, text, vocab_size, add_special_tokens=add_special_tokens)


def read_chat_template(value: str) -> str:
    """A chat template given as a file path or as the template text itself (vLLM's --chat-template)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if not any(c in value for c in "{}\n"):  # no Jinja in it: a path that is not there
        raise FileNotFoundError(f"chat template file {value!r} not found (or give the template text itself)")
    return value
