"""Offline batch generation: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.tokenization import encode_chat
from jaxserve.lora.request import LoRARequest
from scheduler import SamplingParams


class LLM:
    """Runs lists of prompts through continuous batching.

    `LLM()` is the embedded default model; `model` takes a Hugging Face folder, a GGUF
    file or a hub id. `quantization` is "int4", "int8", "fp8" or "gguf" (None: as the checkpoint
    is). `dtype` "auto": the checkpoint's on a GPU, float32 on the CPU. `tokenizer`: a
    folder whose tokenizer.json replaces the model's (weights without one). Other keyword
    arguments are `EngineConfig` fields (max_num_seqs, kv_cache_dtype, gpu_memory_utilization, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype="auto",
        cache_dir=None,
        quantization: str | None = None,
        tokenizer: str | None = None,
        **engine_kwargs,
    ):
        self.engine = LLMEngine.from_model(
            model, dtype=dtype, cache_dir=cache_dir, quantization=quantization, tokenizer=tokenizer, **engine_kwargs
        )
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. One SamplingParams for all, or one per prompt;
        None: the model's defaults (its generation config, else SamplingParams()).
        `lora_request`: one LoRA adapter for all prompts, or one (or None) per prompt (vLLM's).

        A prompt is text, a list of token ids, or as in vLLM `{"prompt_token_ids": [...]}`
        or `{"prompt": "text"}`; one list may mix them."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts]
        params = sampling_params or self.engine.default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} lora requests")
        for p in params:  # all grammars compile at once, in the background
            if p.structured_outputs is not None:
                self.engine.compile_grammar(p.structured_outputs)
        ids = []
        for prompt, p, lora in zip(prompts, params, loras):
            ids.append(f"llm-{self._counter}")
            self._counter += 1
            self.engine.add_request(ids[-1], prompt, p, lora_request=lora)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a
        list of them, each rendered by the chat template (`chat_template` instead of the
        model's) and generated as `generate` does; one output per conversation."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template_kwargs: dict[str, Any] = {"continue_final_message": continue_final_message}
        if chat_template is not None:
            template_kwargs["chat_template"] = chat_template
        if tools is not None:
            template_kwargs["tools"] = tools
        vocab = self.engine.loaded.config.vocab_size
        prompts = [
            encode_chat(
                self.tokenizer,
                list(conversation),
                vocab,
                add_generation_prompt=add_generation_prompt,
                template_vars=chat_template_kwargs,
                **template_kwargs,
            )[1]
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _prompt_of(prompt: str | list[int] | dict) -> str | list[int]:
    """A prompt as the engine takes it: text or token ids (vLLM's prompt dicts unwrapped)."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    raise ValueError(
        f'a prompt dict holds "prompt_token_ids" (token ids) or "prompt" (text), nothing else; '
        f"got the keys {sorted(prompt)}"
    )
