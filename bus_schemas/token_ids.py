"""The project-wide compact type for token ids: `array('I')` (uint32, native byte order).

Token ids travel from the router's JSON decode to the radix tree and over the bus as one
`array('I')`, not as a list of Python ints: 4 bytes per id instead of ~36, a vectorised range
check when it is built, and its bytes per page are exactly the page-hash input of
`bus_schemas.page_hash` (uint32 little-endian on the machines we run on), so hashing works on
memoryview slices without packing. Everything that accepts token ids keeps accepting plain
`list[int]` and converts once at its boundary with `as_token_ids`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

TokenIds = array
"""An `array('I')` of token ids. (An alias: `array` is not generic at runtime.)"""

TYPECODE = "I"

if array(TYPECODE).itemsize != 4 or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("hicache-mesh needs a little-endian platform with a 4-byte array('I')")


def as_token_ids(ids: Sequence[int] | bytes | array) -> array:
    """`ids` as an `array('I')`; returned as is (no copy) when it already is one.

    `bytes` are read as packed uint32 (native order). Raises ValueError for a value outside
    [0, 2**32), a non-integer value, or bytes whose length is not a multiple of 4.
    """
    if isinstance(ids, array) and ids.typecode == TYPECODE:
        return ids
    if isinstance(ids, (bytes, bytearray, memoryview)):
        if len(ids) % 4:
            raise ValueError(f"token id bytes must be a multiple of 4 long, got {len(ids)}")
        out = array(TYPECODE)
        out.frombytes(ids)
        return out
    try:
        return array(TYPECODE, ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    except TypeError:
        raise ValueError("token ids must be integers") from None
