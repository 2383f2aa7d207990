"""Request bodies' Content-Encodings, undone before any handler reads the body.

gzip (every member) and deflate (zlib-wrapped or raw) always; br where the ``brotli``
package is installed (1.2 or later) and zstd where ``zstandard`` is. Every decoder stops
at a limit on what it produces, so a small body that inflates without end costs the
limit, not the router's memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from types import ModuleType

from router.errors import BadRequest, PayloadTooLarge, UnsupportedEncoding

Decoder = Callable[[bytes, int], bytes]  # (body, most bytes) -> decoded, past most: raise


class _TooLarge(Exception):
    pass


def _inflate(body: bytes, most: int, wbits: int) -> tuple[bytes, bytes]:
    """One zlib stream of ``body``, and what follows it."""
    inflater = zlib.decompressobj(wbits)
    out = inflater.decompress(body, most + 1)
    if len(out) > most:
        raise _TooLarge
    if not inflater.eof:
        raise zlib.error("the compressed data ends early")
    return out, inflater.unused_data


def _gzip(body: bytes, most: int) -> bytes:
    """Every member of a gzip body (RFC 1952 allows several, one after another)."""
    parts: list[bytes] = []
    while body:
        out, body = _inflate(body, most, 16 + zlib.MAX_WBITS)
        parts.append(out)
        most -= len(out)
    return b"".join(parts)


def _deflate(body: bytes, most: int) -> bytes:
    """zlib-wrapped, as RFC 9110 defines ``deflate``, or the raw stream some clients send."""
    wbits = zlib.MAX_WBITS if body[:1] and (body[0] & 0x0F) == 8 else -zlib.MAX_WBITS
    try:
        out, rest = _inflate(body, most, wbits)
    except zlib.error:
        if wbits < 0:
            raise
        out, rest = _inflate(body, most, -zlib.MAX_WBITS)
    if rest:
        raise zlib.error("bytes after the compressed data")
    return out


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


# RFC 9659: a zstd HTTP body's window is at most 8 MiB (more would cost the memory).
ZSTD_MAX_WINDOW = 8 * 1024 * 1024


def _zstd(body: bytes, most: int) -> bytes:
    """A truncated frame gives what it holds (the JSON parser then refuses the body)."""
    assert _zstandard is not None
    decompressor = _zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    reader = decompressor.stream_reader(body, read_across_frames=True)
    out: bytes = reader.read(most + 1)
    if len(out) > most:
        raise _TooLarge
    return out


DECODERS: dict[bytes, Decoder] = {
    b"gzip": _gzip,
    b"x-gzip": _gzip,
    b"deflate": _deflate,
    **({b"br": _br} if _brotli is not None else {}),
    **({b"zstd": _zstd} if _zstandard is not None else {}),
}
DECODED_CODINGS = frozenset({b"identity", *DECODERS})
CODEC_ERRORS: tuple[type[Exception], ...] = (
    zlib.error,
    ValueError,  # the decoders' own (a stream that ends early)
    *((_brotli.error,) if _brotli is not None else ()),
    *((_zstandard.ZstdError,) if _zstandard is not None else ()),
)


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
    if decoder is None or not body:  # no body: nothing was encoded
        return body
    try:
        return decoder(body, most)
    except _TooLarge:
        raise PayloadTooLarge(f"request body is larger than {most} bytes decoded") from None
    except CODEC_ERRORS:  # bytes not in the coding they claim
        raise BadRequest(
            "the request body could not be decoded as its Content-Encoding "
            f"{coding.decode('latin-1')!r} says"
        ) from None
