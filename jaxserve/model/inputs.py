"""What one jitted model step reads: the device copy of a padded `StepBatch`."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelInputs:
    """Ragged, flattened batch (see DESIGN.md, "One engine step"); T and S are buckets.

    Padding tokens have slot 0 (the null block) and belong to no sequence; padding
    sequences have no new tokens and a context length of 0.
    """

    input_ids: jax.Array  # int32 [T]
    positions: jax.Array  # int32 [T]
    slot_mapping: jax.Array  # int32 [T]: block_id * block_size + offset
    query_start_loc: jax.Array  # int32 [S + 1]
    seq_lens: jax.Array  # int32 [S]: context length after this step
    block_tables: jax.Array  # int32 [S, max_blocks]
    logits_indices: jax.Array  # int32 [S]: flat index of the token whose logits we want
    tree_mask: jax.Array | None = None  # int32 [T, W]: speculating with a tree (see StepBatch.tree_mask)
    lora_slots: jax.Array | None = None  # int32 [T]: each token's LoRA slot (0: none); only with LoRA on

    @classmethod
    def from_numpy(cls, **arrays: np.ndarray) -> ModelInputs:
        return cls(**{k: np.asarray(v, np.int32) for k, v in arrays.items()})
