"""SegmentWriter: the journal's one writer, a thread fed by a bounded queue, so a slow disk never blocks an episode.

The event loop only appends (record, size) to a deque (`put`, a few hundred nanoseconds). The thread wakes when
records arrive, waits `write_interval_ms` more to gather them, encodes and frames them (codec.py, frames.py) and
writes them with one `os.write` to the open segment; it fsyncs that segment at most every `fsync_interval_ms`
(and when asked: `sync`, at every step boundary). Segment files are `<writer>-<n>.jal` in the journal directory;
each starts with a HEADER frame; past `segment_mb`, or when asked (`rotate`), the segment is fsynced and closed and
the next one opened.

Durability, precisely:
    a killed process (SIGKILL, OOM kill)  keeps every record the thread wrote (the kernel's page cache is not the
                                          process's); it loses the records still queued, about the last
                                          `write_interval_ms` of them, and a torn last frame is dropped on reading
    a power loss or kernel crash          keeps what was fsynced: up to the last fsync (at most
                                          `fsync_interval_ms` old, and every step boundary)
A record the queue has no room for (more than `max_queue_mb` waiting: a disk slower than the episodes) is not
written: `put` returns False, the drop is counted, and the caller ends that episode's journal there (tape.py).

Encoding runs on the thread, not on the event loop. A record names objects the engine no longer changes (a
TokenOutput once returned, an episode's finished records), so encoding later is encoding what was put.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from agentloop.journal.frames import frame

Encoder = Callable[[], bytes]
"""Makes one record's payload (on the writer thread)."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new or renamed file) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Control:
    """A request that runs on the thread in order with the records put before it."""

    def __init__(self, what: str, fsync: bool = True):
        self.what = what
        self.fsync = fsync
        self.future: Future = Future()


