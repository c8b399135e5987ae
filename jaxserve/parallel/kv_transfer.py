"""Prompt KV moved between servers for prefill/decode disaggregation, over jax's transfer
server (`jax.experimental.transfer`).

The protocol is vLLM's two-stage one (its proxy, and tpu-inference's): a proxy sends the
request to a prefill server with `max_tokens=1` and `kv_transfer_params:
{"do_remote_decode": true}`; that server runs the prompt, offers the prompt's KV blocks
(`KVHandoff`) on its transfer server and answers with `kv_transfer_params` saying where to
pull them; the proxy sends the original request with those params to a decode server, which
pulls the blocks, writes them into its own prefix cache and decodes.

    prefill: engine.export_prefix -> KVTransfer.offer -> {"remote_address", "transfer_id", ...}
    decode:  KVTransfer.pull(params) -> engine.add_request(kv_handoff=...) (import_prefix)

- The transfer server listens on one interface (`host`, loopback by default), and a
  transfer id is 63 random bits: a peer must be told it to pull. With a `secret` shared by
  both servers, offers are signed (HMAC-SHA256) and a decode server pulls only signed ones;
  without it, it trusts any kv_transfer_params it is sent (keep it behind the proxy).
- An offer holds a copy of the blocks (the prefill engine's own blocks are free, cached,
  as soon as the request ends) until it is pulled or `offer_timeout` passes.
- NOTE: in jax 0.12 a pull of an offer that is not there (expired, pulled already, or its
  server gone) never returns. So a decode server pulls an id once, only before it expires,
  and only from a server that accepts a connection; a pull still waits in its own thread,
  for at most `pull_timeout`, and then gives up. Whenever `pull` gives up it returns None
  and the decode server computes the prompt itself. A thread left blocked holds no blocks,
  but makes Python abort at exit: `hung_pulls` says whether to leave with os._exit.
"""

from __future__ import annotations

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
EXPIRY_MARGIN = 2.0  # seconds: an offer is not pulled this close to its expiry


@dataclasses.dataclass
class TransferStats:
    offered: int = 0
    offered_bytes: int = 0
    pulled: int = 0
    pulled_bytes: int = 0
    failed_pulls: int = 0


class KVTransfer:
    """One server's end: offers its prompts' KV (a prefill server) and pulls others' (a decode
    server). `device`: where pulled blocks land (the engine's first device)."""

    def __init__(
        self,
        device: jax.Device,
        host: str = "127.0.0.1",
        offer_timeout: float = 60.0,
        pull_timeout: float = 30.0,
        secret: str | None = None,
    ):
        from jax.experimental import transfer

        self.device = device
        self.secret = secret.encode() if secret else None
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

    def offer(self, handoff: KVHandoff) -> dict:
        """Offer `handoff` for one pull; the kv_transfer_params a decode server needs."""
        # One device's copy: the blocks may be split over this engine's devices, and the
        # puller chooses its own placement.
        kv = jax.device_put(handoff.kv, self.device)
        arrays = {name: getattr(kv, name) for name in KV_FIELDS if getattr(kv, name) is not None}
        transfer_id = secrets.randbits(63)
        expires = time.time() + self.offer_timeout
        self.server.await_pull(transfer_id, list(arrays.values()), timeout=datetime.datetime.fromtimestamp(expires))
        with self._lock:
            self.stats.offered += 1
            self.stats.offered_bytes += handoff.nbytes
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_address": self.address,
            "transfer_id": str(transfer_id),
            "num_blocks": handoff.num_blocks,
            "arrays": {name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()},
            "expires_at": expires,
            "num_bytes": handoff.nbytes,
        }
        if self.secret is not None:
            params["signature"] = self._sign(params)
        return params

    def _sign(self, params: dict) -> str:
        fields = {k: v for k, v in params.items() if k != "signature"}
        return hmac.new(self.secret, json.dumps(fields, sort_keys=True).encode(), hashlib.sha256).hexdigest()

    def pull(self, params: dict) -> KVHandoff | None:
        """The blocks `params` (an offer's kv_transfer_params) point to, or None when they
        cannot be had in time (logged; the caller computes the prompt itself). A ValueError
        for params that are malformed."""
        try:
            address, transfer_id = str(params["remote_address"]), int(params["transfer_id"])
            num_blocks = int(params["num_blocks"])
            specs = {
                name: (tuple(int(d) for d in shape), jnp.dtype(dtype))
                for name, (shape, dtype) in params["arrays"].items()
            }
            expires = float(params["expires_at"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"kv_transfer_params is not an offer of a prefill server: {e!r}") from None
        if set(specs) not in ({"k", "v"}, set(KV_FIELDS)):
            raise ValueError(f"kv_transfer_params.arrays must name k and v (and k_scale, v_scale), got {sorted(specs)}")
        if not all(len(shape) >= 2 and 0 <= num_blocks <= shape[1] for shape, _ in specs.values()):
            raise ValueError(f"kv_transfer_params: {num_blocks} blocks do not fit the arrays {params['arrays']}")
        if self.secret is not None and not hmac.compare_digest(str(params.get("signature", "")), self._sign(params)):
            raise ValueError("kv_transfer_params is not signed with this server's --kv-transfer-secret")
        now = time.time()
        with self._lock:
            self._pulled = {i: t for i, t in self._pulled.items() if t > now}
            if transfer_id in self._pulled:
                return self._failed(f"the offer {transfer_id} was pulled already")
            if now > expires - EXPIRY_MARGIN:  # too close to its expiry: the pull might arrive after it
                return self._failed(f"the offer {transfer_id} expired")
            self._pulled[transfer_id] = expires
        host, port = address.rsplit(":", 1)
        try:  # a server that is gone refuses the connection; a pull from it would never return
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        except (OSError, ValueError) as e:
            return self._failed(f"the prefill server's transfer address {address} does not answer ({e})")
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in specs.values()]
        job = concurrent.futures.Future()
        # A pull that may never return (see the module's note) waits in its own thread.
        thread = threading.Thread(
            target=self._pull, args=(address, transfer_id, structs, job), daemon=True, name=f"kv-pull-{transfer_id}"
        )
        thread.start()
        with self._lock:
            self._pulls = [t for t in self._pulls if t.is_alive()] + [thread]
        try:
            arrays = job.result(timeout=self.pull_timeout)
        except concurrent.futures.TimeoutError:
            self._connections.pop(address, None)  # the peer may be gone: connect afresh next time
            return self._failed(f"the pull of {transfer_id} from {address} took over {self.pull_timeout:g} s")
        except Exception as e:  # the peer is gone, or refused
            self._connections.pop(address, None)
            return self._failed(f"the pull of {transfer_id} from {address} failed: {e!r}")
        handoff = KVHandoff(num_blocks, KVCache(**dict(zip(specs, arrays))))
        with self._lock:
            self.stats.pulled += 1
            self.stats.pulled_bytes += handoff.nbytes
        return handoff

    @property
    def hung_pulls(self) -> int:
        """Pulls given up on whose threads are still blocked (see the module's note)."""
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

    def _failed(self, why: str) -> None:
        logger.warning("KV transfer: %s; computing the prompt here instead", why)
        with self._lock:
            self.stats.failed_pulls += 1
        return None
