"""Data-parallel replicas behind one API server: M engines, each in an EngineLoop thread of
its own (on its own devices), and a PrefixRouter that sends each API call to one of them.

    event loop                                  replicas
    ----------                                  --------
    state.admit(k)  -> ReplicaSet.admit         room over the alive replicas (503 if none)
    (tokenize, compile a grammar)               the call is held by the set, not yet routed
    await generation.add(prompts, ...)  ----->  router.pick(prompts[0], loads) -> replica i
                                                every prompt of the call goes to replica i
    async for delta in generation       <-----  replica i's deltas
    generation.close()                  ----->  replica i's aborts

Late binding: the router needs token ids (it matches the prompt's first full blocks against
the prefixes it recently sent to each replica), and a call is admitted on arrival, before
its prompts are tokenized. So `admit` checks only the room of all alive replicas together
and holds the call in the set; `ReplicaGeneration.add`, where the prompts are known, picks
the replica from the call's first prompt and moves the reservation there, where it counts
in that replica's load at once (a burst of calls spreads). Choosing and sending happen with
no await between them, as in `Generation.add`.

A replica whose engine thread failed leaves the rotation: the router gets None for its load
and forgets its prefixes; its requests in flight fail with EngineDeadError (its EngineLoop
does that); later calls go to the others. `/health` stays 200 while one replica lives.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

from api.admission import Admitted, EngineDeadError, QueueFullError, Reservation
from api.engine_loop import EngineLoop, Generation, StepDelta
from api.metrics import Metrics
from scheduler import SamplingParams
from scheduler.router import NoReplicaAvailable, PrefixRouter

logger = logging.getLogger(__name__)


def default_load_bound(max_num_seqs: int) -> int:
    """How many sequences more than the least loaded replica a prefix match may route to."""
    return max(2, max_num_seqs // 4)


class ReplicaSet:
    """M EngineLoops and a PrefixRouter, with the part of EngineLoop's interface that
    ServerState and the app use (admit, generation, engine, start, stop, is_alive).

    The engines must come from one LoadedModel (`LLMEngine(loaded, config)` per replica).
    `max_waiting` bounds each replica's backlog as EngineLoop's does; the set refuses a call
    when the backlog of all alive replicas together reaches `max_waiting` times their number.
    """

    def __init__(
        self, engines: Sequence, model_name: str, *, load_bound: int | None = None, max_waiting: int | None = None
    ):
        first = engines[0]
        if any(e.loaded is not first.loaded for e in engines):
            raise ValueError("data-parallel replicas must be built from one LoadedModel")
        block_sizes = {e.scheduler.config.block_size for e in engines}
        if len(block_sizes) != 1:
            raise ValueError(f"data-parallel replicas need one block size (the router's digests), got {block_sizes}")
        if any(e.eos_token_ids != first.eos_token_ids for e in engines):
            raise ValueError("data-parallel replicas need the same generation config (eos tokens)")
        # NOTE: one grammar compiler for all: the server compiles a request's grammar (on
        # `engine`) before it knows the replica, and the replica's add_request then finds it
        # compiled. Its backend depends only on the tokenizer, eos tokens and vocabulary,
        # which the replicas share.
        for e in engines[1:]:
            e.grammars = first.grammars
        self.engine = first  # what the replicas share: tokenizer, grammar compiler, model config
        self.max_waiting = max_waiting
        metrics = Metrics.for_replicas(
            model_name, first.cache_config_info(), len(engines), [e.device_bytes() for e in engines]
        )
        self.replicas = [EngineLoop(e, m, replica=i) for i, (e, m) in enumerate(zip(engines, metrics))]
        if load_bound is None:
            load_bound = default_load_bound(first.scheduler.config.max_num_seqs)
        self.router = PrefixRouter(len(engines), block_sizes.pop(), load_bound)
        self.admitted = Admitted()  # sequences of admitted calls not yet routed
        self._out_of_rotation: set[int] = set()

    # -- lifecycle (event loop) ---------------------------------------------------------

    def start(self) -> None:
        """Start every replica's engine thread; call from inside the running event loop."""
        for replica in self.replicas:
            replica.start()

    def stop(self, timeout: float = 30.0) -> None:
        for replica in self.replicas:
            replica.stop(timeout)

    @property
    def is_alive(self) -> bool:
        """True while any replica's engine thread runs."""
        return any(r.is_alive for r in self.replicas)

    def dead_error(self) -> EngineDeadError:
        errors = "; ".join(f"replica {i}: {r.error!r}" for i, r in enumerate(self.replicas))
        return EngineDeadError(f"every engine replica has stopped: {errors}")

    def health(self) -> dict:
        """/health's body: each replica, alive or not, and why not."""
        replicas = []
        for i, r in enumerate(self.replicas):
            entry = {"id": i, "alive": r.is_alive}
            if not r.is_alive:
                entry["error"] = str(r.dead_error())
            replicas.append(entry)
        return {"replicas": replicas}

    def render_metrics(self) -> str:
        """/metrics: every replica's metrics under its `engine` label, and engine_up."""
        return Metrics.render_replicas(
            [r.metrics for r in self.replicas], [r.stats for r in self.replicas], [r.is_alive for r in self.replicas]
        )

    # -- requests (event loop) ----------------------------------------------------------

    def admit(self, num_sequences: int) -> Reservation:
        """Decide on arrival whether a call of `num_sequences` may queue (QueueFullError if not).

        The prompts are not tokenized yet, so the replica is not known: the call is checked
        against the alive replicas' room together and held here until `route` (late binding).
        """
        if self.max_waiting is not None:
            alive = [r for r in self.replicas if r.is_alive]
            backlog = self.admitted.count + sum(r.backlog for r in alive)
            if alive and backlog >= self.max_waiting * len(alive):
                # Counted on the least loaded replica: the one the call would most likely have gone to.
                min(alive, key=lambda r: r.load).metrics.request_rejected()
                raise QueueFullError(
                    f"the server is overloaded: {backlog} sequences are waiting beyond the free "
                    f"slots of {len(alive)} replicas; try again later"
                )
        return self.admitted.reserve(num_sequences)

    def route(
        self, reservation: Reservation, num_sequences: int, prompt: list[int], cache_salt: str | None
    ) -> tuple[int, Reservation]:
        """Pick the replica for a call admitted with `reservation` (on its first prompt) and
        move the call's room there: (replica, its reservation). Raises EngineDeadError when
        every replica is dead."""
        reservation.spend(num_sequences)
        self.admitted.give_back(num_sequences)  # no longer held here: in the chosen replica's count below
        try:
            route = self.router.pick(prompt, self.loads(), cache_salt=cache_salt)
        except NoReplicaAvailable:
            raise self.dead_error() from None
        logger.debug(
            "routed a call of %d sequences to replica %d (%s, %d blocks matched)",
            num_sequences,
            route.replica,
            route.reason,
            route.matched_blocks,
        )
        return route.replica, self.replicas[route.replica].admitted.reserve(num_sequences)

    def loads(self) -> list[int | None]:
        """Each replica's running + waiting sequences for the router; None for a dead one,
        which leaves the rotation here (the router forgets its prefixes, once)."""
        loads = []
        for i, replica in enumerate(self.replicas):
            if replica.is_alive:
                loads.append(replica.load)
                continue
            if i not in self._out_of_rotation:
                self._out_of_rotation.add(i)
                self.router.forget(i)
                logger.error("engine replica %d has stopped and leaves the rotation: %r", i, replica.error)
            loads.append(None)
        return loads

    def generation(self, request_ids: list[str]) -> ReplicaGeneration:
        return ReplicaGeneration(self, request_ids)


class ReplicaGeneration:
    """A Generation whose replica is chosen in `add`, when the prompts are known; then it is
    that replica's Generation (iteration, close and aborts all go there)."""

    def __init__(self, replica_set: ReplicaSet, request_ids: list[str]):
        self.replica_set = replica_set
        self.request_ids = list(request_ids)
        self.replica: int | None = None  # set by `add`
        self._generation: Generation | None = None

    async def add(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        reservation: Reservation,
        *,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        **kv_transfer,
    ) -> None:
        """Route the call on its first prompt, then queue all its prompts on that replica."""
        self.replica, routed = self.replica_set.route(
            reservation, len(prompts) * params.n, prompts[0] if prompts else [], cache_salt
        )
        self._generation = self.replica_set.replicas[self.replica].generation(self.request_ids)
        await self._generation.add(
            prompts, params, routed, arrival_time=arrival_time, priority=priority, cache_salt=cache_salt, **kv_transfer
        )

    async def __aiter__(self) -> AsyncIterator[StepDelta]:
        if self._generation is not None:
            async for delta in self._generation:
                yield delta

    def close(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        if self._generation is not None:
            self._generation.close()

    async def __aenter__(self) -> ReplicaGeneration:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
