"""KV blocks moved by jax's transfer server (jaxserve.parallel.kv_transfer), between two transfer
servers of this process on different CPU devices: what is pulled equals what was offered,
exactly the offered blocks (no padding); an offer pulled already, expired or on a server that
does not answer gives None at once (a pull of it would never return); each offer is claimed
once at its source; offers not yet pulled are capped in bytes; unsigned or forged params are
refused. (Between real servers, a killed one included: tests/api/test_disagg.py.)"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.kv_cache import KVCache, KVHandoff
from jaxserve.parallel.kv_transfer import BadSignature, KVTransfer, OfferLimitError

DIGESTS = ("aa", "bb", "cc")


def handoff(quantized: bool) -> KVHandoff:
    rng = np.random.default_rng(0)
    pages = [jnp.asarray(rng.standard_normal((2, 3, 8, 2, 16)), jnp.bfloat16) for _ in range(2)]
    if not quantized:
        return KVHandoff(3, KVCache(*pages), DIGESTS, "salt")
    scales = [jnp.asarray(rng.random((2, 3, 2, 8)), jnp.float32) for _ in range(2)]
    return KVHandoff(3, KVCache(*(p.astype(jnp.int8) for p in pages), *scales), DIGESTS, "salt")


@pytest.fixture(scope="module")
def ends():
    devices = jax.devices()
    return (
        KVTransfer(devices[0], pull_timeout=2, secret="shared"),
        KVTransfer(devices[1], pull_timeout=2, secret="shared"),
    )


def take(decode: KVTransfer, params: dict):
    offer = decode.read_offer(params)
    reason = decode.admit(offer)
    return decode.refuse(reason, "test") if reason else decode.pull(offer)


@pytest.mark.parametrize("quantized", [False, True])
def test_pulled_blocks_equal_the_offered_ones_and_nothing_more(ends, quantized):
    prefill, decode = ends
    sent = handoff(quantized)
    params = prefill.offer(sent, {"model": "m"})
    shapes = [(tuple(shape), np.dtype(dtype)) for shape, dtype in params["arrays"].values()]
    assert all(shape[1] == 3 for shape, _ in shapes)
    assert params["num_bytes"] == sent.nbytes == sum(np.prod(s) * d.itemsize for s, d in shapes)
    assert params["block_digests"] == list(DIGESTS) and params["cache_salt"] == "salt" and params["model"] == "m"
    pulled_bytes = decode.stats.pulled_bytes
    got = take(decode, params)
    assert got.num_blocks == 3 and got.kv.k.devices() == {jax.devices()[1]}
    assert got.digests == DIGESTS and got.cache_salt == "salt"
    assert decode.stats.pulled_bytes - pulled_bytes == sent.nbytes
    for a, b in zip(jax.tree.leaves(sent.kv), jax.tree.leaves(got.kv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def signed(transfer: KVTransfer, params: dict) -> dict:
    return {**params, "signature": transfer._sign(params)}


def test_what_cannot_be_pulled_gives_none_at_once(ends):
    prefill, decode = ends
    params = prefill.offer(handoff(False))
    assert take(decode, params) is not None
    refused = dict(decode.stats.refused)
    start = time.monotonic()
    assert take(decode, params) is None  # pulled already
    soon = int((time.time() + 1) * 1000)
    assert take(decode, signed(prefill, {**prefill.offer(handoff(False)), "expires_at_ms": soon})) is None
    assert take(decode, signed(prefill, {**prefill.offer(handoff(False)), "remote_address": "127.0.0.1:1"})) is None
    assert time.monotonic() - start < decode.pull_timeout  # none was tried
    counts = {r: decode.stats.refused[r] - refused.get(r, 0) for r in ("replayed", "expired", "unreachable")}
    assert counts == {"replayed": 1, "expired": 1, "unreachable": 1} and decode.live_pulls == 0


def test_each_offer_is_claimed_once_at_its_source(ends):
    prefill, _ = ends
    transfer_id = int(prefill.offer(handoff(False))["transfer_id"])
    assert prefill.claim(transfer_id) is None
    assert prefill.claim(transfer_id) == "replayed"
    assert prefill.claim(12345) == "unknown"
    count, nbytes = prefill.pending()
    assert prefill.release(transfer_id) and prefill.pending() == (count - 1, nbytes - handoff(False).nbytes)


def test_offers_not_yet_pulled_are_capped_in_bytes():
    one = handoff(False).nbytes
    transfer = KVTransfer(jax.devices()[0], offer_timeout=3, max_offer_bytes=2 * one)
    first = int(transfer.offer(handoff(False))["transfer_id"])
    transfer.offer(handoff(False))
    with pytest.raises(OfferLimitError, match="--kv-offer-memory"):
        transfer.offer(handoff(False))
    assert transfer.stats.offers_over_limit == 1 and transfer.pending() == (2, 2 * one)
    assert transfer.claim(first) is None and transfer.release(first)  # pulled: room for one more
    transfer.offer(handoff(False))
    time.sleep(3.1)  # all expired: room for two
    assert transfer.pending() == (0, 0)
    transfer.offer(handoff(False))
    transfer.offer(handoff(False))


def test_unsigned_forged_or_malformed_params_are_a_value_error(ends):
    prefill, decode = ends
    params = prefill.offer(handoff(False), {"model": "m"})
    for forged in (
        {"transfer_id": "12345"},
        {"block_digests": ["dd", "ee", "ff"]},
        {"model": "n"},
        {"cache_salt": None},
    ):
        with pytest.raises(BadSignature, match="not signed"):
            decode.read_offer({**params, **forged})
    with pytest.raises(BadSignature, match="not signed"):
        decode.read_offer({k: v for k, v in params.items() if k != "signature"})
    with pytest.raises(ValueError, match="do not fit"):
        decode.read_offer(signed(prefill, {**params, "num_blocks": 2}))
    with pytest.raises(ValueError, match="not an offer"):
        decode.read_offer({"do_remote_prefill": True})
    with pytest.raises(ValueError, match="must name k and v"):
        decode.read_offer(
            {
                "remote_address": "x",
                "transfer_id": "1",
                "num_blocks": 1,
                "expires_at_ms": 0,
                "block_digests": [],
                "arrays": {"q": [[1], "float32"]},
            }
        )


def test_a_handoff_of_no_block_offers_nothing(ends):
    prefill, _ = ends
    empty = KVHandoff(0, jax.tree.map(lambda x: x[:, :0], handoff(False).kv))
    assert prefill.offer(empty) == {"do_remote_prefill": False, "do_remote_decode": False}
