"""Grammar compilation off the step loop: a thread pool, one compile per distinct spec.

`compile(spec)` returns at once with a Future; equal specs (a schema by its canonical
JSON; `after_token_id` aside: it only says where the matcher starts) share one, so a
cached grammar costs nothing and a slow one blocks only the requests that wait for it.
Failures are cached too: the same invalid schema is refused again without recompiling.
The backend (its tokenizer tables take a moment to build) is made on the first compile,
in the pool, so an engine that never sees a constraint never pays for it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from jaxserve.structured.llguidance import GrammarBackend
from jaxserve.structured.request_grammar import RequestGrammar
from scheduler.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    def __init__(self, make_backend: Callable[[], GrammarBackend], *, max_workers: int = 2, cache_size: int = 256):
        self._make_backend = make_backend
        self._backend: GrammarBackend | Exception | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def backend(self) -> GrammarBackend:
        """The backend, made once; if making it failed (a tokenizer the engine cannot read),
        every compile fails with that error, without trying again."""
        with self._backend_lock:
            if self._backend is None:
                try:
                    self._backend = self._make_backend()
                except Exception as e:
                    self._backend = e
            if isinstance(self._backend, Exception):
                raise self._backend
            return self._backend

    def prepare(self) -> None:
        """Make the backend now, in the pool (a server calls this at start-up); a failure
        is kept for the first compile to report."""
        self._pool.submit(self._prepare)

    def _prepare(self) -> None:
        with contextlib.suppress(Exception):
            _ = self.backend  # made here, in the pool; a failure is kept for the first compile

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of `spec`, as a Future (its exception: a GrammarError)."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(lambda: self.backend.compile(spec))
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def request_grammar(
        self, compiled, after_token_id: int | None = None, thinking_budget: int | None = None
    ) -> RequestGrammar:
        """A new sequence's matcher for a compiled grammar (None: no constraint), at its start;
        with `after_token_id` (the spec's), the grammar starts after that token, which is
        forced once the thinking before it has run `thinking_budget` tokens."""
        backend = self.backend
        matcher = backend.new_matcher(compiled) if compiled is not None else None
        return RequestGrammar(
            matcher, backend.bitmask_words, after_token_id=after_token_id, thinking_budget=thinking_budget
        )
