"""Prompt KV moved between servers for prefill/decode disaggregation, over jax's transfer
server (`jax.experimental.transfer`).

The protocol is vLLM's two-stage one (its proxy, and tpu-inference's): a proxy sends the
request to a prefill server with `max_tokens=1` and `kv_transfer_params:
{"do_remote_decode": true}`; that server runs the prompt, offers the prompt's KV blocks
(`KVHandoff`) on its transfer server and answers with `kv_transfer_params` saying where to
pull them; the proxy sends the original request with those params to a decode server, which
pulls the blocks, writes them into its own prefix cache and decodes.

    prefill: engine.export_prefix -> KVTransfer.offer -> {"remote_address", "transfer_id", ...}
    decode:  read_offer(params) -> (api.disagg: the offer matches the prompt; claim it at its
             source) -> KVTransfer.pull -> engine.add_request(kv_handoff=...) (import_prefix)

- An offer is bound to what it carries: its params name the model, the cache salt and the
  digests of the blocks that travel (scheduler.kv_cache_manager.handoff_digests of the
  prompt). The decode server computes the digests of the prompt it was sent and takes the
  KV only when they are the same; the engine checks them again before writing a block.
- The transfer server listens on one interface (`host`, loopback by default), and a
  transfer id is 63 random bits: a peer must be told it to pull. With a `secret` shared by
  both servers, offers are signed (HMAC-SHA256, over every field) and a decode server takes
  only signed ones; without it, it trusts any well-formed params whose digests match its
  prompt (keep it behind the router).
- An offer holds a copy of its blocks, exactly num_blocks of them (the prefill engine's own
  blocks are free, cached, as soon as the request ends) until it is pulled or
  `offer_timeout` passes. Offers not yet released hold at most `max_offer_bytes` together:
  past that, `offer` raises OfferLimitError.
- Each offer is claimed once, at its source (`claim`, over the prefill server's HTTP side
  channel, api.disagg), before anyone pulls it, and released after the pull.
- NOTE: in jax 0.12 a pull of an offer that is not there (expired, pulled already, or its
  server gone) never returns. So a decode server pulls an id once, only after claiming it,
  only before it expires, and only from a server that accepts a connection; a pull still
  waits in its own thread, for at most `pull_timeout`, and then gives up. Whenever `pull`
  gives up it returns None (the reason counted in `stats.refused`) and the decode server
  computes the prompt itself. A thread left blocked holds no blocks, but makes Python abort
  at exit: `live_pulls` says whether to leave with os._exit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time

import jax
import jax.numpy as jnp

from jaxserve.model.kv_cache import KVCache, KVHandoff

logger = logging.getLogger(__name__)

KV_FIELDS = ("k", "v", "k_scale", "v_scale")
EXPIRY_MARGIN = 2.0  # seconds: an offer is not claimed or pulled this close to its expiry
# Why a decode server computed a prompt itself instead of taking the offered KV.
REFUSAL_REASONS = ("mismatch", "bad_signature", "expired", "replayed", "unknown", "unreachable", "timeout", "failed")
PULL_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class TransferStats:
    offered: int = 0
    offered_bytes: int = 0
    offers_over_limit: int = 0  # prefill calls refused: the pending offers held max_offer_bytes
    pulled: int = 0
    pulled_bytes: int = 0
    failed_pulls: int = 0  # every offer not taken, whatever the reason (refused's sum)
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # reason -> count
    pull_seconds: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(PULL_SECONDS_BUCKETS) + 1))
    pull_seconds_sum: float = 0.0


class OfferLimitError(RuntimeError):
    """The offers not yet pulled hold max_offer_bytes: no more until some are pulled or expire."""


class BadSignature(ValueError):
    """Params not signed with this server's secret."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """A decode server's reading of an offer's kv_transfer_params (read_offer)."""

    address: str  # the prefill server's transfer server
    transfer_id: int
    num_blocks: int
    specs: dict  # array name -> (shape, dtype)
    expires: float  # time.time()
    digests: tuple[str, ...]  # handoff digests of the blocks (scheduler.kv_cache_manager.handoff_digests)
    model: str | None
    cache_salt: str | None
    side_channel: str | None  # the prefill server's kv_transfer URL (api.disagg); None: nowhere to claim it


@dataclasses.dataclass
class _Pending:
    nbytes: int
    expires: float
    claimed: bool = False
    released: bool = False


