"""The KV hand-off between a prefill server and a decode server, over a TCP socket keyed by room.

SGLang's model gateway sends the same body to a prefill and a decode server, adding
``bootstrap_host``, ``bootstrap_port`` (the prefill server's bootstrap listener) and
``bootstrap_room`` (a random 63-bit number per request and per retry). The decode server connects
to ``bootstrap_host:bootstrap_port`` and asks for its room; the prefill server answers with the
room's K/V once it has computed them, and frees its pages when the decode server says it has them.

The protocol, every integer big-endian:

- decode → prefill: ``b"KVCB"``, version (1 byte), room (8 bytes).
- prefill → decode: ``b"KVCB"``, header length (4 bytes), the header (JSON: ``status``, ``message``,
  ``room``, ``tenant``, ``request_id``, ``num_tokens``, ``src_pages``, ``input_ids``, ``head_dim``),
  then, when ``status`` is 200, the K rows and the V rows (``num_tokens * head_dim`` float32 each).
- decode → prefill: one byte, ``b"\\x01"``, once it holds every byte (the transfer is done).
- decode → prefill, on a connection of its own when the decode server refused the request (its
  pool can never hold it): ``b"KVCX"``, version, room, the decode server's HTTP status (2 bytes).
  The prefill server frees the room's pages at once and answers its request with that status,
  where it would otherwise hold them until ``--kv-transfer-timeout`` runs out (the pool filling
  with rooms nobody will take, so that even a small request waits).

With ``--kv-checksum`` (SGLang's ``--disaggregation-enable-kv-checksum``, sglang#39500) the prefill
server puts an Adler-32 digest of the room's K and V rows, taken from its pages, in the header
(``kv_checksum``), and the decode server digests the rows it received before it writes them: a
mismatch fails the request closed (HTTP 500, ``kv_checksum_mismatch``) where it would otherwise be
decoded. A header without a digest (a prefill server without the flag) is taken unverified, as
SGLang admits a hand-off whose sender sent none.

The header carries the same manifest as the in-process transfer (``workers.transfer``): under the
placeholder defect it says ``num_tokens = 1`` while the decode server preallocated pages for the
whole prompt. A room the prefill server refused (its 400) is answered with that status at once, so
the decode server does not wait for K/V that never come. Both sides set ``TCP_NODELAY``: a small
frame held back by Nagle's algorithm costs tens of milliseconds per request.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("kvcanary.workers.pd_transfer")

MAGIC = b"KVCB"
ABANDON_MAGIC = b"KVCX"
VERSION = 1
_ASK = struct.Struct("!4sBQ")
_STATUS = struct.Struct("!H")
_ANSWER = struct.Struct("!4sI")
_DONE = b"\x01"
_MAX_HEADER = 16 << 20


class HandoffFailed(Exception):
    """The hand-off did not happen; ``status`` is the HTTP status the decode server answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class KVHandoff:
    """One room's K/V as the prefill server computed them: positions ``[0, num_tokens)``.

    ``input_ids`` are the tokens prefill computed (the one-token placeholder under the defect);
    ``src_pages`` and ``request_id`` are the prefill side's half of the manifest.
    """

    room: int
    tenant: str
    request_id: int
    input_ids: tuple[int, ...]
    src_pages: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    #: The prefill server's Adler-32 digest of the rows (``kv_digest``); None without ``--kv-checksum``.
    checksum: int | None = None

    @property
    def num_tokens(self) -> int:
        """Return how many positions the hand-off carries."""
        return len(self.input_ids)

    def header(self) -> dict[str, Any]:
        """Return the JSON header that goes before the tensors' bytes."""
        return {
            "status": 200,
            "room": self.room,
            "tenant": self.tenant,
            "request_id": self.request_id,
            "num_tokens": self.num_tokens,
            "src_pages": list(self.src_pages),
            "input_ids": list(self.input_ids),
            "head_dim": int(self.k.shape[1]),
            **({"kv_checksum": self.checksum} if self.checksum is not None else {}),
        }


def kv_digest(k: torch.Tensor, v: torch.Tensor) -> int:
    """Return the Adler-32 digest of the K rows' bytes followed by the V rows' (float32, row order):
    what both sides of a hand-off compute, the prefill server over its pages and the decode server
    over what it received."""
    return zlib.adler32(_bytes_of(v), zlib.adler32(_bytes_of(k)))


