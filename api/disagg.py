"""Prefill/decode disaggregation in the server: `python -m api --role prefill|decode`.

vLLM's protocol (jaxserve.parallel.kv_transfer has the whole picture): a request's
`kv_transfer_params` ask a prefill server to hand the prompt's KV over
(`{"do_remote_decode": true}`; the answer carries the params of the offer), or tell a decode
server where to pull it from (`{"do_remote_prefill": true, ...}`, the prefill server's
answer). Params without either flag are ignored, as vLLM does. `python -m api.disagg_proxy`
sends each call through both.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from api.errors import bad_request
from jaxserve.model.kv_cache import KVHandoff
from jaxserve.parallel.kv_transfer import KVTransfer

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
PARAM = "kv_transfer_params"


class DisaggRole:
    """A server's part in disaggregated serving, over its KVTransfer."""

    def __init__(self, role: str, transfer: KVTransfer):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role, self.transfer = role, transfer
        self.registry = CollectorRegistry()
        self.registry.register(_TransferCollector(transfer))

    async def prepare(self, params: dict | None, num_prompts: int, stream: bool) -> tuple[bool, KVHandoff | None]:
        """(export the prompt's KV when done, the KV pulled for it) for a call's kv_transfer_params."""
        if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            return False, None
        if num_prompts != 1:
            raise bad_request(f"{PARAM} needs a single prompt, got {num_prompts}", PARAM)
        if params.get("do_remote_decode"):
            if self.role != "prefill":
                raise bad_request(
                    f"{PARAM}.do_remote_decode: this server does not hand over KV (it runs as "
                    f"{self.role}; start a prefill server with --role prefill)",
                    PARAM,
                )
            if stream:
                raise bad_request(f"{PARAM}.do_remote_decode needs stream false: the answer carries the offer", PARAM)
            return True, None
        if self.role != "decode":
            raise bad_request(
                f"{PARAM}.do_remote_prefill: this server does not pull KV (it runs as {self.role}; "
                "start a decode server with --role decode)",
                PARAM,
            )
        try:
            # NOTE: in a thread: a pull may wait up to the transfer's pull_timeout.
            return False, await asyncio.to_thread(self.transfer.pull, params)
        except ValueError as e:
            raise bad_request(str(e), PARAM) from None

    def response_fields(self, handoff: KVHandoff | None) -> dict:
        """The answer's kv_transfer_params: the offer of `handoff` (a finished prefill)."""
        return {} if handoff is None else {PARAM: self.transfer.offer(handoff)}

    def render_metrics(self) -> str:
        return generate_latest(self.registry).decode()


def check_colocated(params: dict | None) -> None:
    """On a server without a role, a call asking to hand KV over is a 400, not served colocated."""
    if params and (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        raise bad_request(
            f"{PARAM}: this server serves prefill and decode together; start it with --role "
            "prefill or --role decode to hand KV between servers",
            PARAM,
        )


class _TransferCollector:
    def __init__(self, transfer: KVTransfer):
        self.transfer = transfer

    def collect(self):
        s = self.transfer.stats
        for name, help_, value in [
            ("kv_transfer_offers", "Prompts whose KV this server offered to a decode server.", s.offered),
            ("kv_transfer_offered_bytes", "Bytes of KV offered to decode servers.", s.offered_bytes),
            ("kv_transfer_pulls", "Prompts whose KV this server pulled from a prefill server.", s.pulled),
            ("kv_transfer_pulled_bytes", "Bytes of KV pulled from prefill servers.", s.pulled_bytes),
            ("kv_transfer_failed_pulls", "Pulls given up on (the prompt was computed here instead).", s.failed_pulls),
        ]:
            yield CounterMetricFamily(f"jaxserve:{name}", help_, value=value)
