"""Checking structured-output constraints off the event loop, bounded in threads, processes, time and memory.

Every constraint (`structured.guided_constraint`) is compiled once before its request reaches the
core, so a bad one is a 400 naming its field; a choice list only has its shape and size checked
(`guided_schema.check_guided`: its grammar is quoted literals, which always compile). Compiling can
take seconds (a schema with thousands of properties), and llguidance is native code that a deep
enough grammar crashed, so it runs in worker processes (grammar_worker.py: a crash there fails that
request alone), driven from a small thread pool, never from the loop that serves every other stream:

* at most `MAX_WORKERS` compile at once and `MAX_PENDING` wait or run; past that a request gets a
  retryable 503 (another engine, or a later try, may take it);
* a request waits at most `budget_s` for its constraint (past it: a 400 naming the field; the
  compilation goes on in its thread and its result is kept, so the same constraint sent again is
  answered from the cache);
* results (the error message, or none) are cached by the constraint's JSON, `CACHE_SIZE` of them.

The check is llguidance's grammar validation and a matcher's first mask over a tokenizer of single
bytes; it needs no tokenizer of the model (converting one for llguidance takes a second or more: the
core does that once at start-up, before it is ready). What only the model's tokenizer shows (a lexer
too large to build) fails in the core when it prepares the request's matcher, and the request gets a
400 from there.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError

from lockstep_engine.api.errors import bad_request, refused_unstarted
from lockstep_engine.api.grammar_worker import GrammarWorkers, check_spec
from lockstep_engine.guided_limits import nesting_problem
from lockstep_engine.guided_schema import GuidedDecodingError, check_limits

MAX_WORKERS = 2
MAX_PENDING = 16
CACHE_SIZE = 256
DEFAULT_BUDGET_S = 10.0


class GrammarChecker:
    def __init__(self, budget_s: float = DEFAULT_BUDGET_S):
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="lockstep-grammar-check")
        self.workers = GrammarWorkers(MAX_WORKERS)  # one per thread: a thread never waits for a worker
        self._pending = 0  # compilations queued or running, finished or not in time
        self._pending_lock = threading.Lock()
        self._results: OrderedDict[str, str | None] = OrderedDict()  # spec JSON -> error or None
        self._results_lock = threading.Lock()

    async def check(self, constraint: tuple[str, dict] | None) -> None:
        """A 400 naming the constraint's field when it does not compile in time; 503 when too many wait."""
        if constraint is None:
            return
        param, spec = constraint
        future = self._submit(param, spec)
        try:
            error = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.budget_s)
        except asyncio.TimeoutError:
            raise bad_request(f"{param}: the constraint did not compile within {self.budget_s:g} s (fewer choices, "
                              f"a smaller schema or a simpler grammar compile faster)", param) from None
        if error is not None:
            raise bad_request(f"{param}: {error}", param)

    def check_blocking(self, constraint: tuple[str, dict] | None) -> None:
        """`check` for a caller in a worker thread (the Responses API renders its request off the loop)."""
        if constraint is None:
            return
        param, spec = constraint
        future = self._submit(param, spec)
        try:
            error = future.result(timeout=self.budget_s)
        except FutureTimeoutError:
            raise bad_request(f"{param}: the constraint did not compile within {self.budget_s:g} s (fewer choices, "
                              f"a smaller schema or a simpler grammar compile faster)", param) from None
        if error is not None:
            raise bad_request(f"{param}: {error}", param)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.workers.shutdown()

    def _submit(self, param: str, spec: dict) -> Future:
        try:
            check_limits(spec)
        except GuidedDecodingError as error:
            raise bad_request(f"{param}: {error}", param) from None
        with self._pending_lock:
            if self._pending >= MAX_PENDING:
                raise refused_unstarted(f"{param}: {self._pending} structured-output constraints are compiling on "
                                        f"this server; retry later", retry_after=True)
            self._pending += 1
        future = self._pool.submit(self._compile, spec)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _future: Future) -> None:
        with self._pending_lock:
            self._pending -= 1

    # ---- in a worker thread ----------------------------------------------------------------------
    def _compile(self, spec: dict) -> str | None:
        """The reason `spec` cannot guide a generation, or None; cached, except for choice lists (their check
        costs less than the cache key: a sorted JSON dump of the whole list)."""
        if "choice" in spec:
            return check_spec(spec)  # its shape and size: no native code
        if isinstance(spec.get("json"), dict):
            problem = nesting_problem(spec["json"])  # before the cache key and the pipe, which recurse in C
            if problem is not None:
                return problem
        try:
            key = json.dumps(spec, sort_keys=True)
        except (ValueError, TypeError, RecursionError) as error:
            return f"not valid JSON: {error}"
        with self._results_lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]
        error = self.workers.check(spec)
        with self._results_lock:
            self._results[key] = error
            while len(self._results) > CACHE_SIZE:
                self._results.popitem(last=False)
        return error