def flip_signs(rows: torch.Tensor, count: int) -> torch.Tensor:
    """Return a copy of ``rows`` whose first ``count`` rows have the sign bit of every value flipped
    (the bug zoo's ``pd-transfer-corrupt``: bytes of a hand-off altered on their way)."""
    flipped = rows.clone()
    flipped[:count] = -flipped[:count]
    return flipped


#: What a staged room's ``on_done`` hears: True when the decode server received every byte, False
#: when the transfer failed or nobody asked in time, or the decode server's status when it refused.
Outcome = bool | int


@dataclass
class _Staged:
    handoff: KVHandoff
    on_done: Callable[[Outcome], None]
    expiry: threading.Timer


class RoomTable:
    """The prefill server's rooms: staged hand-offs waiting for their decode server, and refusals.

    ``on_done`` of a staged room is called exactly once with its :data:`Outcome`: True when the
    decode server received every byte, False when the transfer failed or nobody asked within
    ``timeout`` seconds, the decode server's status when it abandoned the room.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._changed = threading.Condition()
        self._staged: dict[int, _Staged] = {}
        self._refused: dict[int, tuple[float, int, str]] = {}
        # Rooms a decode server abandoned before prefill staged them: (until when, its status).
        self._abandoned: dict[int, tuple[float, int]] = {}

    def stage(self, handoff: KVHandoff, on_done: Callable[[Outcome], None]) -> None:
        """Offer ``handoff`` to the decode server that asks for its room."""
        expiry = threading.Timer(self.timeout, self._expire, (handoff.room,))
        expiry.daemon = True
        with self._changed:
            abandoned = self._abandoned.pop(handoff.room, None)
            if abandoned is None:
                self._staged[handoff.room] = _Staged(handoff, on_done, expiry)
                self._changed.notify_all()
        if abandoned is not None:
            on_done(abandoned[1])
            return
        expiry.start()

    def abandon(self, room: int, status: int) -> None:
        """The room's decode server refused the request with ``status``: let go of its K/V now, or
        as soon as it is staged."""
        with self._changed:
            staged = self._staged.pop(room, None)
            if staged is None:
                now = time.monotonic()
                self._abandoned = {r: e for r, e in self._abandoned.items() if e[0] > now}
                self._abandoned[room] = (now + self.timeout, status)
        if staged is not None:
            staged.expiry.cancel()
            staged.on_done(status)

    def refuse(self, room: int, status: int, message: str) -> None:
        """Answer the room's decode server with ``status`` (the prefill server refused the request)."""
        with self._changed:
            now = time.monotonic()
            self._refused = {r: e for r, e in self._refused.items() if e[0] > now}
            self._refused[room] = (now + self.timeout, status, message)
            self._changed.notify_all()

    def take(self, room: int, timeout: float) -> _Staged:
        """Return the room's staged hand-off, waiting up to ``timeout`` seconds for it to be staged;
        raise ``HandoffFailed`` for a refused room or when the wait runs out."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: room in self._staged or room in self._refused, timeout=timeout
            )
            if not found:
                raise HandoffFailed(500, f"KV bootstrap room {room} was not staged in {timeout:g} s")
            if room in self._refused:
                _, status, message = self._refused.pop(room)
                raise HandoffFailed(status, message)
            staged = self._staged.pop(room)
        staged.expiry.cancel()
        return staged

    def _expire(self, room: int) -> None:
        with self._changed:
            staged = self._staged.pop(room, None)
        if staged is not None:
            log.warning("KV room %d: no decode server asked within %g s", room, self.timeout)
            staged.on_done(False)


class _BootstrapHandler(socketserver.BaseRequestHandler):
    server: BootstrapServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.server.rooms.timeout)
        try:
            magic, version, room = _ASK.unpack(_read_exactly(sock, _ASK.size))
            if magic == ABANDON_MAGIC and version == VERSION:
                (status,) = _STATUS.unpack(_read_exactly(sock, _STATUS.size))
                self.server.rooms.abandon(room, status)
                return
        except (OSError, HandoffFailed, struct.error):
            return
        if magic != MAGIC or version != VERSION:
            _send_header(sock, {"status": 500, "message": f"unknown hand-off protocol {magic!r} v{version}"})
            return
        try:
            staged = self.server.rooms.take(room, self.server.rooms.timeout)
        except HandoffFailed as failed:
            _send_header(sock, {"status": failed.status, "message": failed.message, "room": room})
            return
        sent = False
        try:
            handoff = staged.handoff
            _send_header(sock, handoff.header(), _bytes_of(handoff.k) + _bytes_of(handoff.v))
            sent = _read_exactly(sock, 1) == _DONE
        except (OSError, HandoffFailed) as exc:
            log.warning("KV room %d: hand-off to the decode server failed: %s", room, exc)
        finally:
            staged.on_done(sent)


class BootstrapServer(socketserver.ThreadingTCPServer):
    """The prefill server's listener for decode servers, one thread per connection."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], rooms: RoomTable) -> None:
        super().__init__(address, _BootstrapHandler, bind_and_activate=True)
        self.rooms = rooms
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvcanary-bootstrap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self.shutdown()
        self.server_close()


