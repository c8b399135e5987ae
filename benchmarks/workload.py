"""The fixed synthetic workload shared by the offline benchmarks."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def synthetic_workload(
    num_requests: int = 128,
    prompt_range=(32, 512),
    output_range=(16, 256),
    seed: int = 0,
    vocab: tuple[int, int] = (100, 49000),
) -> Workload:
    """Random token prompts and output lengths, uniform in the given ranges (inclusive)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    prompts = [rng.integers(*vocab, n).tolist() for n in prompt_lens]
    return Workload(prompts, [int(n) for n in output_lens])


# name: (prompt token range, output token range), inclusive; every request fits in 1024 tokens.
MIXES = {
    "default": ((32, 512), (16, 256)),
    "short-long": ((16, 64), (256, 512)),  # chat-like: decode-bound
    "long-short": ((512, 896), (8, 32)),  # summarization-like: prefill-bound
    "chat": ((8, 96), (64, 384)),  # held out from the mixes the engine was tuned on (issue 39's review)
}


def mix_workload(mix: str, num_requests: int = 128, seed: int = 0) -> Workload:
    """`synthetic_workload` with the prompt and output ranges of one of MIXES."""
    prompt_range, output_range = MIXES[mix]
    return synthetic_workload(num_requests, prompt_range, output_range, seed)
