"""KV blocks moved by jax's transfer server (jaxserve.parallel.kv_transfer), between two transfer
servers of this process on different CPU devices: what is pulled equals what was offered;
an offer pulled already, expired or on a server that does not answer gives None at once
(a pull of it would never return); unsigned or forged params are refused. (Between real
servers, a killed one included: tests/api/test_disagg.py.)"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.kv_cache import KVCache, KVHandoff
from jaxserve.parallel.kv_transfer import KVTransfer


def handoff(quantized: bool) -> KVHandoff:
    rng = np.random.default_rng(0)
    pages = [jnp.asarray(rng.standard_normal((2, 4, 8, 2, 16)), jnp.bfloat16) for _ in range(2)]
    if not quantized:
        return KVHandoff(3, KVCache(*pages))
    scales = [jnp.asarray(rng.random((2, 4, 2, 8)), jnp.float32) for _ in range(2)]
    return KVHandoff(3, KVCache(*(p.astype(jnp.int8) for p in pages), *scales))


@pytest.fixture(scope="module")
def ends():
    devices = jax.devices()
    return (
        KVTransfer(devices[0], pull_timeout=2, secret="shared"),
        KVTransfer(devices[1], pull_timeout=2, secret="shared"),
    )


@pytest.mark.parametrize("quantized", [False, True])
def test_pulled_blocks_equal_the_offered_ones(ends, quantized):
    prefill, decode = ends
    sent = handoff(quantized)
    params = prefill.offer(sent)
    assert params["do_remote_prefill"] and params["num_bytes"] == sent.nbytes
    got = decode.pull(params)
    assert got.num_blocks == 3 and got.kv.k.devices() == {jax.devices()[1]}
    for a, b in zip(jax.tree.leaves(sent.kv), jax.tree.leaves(got.kv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def signed(transfer: KVTransfer, params: dict) -> dict:
    return {**params, "signature": transfer._sign(params)}


def test_what_cannot_be_pulled_gives_none_at_once(ends):
    prefill, decode = ends
    params = prefill.offer(handoff(False))
    assert decode.pull(params) is not None
    failed = decode.stats.failed_pulls
    start = time.monotonic()
    assert decode.pull(params) is None  # pulled already
    assert decode.pull(signed(prefill, {**prefill.offer(handoff(False)), "expires_at": time.time() + 1})) is None
    assert decode.pull(signed(prefill, {**prefill.offer(handoff(False)), "remote_address": "127.0.0.1:1"})) is None
    assert time.monotonic() - start < decode.pull_timeout  # none was tried
    assert decode.stats.failed_pulls == failed + 3 and decode.hung_pulls == 0


def test_unsigned_forged_or_malformed_params_are_a_value_error(ends):
    prefill, decode = ends
    params = prefill.offer(handoff(False))
    with pytest.raises(ValueError, match="not signed"):
        decode.pull({**params, "transfer_id": "12345"})
    with pytest.raises(ValueError, match="not signed"):
        decode.pull({k: v for k, v in params.items() if k != "signature"})
    with pytest.raises(ValueError, match="do not fit"):
        decode.pull(signed(prefill, {**params, "num_blocks": 9}))
    with pytest.raises(ValueError, match="not an offer"):
        decode.pull({"do_remote_prefill": True})
    with pytest.raises(ValueError, match="must name k and v"):
        decode.pull(
            {
                "remote_address": "x",
                "transfer_id": "1",
                "num_blocks": 1,
                "expires_at": 0,
                "arrays": {"q": [[1], "float32"]},
            }
        )
