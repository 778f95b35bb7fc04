"""What ``collect`` was fed: a running fingerprint of its input batches.

Each batch is digested (BLAKE2b) from its structure and contents: a tensor by its dtype,
shape and the CRC-32 of its bytes, a dict by its keys and values in order, a tuple or list by its items,
a string, number, bool or None by its ``repr``, anything else by its type and ``repr``.
The fingerprint after batch ``k`` digests the one after batch ``k - 1`` with it, so it
names the whole sequence. Every shard line ``collect`` commits records ``{"batches",
"fingerprint"}``: how many batches its rows come from and their fingerprint.

Costs: one pass over each batch's bytes (a GPU tensor is copied to the host first), by
``zlib.crc32`` (about 4 GB/s here, four times BLAKE2b's speed: the bytes are the bulk; the
structure and the per-tensor CRCs are few bytes for BLAKE2b).

Threads: ``collect`` splits the work. :func:`parts` runs on the caller's thread: it walks the
batch, formats its structure and takes each tensor's host bytes (the torch calls, and any
copy, are the caller's). :func:`chain_parts` runs on the store's worker thread: only
``zlib.crc32`` and BLAKE2b, which allocate nothing from the C heap the tensors live in (so
the worker leaves no holes there; see ``_sink.py``). ``chain(f, batch)`` is
``chain_parts(f, parts(batch))``.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping

import torch

__all__ = ["START", "Parts", "chain", "chain_parts", "parts"]

START = hashlib.blake2b(b"funhooks.collect.inputs", digest_size=16).hexdigest()
"""The fingerprint of no batches."""


class _Tensor:
    """One tensor of a batch, ready to digest: its text before the CRC-32 and its host bytes
    (`keep` holds the host copy, when one was made, until the digest is done)."""

    def __init__(self, value: torch.Tensor) -> None:
        t = value.detach().to("cpu").contiguous().reshape(-1)
        self.text = f"T{t.dtype}{tuple(value.shape)}:"
        self.keep = t
        self.data = t.view(torch.uint8).numpy().data if t.numel() else None


Parts = list[bytes | _Tensor]
"""A batch, flattened for :func:`chain_parts`: its structure and values as bytes, each tensor as a ``_Tensor``."""


def _walk(out: Parts, value: object) -> None:
    if isinstance(value, torch.Tensor):
        out.append(_Tensor(value))
    elif isinstance(value, Mapping):
        out.append(f"M{len(value)}".encode())
        for k, v in value.items():
            _walk(out, k)
            _walk(out, v)
    elif isinstance(value, (tuple, list)):
        out.append(f"S{type(value).__name__}{len(value)}".encode())
        for v in value:
            _walk(out, v)
    elif value is None or isinstance(value, (str, bytes, int, float, bool)):
        out.append(f"V{value!r}".encode())
    else:
        out.append(f"O{type(value).__module__}.{type(value).__qualname__}{value!r}".encode())


def parts(batch: object) -> Parts:
    """`batch` flattened for :func:`chain_parts` (on the caller's thread)."""
    out: Parts = []
    _walk(out, batch)
    return out


def chain_parts(fingerprint: str, batch: Parts) -> str:
    """The fingerprint of the batches `fingerprint` names, then the batch `batch` flattens."""
    h = hashlib.blake2b(fingerprint.encode(), digest_size=16)
    for part in batch:
        if isinstance(part, bytes):
            h.update(part)
        else:
            crc = zlib.crc32(part.data) if part.data is not None else 0
            h.update(f"{part.text}{crc:08x}".encode())
    return h.hexdigest()


def chain(fingerprint: str, batch: object) -> str:
    """The fingerprint of the batches `fingerprint` names, then `batch`."""
    return chain_parts(fingerprint, parts(batch))