class SegmentWriter:
    """One writer of a journal directory (module doc). `put` from one thread (the event loop's)."""

    def __init__(self, directory: Path, name: str, header: Encoder, *, write_interval_ms: float = 5.0,
                 fsync_interval_ms: float = 1000.0, max_queue_mb: float = 256.0, segment_mb: float = 64.0):
        self.directory = directory
        self.name = name
        self.header = header
        self.write_interval_s = write_interval_ms / 1000
        self.fsync_interval_s = fsync_interval_ms / 1000
        self.max_queue = int(max_queue_mb * 2 ** 20)
        self.segment_bytes = int(segment_mb * 2 ** 20)
        self._q: collections.deque[tuple[Encoder, int] | _Control] = collections.deque()
        self._put_bytes = 0  # written by the putting thread only
        self._done_bytes = 0  # written by the writer thread only
        self._wake = threading.Event()
        self._stop = False
        self._fd: int | None = None
        self._seg_path: Path | None = None
        self._seg_size = 0
        self._dirty = False
        self._last_fsync = time.monotonic()
        self.closed_segments: list[Path] = []
        """Segments this writer closed (compaction's input), oldest first; the caller takes them."""
        self.error: BaseException | None = None
        """The first write error (the journal is off from then on: `put` refuses, the run goes on)."""
        self.stats = {"records": 0, "bytes": 0, "writes": 0, "fsyncs": 0, "dropped_queue_full": 0, "segments": 0}
        directory.mkdir(parents=True, exist_ok=True)
        self._next_index = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in directory.glob(f"{name}-*.jal")
                                    if p.stem.rsplit("-", 1)[1].isdigit()), default=0)
        self._thread = threading.Thread(target=self._run, name=f"journal-writer-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the event loop's side

    @property
    def queued_bytes(self) -> int:
        return self._put_bytes - self._done_bytes

    def put(self, encoder: Encoder, size: int) -> bool:
        """Queue a record (`size`: its approximate bytes). False when it was dropped: the queue is full, or the
        writer failed (`error`)."""
        if self.error is not None or self._put_bytes - self._done_bytes + size > self.max_queue:
            self.stats["dropped_queue_full"] += self.error is None
            return False
        self._put_bytes += size
        self._q.append((encoder, size))
        if not self._wake.is_set():
            self._wake.set()
        return True

    def sync(self) -> Future:
        """A future done once every record put before is written and fsynced."""
        return self._control("sync")

    def rotate(self) -> Future:
        """A future done once every record put before is written, and the segment fsynced and closed (the next record
        opens a new one); its result is the closed segment's path (None when none was open)."""
        return self._control("rotate")

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, fsync, stop the thread."""
        fut = self._control("close")
        try:
            fut.result(timeout_s)
        except Exception:  # noqa: BLE001 - closing never raises: the error is kept in `error`
            pass
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)

    def _control(self, what: str) -> Future:
        c = _Control(what)
        if not self._thread.is_alive():
            c.future.set_result(None)
            return c.future
        self._q.append(c)
        self._wake.set()
        return c.future

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop:
            due = self.fsync_interval_s - (time.monotonic() - self._last_fsync) if self._dirty else None
            self._wake.wait(None if due is None else max(0.0, due))
            self._wake.clear()
            if self._q and self.write_interval_s > 0 and not isinstance(self._q[-1], _Control):
                time.sleep(self.write_interval_s)  # gather: one write for what comes in meanwhile
            try:
                self._drain()
                if self._dirty and (self.fsync_interval_s == 0
                                    or time.monotonic() - self._last_fsync >= self.fsync_interval_s):
                    self._fsync()
            except Exception as e:  # noqa: BLE001 - a full or failing disk turns the journal off, never the run
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        while self._q:
            item = self._q.popleft()
            if isinstance(item, _Control):
                if not item.future.done():
                    item.future.set_exception(e)
            else:
                self._done_bytes += item[1]

    def _drain(self) -> None:
        parts: list[bytes] = []
        size = 0
        while self._q:
            item = self._q.popleft()
            if isinstance(item, _Control):
                self._write(parts)
                parts, size = [], 0
                self._do(item)
                continue
            encoder, est = item
            try:
                payload = encoder()
            finally:
                self._done_bytes += est
            parts.append(frame(payload))
            size += len(parts[-1])
            if size >= 4 * 2 ** 20:  # bounded memory per write
                self._write(parts)
                parts, size = [], 0
        self._write(parts)

    def _do(self, c: _Control) -> None:
        try:
            result = None
            if c.what in ("sync", "close"):
                if self._dirty:
                    self._fsync()
            elif c.what == "rotate":
                result = self._close_segment()
            c.future.set_result(result)
        except Exception as e:  # handed to whoever waits on it, then the writer stops (_run)
            c.future.set_exception(e)
            raise

    def _open_segment(self) -> None:
        self._seg_path = self.directory / f"{self.name}-{self._next_index:06d}.jal"
        self._next_index += 1
        self._fd = os.open(self._seg_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        head = frame(self.header())
        os.write(self._fd, head)
        self._seg_size = len(head)
        self.stats["segments"] += 1
        fsync_dir(self.directory)

    def _close_segment(self) -> Path | None:
        if self._fd is None:
            return None
        os.fsync(self._fd)
        self.stats["fsyncs"] += 1
        os.close(self._fd)
        closed = self._seg_path
        self._fd, self._seg_path, self._dirty = None, None, False
        self._last_fsync = time.monotonic()
        if closed is not None:
            self.closed_segments.append(closed)
        return closed

    def _write(self, parts: list[bytes]) -> None:
        if not parts:
            return
        if self._fd is None:
            self._open_segment()
        data = b"".join(parts)
        assert self._fd is not None
        view = memoryview(data)
        while view:  # os.write may write less than asked
            n = os.write(self._fd, view)
            view = view[n:]
        self._seg_size += len(data)
        self._dirty = True
        self.stats["records"] += len(parts)
        self.stats["bytes"] += len(data)
        self.stats["writes"] += 1
        if self._seg_size >= self.segment_bytes:
            self._close_segment()

    def _fsync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            self.stats["fsyncs"] += 1
        self._dirty = False
        self._last_fsync = time.monotonic()

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"SegmentWriter({self.directory}, {self.name!r}, queued={self.queued_bytes})"


def encoder_of(fn: Callable[..., bytes], *args: Any) -> Encoder:
    """An Encoder calling fn(*args) on the writer thread."""
    return lambda: fn(*args)