class KVTransfer:
    """One server's end: offers its prompts' KV (a prefill server) and pulls others' (a decode
    server). `device`: where pulled blocks land (the engine's first device);
    `max_offer_bytes`: the most bytes offers not yet released may hold (None: no limit)."""

    def __init__(
        self,
        device: jax.Device,
        host: str = "127.0.0.1",
        offer_timeout: float = 60.0,
        pull_timeout: float = 30.0,
        secret: str | None = None,
        max_offer_bytes: int | None = None,
    ):
        from jax.experimental import transfer

        self.device = device
        self.secret = secret.encode() if secret else None
        self.max_offer_bytes = max_offer_bytes
        self._offers: dict[int, _Pending] = {}  # this server's offers, until they expire
        self._pulled: dict[int, float] = {}  # transfer id -> its expiry: each is pulled once
        self._pulls: list[threading.Thread] = []
        self.offer_timeout, self.pull_timeout = offer_timeout, pull_timeout
        address = f"[{host}]:0" if ":" in host else f"{host}:0"
        self.server = transfer.start_transfer_server(device.client, address, [address])
        self.address = self.server.address()
        self.stats = TransferStats()
        self._connections: dict[str, object] = {}
        self._lock = threading.RLock()
        logger.info(
            "KV transfer server on %s (offers kept %g s, pulls wait %g s)", self.address, offer_timeout, pull_timeout
        )

    # -- the prefill side -------------------------------------------------------------------

    def offer(self, handoff: KVHandoff, binding: dict | None = None) -> dict:
        """Offer `handoff` for one pull; the kv_transfer_params a decode server needs, with
        `binding` in them (api.disagg: the model's name, where to claim it), all signed. An
        OfferLimitError when the pending offers have no room for it; params that ask for
        nothing when it holds no block."""
        if handoff.num_blocks == 0:  # a prompt shorter than a block: nothing to hand over
            return {"do_remote_prefill": False, "do_remote_decode": False}
        now = time.time()
        with self._lock:
            _, pending = self._prune(now)
            if self.max_offer_bytes is not None and pending + handoff.nbytes > self.max_offer_bytes:
                self.stats.offers_over_limit += 1
                raise OfferLimitError(
                    f"offers not yet pulled hold {pending} bytes of KV; this one ({handoff.nbytes} bytes) would "
                    f"pass the limit of {self.max_offer_bytes} (--kv-offer-memory): retry once decode servers "
                    "have pulled some, or they expire"
                )
            transfer_id = secrets.randbits(63)
            expires = now + self.offer_timeout
            self._offers[transfer_id] = _Pending(handoff.nbytes, expires)
        # One device's copy: the blocks may be split over this engine's devices, and the
        # puller chooses its own placement.
        try:
            kv = jax.device_put(handoff.kv, self.device)
            arrays = {name: getattr(kv, name) for name in KV_FIELDS if getattr(kv, name) is not None}
            timeout = datetime.datetime.fromtimestamp(expires)
            self.server.await_pull(transfer_id, list(arrays.values()), timeout=timeout)
        except BaseException:
            with self._lock:
                self._offers.pop(transfer_id, None)
            raise
        with self._lock:
            self.stats.offered += 1
            self.stats.offered_bytes += handoff.nbytes
        params = {
            **(binding or {}),
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_address": self.address,
            "transfer_id": str(transfer_id),
            "num_blocks": handoff.num_blocks,
            "block_digests": list(handoff.digests),
            "cache_salt": handoff.cache_salt,
            "arrays": {name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()},
            # Integers and strings only: a router may re-serialize the params, and a float's
            # last digit may change on the way (then the signature would not match).
            "expires_at_ms": int(expires * 1000),
            "num_bytes": handoff.nbytes,
        }
        if self.secret is not None:
            params["signature"] = self._sign(params)
        return params

    def claim(self, transfer_id: int) -> str | None:
        """Claim one of this server's offers for the one pull it may have: None when it is
        the caller's now, else why not ("replayed": claimed before; "expired"; "unknown")."""
        now = time.time()
        with self._lock:
            self._prune(now)
            offer = self._offers.get(transfer_id)
            if offer is None:
                return "unknown"
            if offer.claimed:
                return "replayed"
            if now > offer.expires - EXPIRY_MARGIN:  # the pull might arrive after it is gone
                return "expired"
            offer.claimed = True
            return None

    def release(self, transfer_id: int) -> bool:
        """The claimed offer was pulled: its bytes no longer count (jax freed them). Whether it was claimed."""
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None or not offer.claimed:
                return False
            offer.released = True
            return True

    def pending(self) -> tuple[int, int]:
        """(offers, bytes) not yet released nor expired."""
        with self._lock:
            return self._prune(time.time())

    def _prune(self, now: float) -> tuple[int, int]:
        """Forget expired offers (their transfer server dropped them); the pending count and bytes."""
        self._offers = {i: o for i, o in self._offers.items() if o.expires > now}
        held = [o.nbytes for o in self._offers.values() if not o.released]
        return len(held), sum(held)

    def _sign(self, params: dict) -> str:
        fields = {k: v for k, v in params.items() if k != "signature"}
        return hmac.new(self.secret, json.dumps(fields, sort_keys=True).encode(), hashlib.sha256).hexdigest()

    # -- the decode side --------------------------------------------------------------------

    def read_offer(self, params: dict) -> Offer:
        """`params` (an offer's kv_transfer_params) read and checked: a ValueError for params
        that are malformed, a BadSignature (a ValueError) for ones not signed with this
        server's secret."""
        try:
            address, transfer_id = str(params["remote_address"]), int(params["transfer_id"])
            num_blocks = int(params["num_blocks"])
            specs = {
                name: (tuple(int(d) for d in shape), jnp.dtype(dtype))
                for name, (shape, dtype) in params["arrays"].items()
            }
            expires = int(params["expires_at_ms"]) / 1000
            digests = tuple(str(d) for d in params["block_digests"])
            model, salt, side_channel = (params.get(k) for k in ("model", "cache_salt", "kv_transfer_url"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"kv_transfer_params is not an offer of a prefill server: {e!r}") from None
        if set(specs) not in ({"k", "v"}, set(KV_FIELDS)):
            raise ValueError(f"kv_transfer_params.arrays must name k and v (and k_scale, v_scale), got {sorted(specs)}")
        if not all(len(shape) >= 2 and shape[1] == num_blocks for shape, _ in specs.values()):
            raise ValueError(f"kv_transfer_params: {num_blocks} blocks do not fit the arrays {params['arrays']}")
        if self.secret is not None and not hmac.compare_digest(str(params.get("signature", "")), self._sign(params)):
            raise BadSignature("kv_transfer_params is not signed with this server's --kv-transfer-secret")
        return Offer(address, transfer_id, num_blocks, specs, expires, digests, model, salt, side_channel)

    def admit(self, offer: Offer) -> str | None:
        """Whether this server may still pull `offer` (each once, not close to its expiry):
        None when it may (and it is marked pulled), else why not."""
        now = time.time()
        with self._lock:
            self._pulled = {i: t for i, t in self._pulled.items() if t > now}
            if offer.transfer_id in self._pulled:
                return "replayed"
            if now > offer.expires - EXPIRY_MARGIN:  # too close to its expiry: the pull might arrive after it
                return "expired"
            self._pulled[offer.transfer_id] = offer.expires
            return None

    def pull(self, offer: Offer) -> KVHandoff | None:
        """The blocks `offer` points to (admitted, and claimed at its source), or None when
        they cannot be had in time (refuse: logged, counted; the caller computes the prompt)."""
        host, port = offer.address.rsplit(":", 1)
        try:  # a server that is gone refuses the connection; a pull from it would never return
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        except (OSError, ValueError) as e:
            return self.refuse("unreachable", f"the prefill server's transfer address {offer.address} ({e})")
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in offer.specs.values()]
        job = concurrent.futures.Future()
        # A pull that may never return (see the module's note) waits in its own thread.
        thread = threading.Thread(
            target=self._pull,
            args=(offer.address, offer.transfer_id, structs, job),
            daemon=True,
            name=f"kv-pull-{offer.transfer_id}",
        )
        start = time.monotonic()
        thread.start()
        with self._lock:
            self._pulls = [t for t in self._pulls if t.is_alive()] + [thread]
        try:
            arrays = job.result(timeout=self.pull_timeout)
        except concurrent.futures.TimeoutError:
            self._connections.pop(offer.address, None)  # the peer may be gone: connect afresh next time
            return self.refuse("timeout", f"the pull of {offer.transfer_id} took over {self.pull_timeout:g} s")
        except Exception as e:  # the peer is gone, or refused
            self._connections.pop(offer.address, None)
            return self.refuse("failed", f"the pull of {offer.transfer_id} from {offer.address} failed: {e!r}")
        seconds = time.monotonic() - start
        kv = KVCache(**dict(zip(offer.specs, arrays)))
        handoff = KVHandoff(offer.num_blocks, kv, offer.digests, offer.cache_salt)
        with self._lock:
            self.stats.pulled += 1
            self.stats.pulled_bytes += handoff.nbytes
            self.stats.pull_seconds[sum(seconds > b for b in PULL_SECONDS_BUCKETS)] += 1
            self.stats.pull_seconds_sum += seconds
        return handoff

    def refuse(self, reason: str, why: str) -> None:
        """Count an offer not taken (`reason`: one of REFUSAL_REASONS), log why; None."""
        logger.warning("KV transfer refused (%s): %s; computing the prompt here instead", reason, why)
        self.count_refusal(reason)
        return None

    def count_refusal(self, reason: str) -> None:
        with self._lock:
            self.stats.failed_pulls += 1
            self.stats.refused[reason] += 1

    @property
    def live_pulls(self) -> int:
        """Pull threads still running: pulls in flight, and pulls given up on that are still
        blocked (see the module's note)."""
        with self._lock:
            return sum(t.is_alive() for t in self._pulls)

    def _pull(self, address: str, transfer_id: int, structs: list, job: concurrent.futures.Future) -> None:
        try:
            connection = self._connections.get(address)
            if connection is None:  # not under the lock: connecting to a dead peer may block
                connection = self._connections[address] = self.server.connect(address)
            job.set_result(jax.block_until_ready(connection.pull(transfer_id, structs)))
        except Exception as e:
            job.set_exception(e)
