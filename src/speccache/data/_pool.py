"""The worker pool: rows encoded in order, in this process or in forked worker processes."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from speccache.data._encode import encode
from speccache.data._mistral import MistralCommonFormat
from speccache.data._samples import Sample
from speccache.data._vision import Vision
from speccache.data.template import ChatFormat
from speccache.errors import DataError

__all__ = ["Encoder"]

# (row, where, samples or None, error or None, dropped (message, field) pairs, image sources per sample)
_Encoded = tuple[int, str, "list[Sample] | None", "DataError | None", "list[tuple[int, str]]", "list[tuple[str, ...]]"]
_WORKER: dict[str, Any] = {}
_ROWS_PER_TASK = 64


def _encode_rows(rows: list[tuple[int, str, Any]]) -> list[_Encoded]:
    """``(row, where, encoded or None, error or None, dropped)`` for each row; in a worker process or in this one."""
    out: list[_Encoded] = []
    for row_no, where, value in rows:
        try:
            if isinstance(value, DataError):
                raise value
            encoded, dropped, images = encode(value, _WORKER["tokenizer"], _WORKER["fmt"], where, _WORKER["vision"])
            out.append((row_no, where, encoded, None, dropped, images))
        except DataError as e:
            out.append((row_no, where, None, e, [], []))
    return out


def _init_worker(tokenizer: Any, fmt: ChatFormat | MistralCommonFormat | None, vision: Vision | None) -> None:
    _WORKER.update(tokenizer=tokenizer, fmt=fmt, vision=vision)


def _init_pool_worker(tokenizer: Any, fmt: ChatFormat | None, vision: Vision | None) -> None:
    # Ctrl-C signals the whole process group. A worker interrupted inside a task loses it (or dies holding the task
    # queue's lock), and the pool then waits for that result forever; only the parent stops on Ctrl-C, and the
    # workers finish the tasks in flight as on any other early exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer, fmt, vision)


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Holds back Ctrl-C (SIGINT) in the main thread until the block ends, then delivers it.

    ``multiprocessing.Pool()`` interrupted half-way leaves forked workers that nothing closes: they wait on the
    task queue forever after the run has ended. A worker forked inside the block also inherits the holding
    handler, so a Ctrl-C that reaches it before its initializer ignores SIGINT does not kill it (the pool would
    fork a replacement behind the run's back).
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # Ctrl-C interrupts only the main thread; a handler set outside Python cannot be restored
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # to the run's own handler, whatever it is (it may ignore it)


class Encoder:
    """Encodes rows in order, in ``num_proc`` forked worker processes when ``num_proc > 1``."""

    def __init__(
        self, tokenizer: Any, fmt: ChatFormat | MistralCommonFormat | None, num_proc: int, vision: Vision | None = None
    ) -> None:
        self.tokenizer, self.fmt, self.num_proc, self.vision = tokenizer, fmt, num_proc, vision
        self.pool: Any = None
        self.in_flight: collections.deque[Any] = collections.deque()

    def __enter__(self) -> Encoder:
        _init_worker(self.tokenizer, self.fmt, self.vision)
        if self.num_proc > 1:
            import multiprocessing

            # The workers inherit the tokenizer by fork; its own thread pool must not be live across the fork.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            context = multiprocessing.get_context("fork")
            try:
                with _ctrl_c_held():
                    self.pool = context.Pool(self.num_proc, _init_pool_worker, (self.tokenizer, self.fmt, self.vision))
            except BaseException:
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            # Never Pool.terminate(): a worker killed while it writes a result holds the result queue's lock,
            # and the pool's own shutdown then waits on that lock forever. The few tasks still in flight (a
            # --limit reached, an error) finish instead; then the workers exit on their own.
            for task in self.in_flight:
                task.wait()
            self.pool.close()
            self.pool.join()

    def encode(self, rows: Iterator[tuple[int, str, Any]]) -> Iterator[_Encoded]:
        if self.pool is None:
            for row in rows:
                yield from _encode_rows([row])
            return
        # In order, with at most two tasks per worker in flight: rows are read only as fast as they are encoded.
        for task in iter(lambda: list(itertools.islice(rows, _ROWS_PER_TASK)), []):
            self.in_flight.append(self.pool.apply_async(_encode_rows, (task,)))
            if len(self.in_flight) >= 2 * self.num_proc:
                yield from self.in_flight.popleft().get()
        while self.in_flight:
            yield from self.in_flight.popleft().get()
