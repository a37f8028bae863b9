"""A direct channel between two actors: framed messages over one TCP connection, each wait bounded.

A Ray actor call costs about a millisecond of CPU on a 2-core machine (the caller's and the
callee's core-worker threads, serialisation, the event loop): nothing beside a step of a second,
a third of a step of a few milliseconds. Two roles that trade a message every step talk over one
of these instead (``run.loops=roles``): one side serves from its async actor's event loop
(``serve``), the other connects from its sync actor's thread (``Channel``), and Ray still starts,
places and supervises both. It works across nodes (the server listens on the node's routable
address).

A message is a header (kind: one byte, tag: a signed 64-bit integer, payload length: 64 bits)
and the payload's bytes. The kinds and what a tag means are the two sides' business.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Awaitable, Callable, Sequence

__all__ = ["Channel", "ChannelClosed", "read_message", "serve", "write_message"]

HEADER = struct.Struct("!BqQ")
MAX_PAYLOAD = 1 << 40


class ChannelClosed(ConnectionError):
    """The other side closed the channel (or its process died) while this side waited on it."""


async def serve(host: str, on_connect: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                ) -> tuple[asyncio.AbstractServer, int]:
    """Listen on ``host`` (a free port); ``on_connect`` runs for each connection, on this event loop."""
    server = await asyncio.start_server(on_connect, host, 0, limit=1 << 20)
    return server, server.sockets[0].getsockname()[1]


async def read_message(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """The next message (kind, tag, payload); ``ChannelClosed`` when the peer is gone."""
    try:
        kind, tag, size = HEADER.unpack(await reader.readexactly(HEADER.size))
        return kind, tag, await reader.readexactly(size) if size else b""
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelClosed(f"the channel's peer closed it: {exc}") from None


def write_message(writer: asyncio.StreamWriter, kind: int, tag: int, payload: bytes = b"") -> None:
    """Queue one message on ``writer`` (the caller drains when it must bound its buffer)."""
    header = HEADER.pack(kind, tag, len(payload))
    if len(payload) < 65536:  # one small write; a large payload is not copied into a joined buffer
        writer.write(header + payload)
    else:
        writer.write(header)
        writer.write(payload)


class Channel:
    """The connecting side, blocking: for a sync actor's thread (module docstring)."""

    def __init__(self, host: str, port: int, *, timeout_s: float, what: str) -> None:
        """``what`` names the peer in errors ("the rollout worker's lane"); ``timeout_s`` bounds the
        connect and each send (a peer that stops reading)."""
        self.what, self.timeout_s = what, timeout_s
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ConnectionError(f"could not connect to {what} at {host}:{port}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._header = bytearray(HEADER.size)

    def send(self, kind: int, tag: int, parts: Sequence[bytes | memoryview] = ()) -> None:
        """One message whose payload is ``parts`` joined (sent without joining them)."""
        size = sum(memoryview(p).nbytes for p in parts)
        buffers = [HEADER.pack(kind, tag, size), *parts]
        try:
            self._sock.settimeout(self.timeout_s)
            while buffers:
                sent = self._sock.sendmsg(buffers)
                while buffers and sent >= memoryview(buffers[0]).nbytes:
                    sent -= memoryview(buffers[0]).nbytes
                    buffers.pop(0)
                if sent:
                    buffers[0] = memoryview(buffers[0]).cast("B")[sent:]
        except socket.timeout:
            raise TimeoutError(f"gave up after {self.timeout_s:.0f}s sending to {self.what}: it reads nothing") from None
        except OSError as exc:
            raise ChannelClosed(f"sending to {self.what} failed: {exc}") from None
        finally:
            self._sock.settimeout(None)

    def receive(self, timeout_s: float, waiting_for: str) -> tuple[int, int, bytes]:
        """The next message (kind, tag, payload), within ``timeout_s``; the error names what was awaited."""
        self._sock.settimeout(timeout_s)
        try:
            self._read_into(memoryview(self._header), waiting_for, timeout_s)
            kind, tag, size = HEADER.unpack(self._header)
            if size > MAX_PAYLOAD:
                raise ChannelClosed(f"{self.what} sent a message of {size} bytes: the channel is out of step")
            payload = bytearray(size)
            self._read_into(memoryview(payload), waiting_for, timeout_s)
            return kind, tag, payload
        finally:
            self._sock.settimeout(None)

    def _read_into(self, view: memoryview, waiting_for: str, timeout_s: float) -> None:
        got = 0
        while got < len(view):
            try:
                n = self._sock.recv_into(view[got:])
            except socket.timeout:
                raise TimeoutError(f"gave up after {timeout_s:.0f}s waiting for {waiting_for} from {self.what}") from None
            except OSError as exc:
                raise ChannelClosed(f"{self.what} closed the channel while this side waited for {waiting_for}: "
                                    f"{exc}") from None
            if n == 0:
                raise ChannelClosed(f"{self.what} closed the channel while this side waited for {waiting_for}")
            got += n

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
