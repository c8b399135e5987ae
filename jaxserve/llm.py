"""Offline batch generation: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.engine import LLMEngine
from jaxserve.outputs import RequestOutput
from scheduler import SamplingParams


class LLM:
    """Runs lists of prompts through continuous batching.

    `LLM()` is the embedded default model; `model` takes a Hugging Face folder, a GGUF
    file or a hub id. `quantization` is "int4", "fp8" or "gguf" (None: as the checkpoint
    is). Other keyword arguments are `EngineConfig` fields (max_num_seqs, kv_cache_dtype, ...).
    """

    def __init__(self, model: str | None = None, *, dtype="float32", cache_dir=None, quantization: str | None = None,
                 **engine_kwargs):
        self.engine = LLMEngine.from_model(model, dtype=dtype, cache_dir=cache_dir, quantization=quantization,
                                           **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. One SamplingParams for all, or one per prompt;
        None: the model's defaults (its generation config, else SamplingParams())."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.engine.default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(f"llm-{self._counter}")
            self._counter += 1
            self.engine.add_request(ids[-1], prompt, p)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
