"""Frames: the checksummed, length-prefixed unit a journal segment is made of.

    frame    [u32 length][u32 crc32 of payload][payload]   (little-endian; length = len(payload))
    payload  [u8 kind][i64 uid][i32 attempt][i32 repeat][body]   (PREFIX; kinds and bodies: codec.py)

The fixed prefix names the record's group (uid, attempt) and episode (repeat) without decoding its body, so
compaction filters frames by group at struct speed. `scan` reads a segment's bytes back: every frame whose
checksum holds, in order, and the damaged stretches between them. A bad frame (a torn tail after a kill, a
flipped bit, a length field that points past the end) is skipped by searching forward for the next offset where
a frame's length and checksum hold, so one damaged record costs that record only.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

HEAD = struct.Struct("<II")
"""length, crc32."""
PREFIX = struct.Struct("<Bqii")
"""kind, uid, attempt, repeat."""
MAX_FRAME = 1 << 30
"""No record is larger: a length field past it is damage, not a record."""


def frame(payload: bytes) -> bytes:
    return HEAD.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass
class Damage:
    """A stretch of a segment that holds no valid frame."""

    offset: int
    length: int
    tail: bool
    """It runs to the end of the segment (a torn write at a kill, most likely)."""


def _valid_at(data: bytes | memoryview, pos: int, end: int) -> int:
    """The end offset of a valid frame at `pos`, or -1."""
    if pos + HEAD.size > end:
        return -1
    n, crc = HEAD.unpack_from(data, pos)
    stop = pos + HEAD.size + n
    if n < PREFIX.size or n > MAX_FRAME or stop > end:
        return -1
    if zlib.crc32(data[pos + HEAD.size:stop]) != crc:
        return -1
    return stop


def scan(data: bytes) -> tuple[list[tuple[int, memoryview]], list[Damage]]:
    """(offset, payload) of every valid frame in `data`, in order, and the damaged stretches between them."""
    view = memoryview(data)
    end = len(data)
    frames: list[tuple[int, memoryview]] = []
    damage: list[Damage] = []
    pos = 0
    while pos < end:
        stop = _valid_at(view, pos, end)
        if stop >= 0:
            frames.append((pos, view[pos + HEAD.size:stop]))
            pos = stop
            continue
        bad = pos  # search forward for the next place a frame holds
        pos += 1
        while pos < end and _valid_at(view, pos, end) < 0:
            pos += 1
        damage.append(Damage(offset=bad, length=pos - bad, tail=pos >= end))
    return frames, damage


def iter_prefixes(frames: list[tuple[int, memoryview]]) -> Iterator[tuple[int, int, int, int, memoryview]]:
    """(kind, uid, attempt, repeat, payload) per frame."""
    unpack = PREFIX.unpack_from
    for _, payload in frames:
        kind, uid, attempt, repeat = unpack(payload, 0)
        yield kind, uid, attempt, repeat, payload
