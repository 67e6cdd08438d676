"""The frame format between the sandbox's trainer-side clients and its root processes.

One frame: a 4-byte length of the rest, a 4-byte header length, a JSON header (which lists the
sizes of the raw blobs that follow it), then the blobs. The one-shot supervisor (`_supervisor.py`)
and the session init (`_session_init.py`) both speak it; stdlib only, as they are.
"""

from __future__ import annotations

import json
import struct

_FRAME = struct.Struct("!II")  # total length after this word, header length


def pack(header: dict, blobs: list[bytes]) -> bytes:
    """One frame: lengths, a JSON header (which lists the blob sizes), then the raw blobs."""
    h = json.dumps(dict(header, blobs=[len(b) for b in blobs])).encode()
    body_len = 4 + len(h) + sum(len(b) for b in blobs)
    return b"".join([_FRAME.pack(body_len, len(h)), h, *blobs])


def unpack(body: bytes) -> tuple[dict, list[bytes]]:
    """Inverse of `pack`, given the frame without its first length word."""
    (hlen,) = struct.unpack_from("!I", body)
    header = json.loads(body[4 : 4 + hlen])
    blobs, off = [], 4 + hlen
    for n in header.pop("blobs"):
        blobs.append(body[off : off + n])
        off += n
    return header, blobs
