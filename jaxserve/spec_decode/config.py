"""`--speculative-config`: vLLM's JSON keys, validated when the config is made."""

from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any

from scheduler.draft_tree import DraftTree

METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3")
HEAD_METHODS = ("medusa", "eagle")  # heads trained by python -m jaxserve.train_draft


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How to propose draft tokens, and how many per step.

    - `ngram`: prompt lookup in the request's own tokens: the longest suffix of
      `prompt_lookup_min`..`prompt_lookup_max` tokens that occurred before proposes what
      followed it then.
    - `draft_model`: a smaller model with the same tokenizer runs ahead. `model` is its
      folder, GGUF file or hub id (None: the target itself); `draft_num_layers` keeps only
      its first layers (a layer-truncated self-draft uses the target's embeddings and LM head).
    - `medusa`: heads on the target's last hidden state, one per draft position
      (`model`: the folder `python -m jaxserve.train_draft --method medusa` saved, or
      published Medusa-1 heads: a FasterDecoding folder or hub repository).
    - `eagle`: a one-layer head on the target's hidden states and the next tokens
      (`model`: the folder `python -m jaxserve.train_draft --method eagle` saved, or
      published EAGLE-1 heads: a SafeAILab folder or hub repository), run
      autoregressively for a chain of drafts.
    - `eagle3`: EAGLE-3's head on the inputs of three target layers, with its own LM head
      over a draft vocabulary (`model`: published EAGLE-3 heads, a folder or hub repository
      in the authors' or the speculators' layout), run as `eagle`'s.

    `speculative_token_tree` (vLLM's key: a list of paths of child ranks, or its text,
    e.g. "[(0,), (1,), (0, 0)]") shapes each step's drafts as a tree of candidates,
    verified in one step under tree attention (see scheduler.draft_tree);
    num_speculative_tokens is then its depth.

    No speculation while more than `disable_by_batch_size` sequences run (None: always):
    a large batch is compute-bound, and verifying drafts there costs more than it saves.
    With `disable_by_measured_cost` (the default; for ngram, whose steps without drafts
    stay overlapped) the engine times its own decode steps and verifies drafts only where
    the tokens they are expected to add pay for the longer step (spec_decode.step_costs).

    Adaptive draft length (chains, opt-in): with a `draft_token_cost`, what one more draft
    token costs in plain decoding steps (about 0.15 on the CPU at batch 1: a 5-token verify
    step took 1.58 times a 1-token one), each request verifies only as many drafts as pay
    off by its own acceptance so far (scheduler.spec_stats.DraftLength), none where they
    are mostly rejected. None (the default): always num_speculative_tokens.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None
    disable_by_batch_size: int | None = None
    disable_by_measured_cost: bool = True
    draft_token_cost: float | None = None
    speculative_token_tree: Any = None

    def __post_init__(self):
        checks = [
            (self.method in METHODS, f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (
                _is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens!r}",
            ),
            (
                _is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
                f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min!r}",
            ),
            (
                _is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
                f"prompt_lookup_max must be >= prompt_lookup_min, got {self.prompt_lookup_max!r}",
            ),
            (
                self.draft_num_layers is None or (_is_int(self.draft_num_layers) and self.draft_num_layers >= 1),
                f"draft_num_layers must be >= 1, got {self.draft_num_layers!r}",
            ),
            (
                self.disable_by_batch_size is None
                or (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size!r}",
            ),
            (
                isinstance(self.disable_by_measured_cost, bool),
                f"disable_by_measured_cost must be true or false, got {self.disable_by_measured_cost!r}",
            ),
            (
                self.draft_token_cost is None
                or (isinstance(self.draft_token_cost, (int, float)) and 0 <= self.draft_token_cost <= 10),
                f"draft_token_cost must be a number in [0, 10] or null, got {self.draft_token_cost!r}",
            ),
            (
                self.method == "draft_model" or self.draft_num_layers is None,
                "draft_num_layers is for method draft_model",
            ),
            (self.method != "ngram" or self.model is None, "method ngram takes no model"),
            (
                self.method not in HEAD_METHODS or self.model is not None,
                f"method {self.method} needs model: the folder python -m jaxserve.train_draft --method {self.method} "
                "wrote, or published heads (Medusa-1, EAGLE-1)",
            ),
            (self.method != "eagle3" or self.model is not None, "method eagle3 needs model: published EAGLE-3 heads"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.speculative_token_tree is not None:
            tree = self.tree
            if tree.max_depth != self.num_speculative_tokens:
                raise ValueError(
                    f"num_speculative_tokens ({self.num_speculative_tokens}) must be the depth of "
                    f"speculative_token_tree ({tree.max_depth})"
                )
            if not tree.is_chain and self.method != "medusa":
                raise ValueError(
                    f"speculative_token_tree needs a proposer of candidate trees (medusa); method "
                    f"{self.method!r} proposes one chain"
                )

    @property
    def tree(self) -> DraftTree | None:
        """The drafts' tree (None: a chain of num_speculative_tokens)."""
        return None if self.speculative_token_tree is None else _tree(self.speculative_token_tree)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens verified per step: the tree's nodes, or the chain's length."""
        tree = self.tree
        return tree.num_nodes if tree is not None else self.num_speculative_tokens

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
            raise ValueError(
                f"unknown speculative config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "method" not in value:
            raise ValueError(f"the speculative config needs a method ({', '.join(METHODS)})")
        if value.get("speculative_token_tree") is not None and "num_speculative_tokens" not in value:
            value = {**value, "num_speculative_tokens": _tree(value["speculative_token_tree"]).max_depth}
        return cls(**value)


def _tree(choices) -> DraftTree:
    """A speculative_token_tree value (a list of paths, or its text as vLLM takes it)."""
    parsed = choices
    if isinstance(choices, str):
        try:
            parsed = ast.literal_eval(choices)
        except (ValueError, SyntaxError):
            parsed = None
    if not isinstance(parsed, (list, tuple)):
        raise ValueError(f"speculative_token_tree is not a list of paths: {choices!r}")
    return DraftTree.from_choices(parsed)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
