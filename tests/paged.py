"""A minimal stand-in for the scheduler in model tests: scrambled block tables and
`ModelInputs` for steps in which each sequence runs a given slice of its tokens."""

from __future__ import annotations

import numpy as np

from jaxserve.model.inputs import ModelInputs


class PagedSequences:
    def __init__(self, lengths: list[int], block_size: int, num_blocks: int, seed: int = 0):
        need = [-(-n // block_size) for n in lengths]
        rng = np.random.default_rng(seed)
        free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0 is the null block
        assert sum(need) <= len(free), "test pool too small"
        self.block_size = block_size
        self.tables = np.zeros((len(lengths), max(need)), np.int32)
        for s, n in enumerate(need):
            self.tables[s, :n] = [free.pop() for _ in range(n)]

    def step(
        self,
        tokens: list[list[int]],
        spans: list[tuple[int, int]],
        pad_to: int | None = None,
        all_logits: bool = False,
        sequences: list[int] | None = None,
    ) -> ModelInputs:
        """Inputs for one step: row i runs tokens[i][start:end] for (start, end) = spans[i], as
        sequence sequences[i] (default i: its block table's row).

        Logits are taken at each sequence's last new token, or at every token.
        """
        sequences = list(range(len(spans))) if sequences is None else sequences
        ids, pos, slots, qsl, logits_at = [], [], [], [0], []
        for i, (start, end) in enumerate(spans):
            p = np.arange(start, end)
            table = self.tables[sequences[i]]
            ids += tokens[i][start:end]
            pos += list(p)
            slots += list(table[p // self.block_size] * self.block_size + p % self.block_size)
            logits_at += list(range(qsl[-1], qsl[-1] + end - start)) if all_logits else [qsl[-1] + end - start - 1]
            qsl.append(qsl[-1] + end - start)
        pad = (pad_to or len(ids)) - len(ids)
        return ModelInputs.from_numpy(
            input_ids=ids + [0] * pad,
            positions=pos + [0] * pad,
            slot_mapping=slots + [0] * pad,
            query_start_loc=qsl,
            seq_lens=[end for _, end in spans],
            block_tables=self.tables[sequences],
            logits_indices=logits_at,
        )
