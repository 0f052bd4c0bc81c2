"""BLAKE2b written from RFC 7693 and the protocol's words alone (``docs/tap-protocol.md``,
"BLAKE2b"), in plain Python: what a tap in a language whose library has no personalization (Go's
``x/crypto/blake2b``) or no BLAKE2b at all (Node's ``crypto`` has no keyed one) must write. The
tests hold ``hashlib`` to it, so that the document's parameter block is the one the Python tap uses.
"""

from __future__ import annotations

MASK = (1 << 64) - 1
IV = (
    0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
    0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179,
)  # fmt: skip
SIGMA = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
    (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
    (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
    (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
    (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
    (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
    (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
    (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
    (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0),
)


def _rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (64 - n))) & MASK


def _compress(h: list[int], block: bytes, counter: int, last: bool) -> None:
    m = [int.from_bytes(block[i : i + 8], "little") for i in range(0, 128, 8)]
    v = h[:] + list(IV)
    v[12] ^= counter & MASK
    v[13] ^= counter >> 64
    if last:
        v[14] ^= MASK
    for r in range(12):
        s = SIGMA[r % 10]
        for i, (a, b, c, d) in enumerate(
            ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
             (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))
        ):  # fmt: skip
            x, y = m[s[2 * i]], m[s[2 * i + 1]]
            v[a] = (v[a] + v[b] + x) & MASK
            v[d] = _rotr(v[d] ^ v[a], 32)
            v[c] = (v[c] + v[d]) & MASK
            v[b] = _rotr(v[b] ^ v[c], 24)
            v[a] = (v[a] + v[b] + y) & MASK
            v[d] = _rotr(v[d] ^ v[a], 16)
            v[c] = (v[c] + v[d]) & MASK
            v[b] = _rotr(v[b] ^ v[c], 63)
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


def blake2b(data: bytes, *, key: bytes = b"", person: bytes = b"", digest_size: int = 64) -> bytes:
    """Return BLAKE2b of ``data``: the parameter block's digest length ``digest_size`` (1-64), key
    length ``len(key)`` (0-64), fanout 1, depth 1, the salt zero, and the personalization ``person``
    padded with zero bytes to 16; a key is a first block of its own, zero-padded to 128 bytes."""
    assert 1 <= digest_size <= 64 and len(key) <= 64 and len(person) <= 16
    block = bytearray(64)
    block[0], block[1], block[2], block[3] = digest_size, len(key), 1, 1
    block[48:64] = person.ljust(16, b"\0")
    h = [IV[i] ^ int.from_bytes(block[8 * i : 8 * i + 8], "little") for i in range(8)]
    stream = (key.ljust(128, b"\0") if key else b"") + data
    counter = 0
    blocks = [stream[i : i + 128] for i in range(0, len(stream), 128)] or [b""]
    for i, chunk in enumerate(blocks):
        counter += len(chunk)
        _compress(h, chunk.ljust(128, b"\0"), counter, i == len(blocks) - 1)
    return b"".join(x.to_bytes(8, "little") for x in h)[:digest_size]
