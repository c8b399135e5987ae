"""A model's `generation_config.json`: extra end-of-sequence ids and default sampling values.

As vLLM's `--generation-config`: `auto` reads the model folder's file, and its sampling
values (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) become the
defaults of requests that leave them unset; `vllm` ignores those values; a folder path
reads that folder's file instead. Its `eos_token_id` (one id or a list) always joins
config.json's, since it says where the model's text ends, not how to sample it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams fields


def read_generation_config(model_source: str | Path, mode: str = "auto") -> GenerationDefaults:
    """The defaults for a model loaded from `model_source` (a folder or a .gguf file)."""
    if mode not in ("auto", "vllm"):
        folder = Path(mode)
        if not (folder / "generation_config.json").is_file():
            raise FileNotFoundError(f"--generation-config {mode!r}: no generation_config.json there")
    else:
        folder = Path(model_source)
    path = folder / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    with open(path) as f:
        raw = json.load(f)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    sampling = (
        {}
        if mode == "vllm"
        else {ours: raw[theirs] for theirs, ours in SAMPLING_FIELDS.items() if raw.get(theirs) is not None}
    )
    if sampling:
        logger.info("default sampling parameters from %s: %s (--generation-config vllm ignores them)", path, sampling)
    return GenerationDefaults(eos_ids, sampling)
