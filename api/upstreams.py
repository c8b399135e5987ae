"""The servers a router front end (api.router) sends calls to: each one's health, load and
counters, and the cache-aware choice among those of one role.

An upstream is in rotation while its /health answers 200. The router polls every upstream
(`UpstreamPool.poll`); `failures_to_eject` polls in a row that time out or answer non-200
take it out of rotation (a SIGSTOPped process accepts connections but never answers), and so
does at once a refused connection or a call that breaks on it (nothing listens there any
more). The next poll that answers 200 brings it back, with an empty prefix memory: a
restarted server's cache is empty.

Its `down` event is set while it is out of rotation, so a call waiting on it gives up at
once (and is retried elsewhere if nothing streamed yet) instead of waiting on a dead socket.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Sequence

import httpx

from scheduler.router import PrefixRouter

logger = logging.getLogger(__name__)


class UpstreamDown(Exception):
    """The upstream a call waits on left the rotation."""


@dataclasses.dataclass(eq=False)
class Upstream:
    url: str
    role: str  # "replica", "prefill" or "decode"
    index: int  # in its pool (the PrefixRouter's replica number)
    healthy: bool = False  # in rotation; the first poll decides
    error: str | None = "not polled yet"
    in_flight: int = 0  # calls sent here and not finished: the load the router balances
    failed_polls: int = 0  # in a row
    ejections: int = 0
    retries: int = 0  # calls that failed here before streaming and were tried on another
    routed: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by reason
    down: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def __post_init__(self):
        self.down.set()  # out of rotation until a poll answers

    def describe(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "ejections": self.ejections,
            **({"error": self.error} if not self.healthy else {}),
        }


class UpstreamPool:
    """The upstreams of one role and a PrefixRouter over them (load: calls in flight)."""

    def __init__(self, role: str, urls: Sequence[str], load_bound: int, failures_to_eject: int = 2):
        if not urls:
            raise ValueError(f"no {role} server given")
        self.role = role
        self.upstreams = [Upstream(url.rstrip("/"), role, i) for i, url in enumerate(urls)]
        self.router = PrefixRouter(len(urls), 1, load_bound, max_digests=1 << 16)
        self.failures_to_eject = failures_to_eject

    @property
    def available(self) -> bool:
        return any(u.healthy for u in self.upstreams)

    def pick(self, digests: Sequence[bytes], exclude: set[Upstream] = frozenset()) -> Upstream | None:
        """The upstream for a call whose prompt has these digests: the healthy one (not in
        `exclude`) that recently got its longest prefix within the load bound, else the least
        loaded; None when there is none."""
        loads = [u.in_flight if u.healthy and u not in exclude else None for u in self.upstreams]
        if all(load is None for load in loads):
            return None
        route = self.router.pick_digests(digests, loads)
        upstream = self.upstreams[route.replica]
        upstream.routed[route.reason] += 1
        return upstream

    def eject(self, upstream: Upstream, why: str) -> None:
        upstream.error = why
        if upstream.healthy:
            upstream.healthy = False
            upstream.ejections += 1
            upstream.down.set()
            self.router.forget(upstream.index)
            logger.warning("%s %s leaves the rotation: %s", self.role, upstream.url, why)

    def call_failed(self, upstream: Upstream, error: BaseException, *, retried: bool) -> None:
        """A call broke on `upstream` (it did not answer, or its stream broke): out of rotation
        until it answers /health again."""
        upstream.retries += retried
        if not isinstance(error, UpstreamDown):
            self.eject(upstream, f"a call failed: {error!r}")

    def readmit(self, upstream: Upstream) -> None:
        upstream.failed_polls = 0
        if not upstream.healthy:
            upstream.healthy, upstream.error = True, None
            upstream.down = asyncio.Event()
            self.router.forget(upstream.index)  # a restarted server's cache is empty
            logger.info("%s %s is in rotation", self.role, upstream.url)

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> None:
        """Ask every upstream's /health once; eject or readmit on the answers."""
        await asyncio.gather(*(self._poll_one(client, u, timeout) for u in self.upstreams))

    async def _poll_one(self, client: httpx.AsyncClient, upstream: Upstream, timeout: float) -> None:
        try:
            answer = await client.get(f"{upstream.url}/health", timeout=timeout)
        except httpx.ConnectError as e:  # nothing listens: no reason to wait for another poll
            self.eject(upstream, f"/health: cannot connect: {e!r}")
            return
        except httpx.HTTPError as e:
            why = f"/health did not answer within {timeout} s: {e!r}"
        else:
            if answer.status_code == 200:
                self.readmit(upstream)
                return
            why = f"/health answered {answer.status_code}"
        upstream.failed_polls += 1
        if upstream.failed_polls >= self.failures_to_eject or not upstream.healthy:
            self.eject(upstream, why)


async def until_down(awaitable, upstream: Upstream, down_waiter: asyncio.Future):
    """Await `awaitable`, unless `upstream` leaves the rotation first (UpstreamDown)."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task, down_waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client went away: nothing may keep reading for it
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    raise UpstreamDown(f"{upstream.role} {upstream.url} left the rotation: {upstream.error}")


def render_metrics(pools: Sequence[UpstreamPool]) -> str:
    """The router's /metrics page (Prometheus text), one sample per upstream."""
    upstreams = [u for pool in pools for u in pool.upstreams]
    families = [
        ("router_upstream_healthy", "gauge", "1 while the upstream is in rotation.", lambda u: [("", int(u.healthy))]),
        (
            "router_upstream_in_flight",
            "gauge",
            "Calls sent to the upstream and not finished.",
            lambda u: [("", u.in_flight)],
        ),
        (
            "router_upstream_ejections_total",
            "counter",
            "Times the upstream left the rotation.",
            lambda u: [("", u.ejections)],
        ),
        (
            "router_retries_total",
            "counter",
            "Calls that failed on the upstream before streaming and were tried on another.",
            lambda u: [("", u.retries)],
        ),
        (
            "router_routed_total",
            "counter",
            "Calls sent to the upstream, by reason: prefix (it recently got the prompt's prefix) or least_loaded.",
            lambda u: [(f',reason="{r}"', u.routed[r]) for r in ("prefix", "least_loaded")],
        ),
    ]
    lines = []
    for name, kind, help_text, samples in families:
        lines += [f"# HELP jaxserve:{name} {help_text}", f"# TYPE jaxserve:{name} {kind}"]
        for u in upstreams:
            for extra, value in samples(u):
                lines.append(f'jaxserve:{name}{{role="{u.role}",upstream="{u.url}"{extra}}} {value}')
    return "\n".join(lines) + "\n"
