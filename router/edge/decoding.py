"""Request bodies' Content-Encodings, undone before any handler reads the body.

gzip and deflate always; br where the ``brotli`` package is installed and zstd where
``zstandard`` is. Every decoder stops at a limit on what it produces, so a small body
that inflates without end costs the limit, not the router's memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from types import ModuleType

from router.errors import BadRequest, PayloadTooLarge, UnsupportedEncoding

Decoder = Callable[[bytes, int], bytes]  # (body, most bytes) -> decoded, past most: raise


class _TooLarge(Exception):
    pass


def _zlib(wbits: int) -> Decoder:
    def decode(body: bytes, most: int) -> bytes:
        inflater = zlib.decompressobj(wbits)
        out = inflater.decompress(body, most + 1)
        if len(out) > most:
            raise _TooLarge
        if not inflater.eof or inflater.unconsumed_tail:
            raise zlib.error("the compressed data ends early or runs on")
        return out

    return decode


def _optional(name: str) -> ModuleType | None:
    try:
        return __import__(name)
    except ImportError:
        return None


_brotli = _optional("brotli")
_zstandard = _optional("zstandard")


def _br(body: bytes, most: int) -> bytes:
    assert _brotli is not None
    decoder = _brotli.Decompressor()
    out: bytes = decoder.process(body, output_buffer_limit=most + 1)
    if len(out) > most:
        raise _TooLarge
    if not decoder.is_finished():
        raise ValueError("the compressed data ends early")
    return out


def _zstd(body: bytes, most: int) -> bytes:
    assert _zstandard is not None
    reader = _zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
    out: bytes = reader.read(most + 1)
    if len(out) > most:
        raise _TooLarge
    return out


DECODERS: dict[bytes, Decoder] = {
    b"gzip": _zlib(16 + zlib.MAX_WBITS),
    b"x-gzip": _zlib(16 + zlib.MAX_WBITS),
    b"deflate": _zlib(zlib.MAX_WBITS),
    **({b"br": _br} if _brotli is not None else {}),
    **({b"zstd": _zstd} if _zstandard is not None else {}),
}
DECODED_CODINGS = frozenset({b"identity", *DECODERS})


def undecodable(coding: bytes) -> UnsupportedEncoding:
    known = ", ".join(sorted(c.decode() for c in DECODED_CODINGS))
    return UnsupportedEncoding(
        f"the request's Content-Encoding {coding.decode('latin-1')!r} is not one the router "
        f"decodes ({known})"
    )


def decode(body: bytes, coding: bytes, most: int) -> bytes:
    """``body`` as it was before ``coding`` (one of ``DECODED_CODINGS``), at most
    ``most`` bytes of it (past that: 413)."""
    decoder = DECODERS.get(coding)
    if decoder is None:
        return body
    try:
        return decoder(body, most)
    except _TooLarge:
        raise PayloadTooLarge(f"request body is larger than {most} bytes decoded") from None
    except Exception:  # zlib.error, brotli.error, zstandard.ZstdError: bytes not in it
        raise BadRequest(
            "the request body could not be decoded as its Content-Encoding "
            f"{coding.decode('latin-1')!r} says"
        ) from None
