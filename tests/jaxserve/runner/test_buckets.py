"""The sizes steps are padded to: a decode step of n sequences computes at most 7 padding
rows above 8 (vLLM's CUDA graph sizes), and every size up to the limit has a bucket."""

import pytest

from jaxserve.runner.model_runner import ROW_STEP, padded_sizes, token_buckets


@pytest.mark.parametrize("max_num_seqs", [1, 5, 8, 20, 32, 64, 100])
def test_decode_steps_pad_by_less_than_a_row_step(max_num_seqs):
    buckets = token_buckets(512, max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[-1] == 512
    for n in range(1, max_num_seqs + 1):
        padded = next(b for b in buckets if b >= n)
        assert padded - n < (ROW_STEP if n > ROW_STEP else n), (n, padded)


def test_sizes_beyond_the_sequences_double():
    assert token_buckets(512, 64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512]
    assert token_buckets(512, 20) == [1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 512]
    assert padded_sizes(20, 20) == [1, 2, 4, 8, 16, 20]  # the row buckets end at max_num_seqs
    assert token_buckets(6, 64) == [1, 2, 4, 6]