def fetch_kv(host: str, port: int, room: int, timeout: float) -> KVHandoff:
    """Fetch ``room``'s K/V from the prefill server at ``host:port`` (the decode side).

    Raises ``HandoffFailed`` with the prefill server's status when it refused the room, or 500 when
    it cannot be reached or does not answer within ``timeout`` seconds (SGLang's bootstrap failure).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_ASK.pack(MAGIC, VERSION, room))
            header = _read_header(sock)
            if header.get("status") != 200:
                raise HandoffFailed(int(header.get("status", 500)), str(header.get("message", "")))
            handoff = _read_handoff(sock, header, room)
            sock.sendall(_DONE)
            return handoff
    except OSError as exc:
        raise HandoffFailed(500, f"KV transfer from {host}:{port} failed for room {room}: {exc}") from None


def abandon_room(host: str, port: int, room: int, status: int, timeout: float) -> None:
    """Tell the prefill server at ``host:port`` that this decode server refused ``room``'s request
    with ``status`` (best effort: unreachable, the prefill server lets go when the room expires)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_ASK.pack(ABANDON_MAGIC, VERSION, room) + _STATUS.pack(status))
    except OSError as exc:
        log.info("KV room %d: could not tell %s:%d it was refused: %s", room, host, port, exc)


def _read_handoff(sock: socket.socket, header: dict[str, Any], room: int) -> KVHandoff:
    num_tokens, head_dim = int(header["num_tokens"]), int(header["head_dim"])
    input_ids = tuple(int(t) for t in header["input_ids"])
    if header.get("room") != room or len(input_ids) != num_tokens:
        raise HandoffFailed(500, f"KV hand-off for room {room} answered with room {header.get('room')}")
    checksum = header.get("kv_checksum")
    if checksum is not None and (isinstance(checksum, bool) or not isinstance(checksum, int)):
        raise HandoffFailed(500, f"KV hand-off for room {room} carried a digest that is no integer")
    size = num_tokens * head_dim * 4
    payload = _read_exactly(sock, 2 * size)
    k = torch.frombuffer(bytearray(payload[:size]), dtype=torch.float32).view(num_tokens, head_dim)
    v = torch.frombuffer(bytearray(payload[size:]), dtype=torch.float32).view(num_tokens, head_dim)
    return KVHandoff(
        room=room,
        tenant=str(header["tenant"]),
        request_id=int(header["request_id"]),
        input_ids=input_ids,
        src_pages=tuple(int(p) for p in header["src_pages"]),
        k=k,
        v=v,
        checksum=checksum,
    )


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def _send_header(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_ANSWER.pack(MAGIC, len(body)) + body + payload)


def _read_header(sock: socket.socket) -> dict[str, Any]:
    magic, length = _ANSWER.unpack(_read_exactly(sock, _ANSWER.size))
    if magic != MAGIC or length > _MAX_HEADER:
        raise HandoffFailed(500, f"not a KV hand-off answer ({magic!r}, {length} bytes)")
    header: dict[str, Any] = json.loads(_read_exactly(sock, length))
    return header


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    """Return exactly ``size`` bytes; raise ``HandoffFailed`` when the peer closes first."""
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise HandoffFailed(500, f"the peer closed the KV hand-off with {left} of {size} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
