"""`--speculative-config`: vLLM's JSON keys, validated when the config is made."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How to propose draft tokens, and how many per step.

    - `ngram`: prompt lookup in the request's own tokens: the longest suffix of
      `prompt_lookup_min`..`prompt_lookup_max` tokens that occurred before proposes what
      followed it then.
    - `draft_model`: a smaller model with the same tokenizer runs ahead. `model` is its
      folder, GGUF file or hub id (None: the target itself); `draft_num_layers` keeps only
      its first layers (a layer-truncated self-draft uses the target's embeddings and LM head).

    No speculation while more than `disable_by_batch_size` sequences run (None: always):
    a large batch is compute-bound, and verifying drafts there costs more than it saves.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        checks = [
            (self.method in METHODS, f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
             f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens!r}"),
            (_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
             f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min!r}"),
            (_is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
             f"prompt_lookup_max must be >= prompt_lookup_min, got {self.prompt_lookup_max!r}"),
            (self.draft_num_layers is None or (_is_int(self.draft_num_layers) and self.draft_num_layers >= 1),
             f"draft_num_layers must be >= 1, got {self.draft_num_layers!r}"),
            (self.disable_by_batch_size is None or (_is_int(self.disable_by_batch_size)
                                                     and self.disable_by_batch_size >= 1),
             f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size!r}"),
            (self.method == "draft_model" or (self.model is None and self.draft_num_layers is None),
             "model and draft_num_layers are for method draft_model"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a dict or its JSON text (the CLI flag); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"the speculative config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError(f"the speculative config needs a method ({', '.join(METHODS)})")
        return cls(**value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
