"""The stored object's trailer: 32 bytes after the page bytes of every object l3pool writes.

It binds the object to its full key (and length, format version and, optionally, a checksum of the
page bytes); `L3Client` writes it on put and verifies it on every get. Torch-free, so tools that
only count objects (`l3pool inspect`) know an object's size: page bytes + TRAILER_BYTES.
"""

from __future__ import annotations

import numpy as np

TRAILER = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("flags", "<u2"),
        ("length", "<u8"),  # page bytes before the trailer
        ("key", "<u8"),  # xxh3-64 of the full key "ns_id/pagehash"
        ("checksum", "<u8"),  # xxh3-64 of the page bytes (FLAG_CHECKSUM), else 0
    ]
)
TRAILER_BYTES = TRAILER.itemsize  # 32
TRAILER_MAGIC = int.from_bytes(b"L3PG", "little")
FLAG_CHECKSUM = 1
assert TRAILER_BYTES == 32


def object_bytes(page_bytes: int) -> int:
    """Bytes of one stored object of a namespace whose pages are `page_bytes` long."""
    return page_bytes + TRAILER_BYTES
