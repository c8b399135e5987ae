"""Prefill/decode disaggregation in the server: `python -m api --role prefill|decode`.

vLLM's protocol (jaxserve.parallel.kv_transfer has the whole picture): a request's
`kv_transfer_params` ask a prefill server to hand the prompt's KV over
(`{"do_remote_decode": true}`; the answer carries the params of the offer), or tell a decode
server where to pull it from (`{"do_remote_prefill": true, ...}`, the prefill server's
answer). Params without either flag are ignored, as vLLM does. `python -m api.router
--prefill ... --decode ...` (or vllm-router's PD mode) sends each call through both.

A decode server takes an offer only when it is for the prompt it was sent (the model, the
cache salt and the digests of its blocks match its own) and only after claiming it at the
prefill server that made it (`POST /kv_transfer/claim`, an internal route outside /v1 and
the OpenAI surface): an offer is claimed once, so a replayed one falls back at once and no
pull of it is ever started. After the pull it releases it (`POST /kv_transfer/release`).
Whenever it does not take an offer it computes the prompt itself and counts why
(`jaxserve:kv_transfer_refused_total{reason}`); only params that are malformed, or not
signed with the shared secret, are a 400.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from api.errors import SERVER_ERROR, APIError, bad_request
from jaxserve.model.kv_cache import KVHandoff
from jaxserve.parallel.kv_transfer import (
    PULL_SECONDS_BUCKETS,
    REFUSAL_REASONS,
    BadSignature,
    KVTransfer,
    Offer,
    OfferLimitError,
)
from scheduler.kv_cache_manager import handoff_digests

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
PARAM = "kv_transfer_params"
SIDE_CHANNEL_TIMEOUT = 5.0  # seconds for a claim or release on the prefill server
# Seconds a prefill call waits for room under --kv-offer-memory (decode servers pulling and
# releasing offers make it) before it is a 503: under load offers come and go in well under that.
ROOM_WAIT = 5.0


class DisaggRole:
    """A server's part in disaggregated serving, over its KVTransfer. `block_size`: the
    engine's (the decode side recomputes the prompt's block digests); `model_name`: the name
    offers are bound to (create_app sets it); `url`: this prefill server's base URL, where
    decode servers claim its offers (the server sets it once bound)."""

    def __init__(self, role: str, transfer: KVTransfer, block_size: int, model_name: str | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role, self.transfer, self.block_size = role, transfer, block_size
        self.model_name = model_name
        self.url: str | None = None
        self._releases: set[asyncio.Task] = set()
        self.registry = CollectorRegistry()
        self.registry.register(_TransferCollector(transfer))

    async def prepare(
        self, params: dict | None, prompts: list[list[int]], stream: bool, cache_salt: str | None = None
    ) -> tuple[bool, KVHandoff | None]:
        """(export the prompt's KV when done, the KV pulled for it) for a call's kv_transfer_params."""
        if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            return False, None
        if len(prompts) != 1:
            raise bad_request(f"{PARAM} needs a single prompt, got {len(prompts)}", PARAM)
        if params.get("do_remote_decode"):
            if self.role != "prefill":
                raise bad_request(
                    f"{PARAM}.do_remote_decode: this server does not hand over KV (it runs as "
                    f"{self.role}; start a prefill server with --role prefill)",
                    PARAM,
                )
            if stream:
                raise bad_request(f"{PARAM}.do_remote_decode needs stream false: the answer carries the offer", PARAM)
            if not await self._room(0):  # the pending offers hold the limit: do not run the prompt
                limit = self.transfer.max_offer_bytes
                raise offers_full(f"offers not yet pulled hold the limit of {limit} bytes of KV (--kv-offer-memory)")
            return True, None
        if self.role != "decode":
            raise bad_request(
                f"{PARAM}.do_remote_prefill: this server does not pull KV (it runs as {self.role}; "
                "start a decode server with --role decode)",
                PARAM,
            )
        try:
            offer = self.transfer.read_offer(params)
        except BadSignature as e:
            self.transfer.count_refusal("bad_signature")
            raise bad_request(str(e), PARAM) from None
        except ValueError as e:
            raise bad_request(str(e), PARAM) from None
        return False, await self._take(offer, prompts[0], cache_salt)

    async def _take(self, offer: Offer, prompt: list[int], cache_salt: str | None) -> KVHandoff | None:
        """The offer's KV, if it is this prompt's and still to be had; None (counted) if not."""
        refuse = self.transfer.refuse
        digests = handoff_digests(prompt, self.block_size, cache_salt, offer.num_blocks)
        if (offer.model, offer.cache_salt, list(offer.digests)) != (self.model_name, cache_salt, digests):
            return refuse("mismatch", f"the offer {offer.transfer_id} is not for this model, prompt and cache_salt")
        reason = self.transfer.admit(offer)
        if reason is not None:
            return refuse(reason, f"the offer {offer.transfer_id} was pulled here already or expires")
        if offer.side_channel is not None:
            reason = await self._claim(offer)
            if reason is not None:
                return refuse(reason, f"the prefill server did not let the offer {offer.transfer_id} be claimed")
        # NOTE: in a thread: a pull may wait up to the transfer's pull_timeout.
        handoff = await asyncio.to_thread(self.transfer.pull, offer)
        if handoff is not None and offer.side_channel is not None:
            task = asyncio.create_task(self._release(offer))  # the caller need not wait for it
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        return handoff

    async def _claim(self, offer: Offer) -> str | None:
        """Claim the offer at its prefill server: None when it is ours, else why not."""
        try:
            async with httpx.AsyncClient(timeout=SIDE_CHANNEL_TIMEOUT) as client:
                answer = await client.post(f"{offer.side_channel}/claim", json={"transfer_id": str(offer.transfer_id)})
        except httpx.HTTPError as e:
            logger.warning("KV transfer: claiming at %s failed: %r", offer.side_channel, e)
            return "unreachable"
        if answer.status_code == 200:
            return None
        try:
            reason = answer.json().get("reason")
        except ValueError:
            reason = None
        return reason if reason in REFUSAL_REASONS else "unreachable"

    async def _release(self, offer: Offer) -> None:
        try:
            async with httpx.AsyncClient(timeout=SIDE_CHANNEL_TIMEOUT) as client:
                await client.post(f"{offer.side_channel}/release", json={"transfer_id": str(offer.transfer_id)})
        except httpx.HTTPError as e:  # it then counts until it expires
            logger.warning("KV transfer: releasing at %s failed: %r", offer.side_channel, e)

    async def _room(self, nbytes: int) -> bool:
        """Whether the pending offers leave room for `nbytes` more (`> 0`) or any (0), waiting
        up to ROOM_WAIT seconds for pulls to make it."""
        limit = self.transfer.max_offer_bytes
        deadline = asyncio.get_running_loop().time() + ROOM_WAIT
        while limit is not None:
            pending = self.transfer.pending()[1]
            if (pending + nbytes <= limit) if nbytes else (pending < limit):
                return True
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def response_fields(self, handoff: KVHandoff | None) -> dict:
        """The answer's kv_transfer_params: the offer of `handoff` (a finished prefill); a 503
        when the offers not yet pulled have no room for it within ROOM_WAIT."""
        if handoff is None:
            return {}
        await self._room(handoff.nbytes)  # else offer() says why not
        binding = {"model": self.model_name}
        if self.url is not None:
            binding["kv_transfer_url"] = f"{self.url}/kv_transfer"
        try:
            return {PARAM: self.transfer.offer(handoff, binding)}
        except OfferLimitError as e:
            raise offers_full(str(e)) from None

    def render_metrics(self) -> str:
        return generate_latest(self.registry).decode()


def offers_full(message: str) -> APIError:
    return APIError(503, message, type=SERVER_ERROR, code="kv_offers_full", headers={"Retry-After": "1"})


def check_colocated(params: dict | None) -> None:
    """On a server without a role, a call asking to hand KV over is a 400, not served colocated."""
    if params and (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        raise bad_request(
            f"{PARAM}: this server serves prefill and decode together; start it with --role "
            "prefill or --role decode to hand KV between servers",
            PARAM,
        )


# -- the prefill server's side channel: internal, server to server ---------------------------

router = APIRouter(prefix="/kv_transfer", include_in_schema=False)


async def _offer_id(request: Request) -> tuple[KVTransfer, int]:
    disagg = request.app.state.server.disagg
    if disagg is None or disagg.role != "prefill":
        raise APIError(404, "this server makes no KV offers (it is not started with --role prefill)")
    try:
        return disagg.transfer, int((await request.json())["transfer_id"])
    except (ValueError, KeyError, TypeError):
        raise bad_request('the body must be {"transfer_id": "<id>"}', "transfer_id") from None


@router.post("/claim")
async def claim_offer(request: Request):
    """Claim an offer for its one pull: 200, or 409 with the reason (replayed, expired, unknown)."""
    transfer, transfer_id = await _offer_id(request)
    reason = transfer.claim(transfer_id)
    if reason is not None:
        return JSONResponse({"claimed": False, "reason": reason}, status_code=409)
    return {"claimed": True}


@router.post("/release")
async def release_offer(request: Request):
    """A claimed offer was pulled: its bytes no longer count against the offers' limit."""
    transfer, transfer_id = await _offer_id(request)
    return {"released": transfer.release(transfer_id)}


class _TransferCollector:
    def __init__(self, transfer: KVTransfer):
        self.transfer = transfer

    def collect(self):
        t = self.transfer
        s = t.stats
        for name, help_, value in [
            ("kv_transfer_offers", "Prompts whose KV this server offered to a decode server.", s.offered),
            ("kv_transfer_offered_bytes", "Bytes of KV offered to decode servers.", s.offered_bytes),
            (
                "kv_transfer_offers_over_limit",
                "Prefill calls refused (503): offers held --kv-offer-memory.",
                s.offers_over_limit,
            ),
            ("kv_transfer_pulls", "Prompts whose KV this server pulled from a prefill server.", s.pulled),
            ("kv_transfer_pulled_bytes", "Bytes of KV pulled from prefill servers.", s.pulled_bytes),
            ("kv_transfer_failed_pulls", "Offers not taken (the prompt was computed here instead).", s.failed_pulls),
        ]:
            yield CounterMetricFamily(f"jaxserve:{name}", help_, value=value)
        refused = CounterMetricFamily("jaxserve:kv_transfer_refused", "Offers not taken, by reason.", labels=["reason"])
        for reason in REFUSAL_REASONS:
            refused.add_metric([reason], s.refused[reason])
        yield refused
        count, nbytes = t.pending()
        for name, help_, value in [
            ("kv_transfer_offers_pending", "Offers not yet pulled (nor expired).", count),
            ("kv_transfer_offers_pending_bytes", "Bytes of KV the pending offers hold.", nbytes),
            (
                "kv_transfer_offers_limit_bytes",
                "The most bytes pending offers may hold (-1: no limit).",
                -1 if t.max_offer_bytes is None else t.max_offer_bytes,
            ),
            (
                "kv_transfer_pulls_in_flight",
                "Pull threads alive (in flight, or given up and still blocked).",
                t.live_pulls,
            ),
        ]:
            yield GaugeMetricFamily(f"jaxserve:{name}", help_, value=value)
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, PULL_SECONDS_BUCKETS), "+Inf"], s.pull_seconds):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "jaxserve:kv_transfer_pull_seconds",
            "Seconds a pull of KV took.",
            buckets=buckets,
            sum_value=s.pull_seconds_sum,
        )
