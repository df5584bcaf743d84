"""Quantized vectors, as vector databases take them: computed on the server from the call's final
vectors (after ``dimensions`` and normalisation), so every client and replica gets the same bytes.

- ``binary`` and ``ubinary`` pack each value's sign bit (``> 0``) eight to a byte, as
  sentence-transformers' ``quantize_embeddings`` does: ``ubinary`` as unsigned bytes, ``binary`` the
  same bytes less 128 as signed ones. A row of ``d`` values packs into ``ceil(d / 8)`` bytes, the last
  padded with zero bits.
- ``int8`` is ``round(x * 127)``: one fixed scale that every batch and replica shares (no range
  measured per batch, which would give the same text different bytes in different batches). A unit
  vector's values lie in [-1, 1], so nothing is ever clipped; the price is resolution where values
  are small (min cosine to the float vector 0.9989 on all-MiniLM-L6-v2, docs/api.md). It takes
  normalised vectors only: with ``normalize`` false, values may lie past 1.
- ``uint8`` is ``int8 + 128``: 1 to 255, 128 for 0.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

INT8_SCALE = 127.0  # a unit vector's largest possible value maps to 127


class Encoding(StrEnum):
    FLOAT32 = "float32"
    INT8 = "int8"
    UINT8 = "uint8"
    BINARY = "binary"
    UBINARY = "ubinary"

    @property
    def needs_unit_vectors(self) -> bool:
        return self in (Encoding.INT8, Encoding.UINT8)


def encode(rows: np.ndarray, encoding: Encoding) -> np.ndarray:
    """``rows`` (float32 [n, d]) in ``encoding``: float32 as given, int8/uint8 [n, d], or the binary
    kinds [n, ceil(d / 8)]."""
    if encoding is Encoding.FLOAT32:
        return rows
    if encoding in (Encoding.BINARY, Encoding.UBINARY):
        packed = np.packbits(rows > 0, axis=1)
        return packed if encoding is Encoding.UBINARY else (packed.astype(np.int16) - 128).astype(np.int8)
    signed = np.clip(np.rint(rows * INT8_SCALE), -127, 127).astype(np.int8)
    return signed if encoding is Encoding.INT8 else (signed.astype(np.int16) + 128).astype(np.uint8)
