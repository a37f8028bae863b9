"""``meshrl.mesh.channel``: framed messages over a real TCP connection on 127.0.0.1, each wait bounded.

The serving side runs on an asyncio loop in a thread (as in a ``LaneRollout``'s event loop), the
connecting side blocks (as in a ``LaneTrainer``'s thread).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from meshrl.mesh.channel import Channel, ChannelClosed, read_message, serve, write_message


class EchoServer:
    """Answers each message with its payload reversed under the same kind and tag; kind 9 closes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.port = asyncio.run_coroutine_threadsafe(serve("127.0.0.1", self._on), self.loop).result(10)

    async def _on(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                kind, tag, payload = await read_message(reader)
                if kind == 9:
                    break
                if kind == 8:  # answer late
                    await asyncio.sleep(1.0)
                write_message(writer, kind, tag, payload[::-1])
                await writer.drain()
        except ChannelClosed:
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def test_messages_of_any_size_go_through_whole_and_in_order(echo):
    ch = Channel("127.0.0.1", echo.port, timeout_s=10, what="the echo server")
    big = bytes(range(256)) * (3 * 4096 + 7)  # 3 MB and a bit: many socket reads, a payload in parts
    ch.send(3, -5, [big[:1000], memoryview(big)[1000:]])
    ch.send(4, 1 << 40, [])
    assert ch.receive(10, "the big echo") == (3, -5, big[::-1])
    kind, tag, payload = ch.receive(10, "the empty echo")
    assert (kind, tag, bytes(payload)) == (4, 1 << 40, b"")
    ch.close()


def test_a_late_answer_times_out_naming_what_was_awaited(echo):
    ch = Channel("127.0.0.1", echo.port, timeout_s=10, what="the echo server")
    ch.send(8, 1, [b"slow"])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"gave up after 0s waiting for the slow reply from the echo server"):
        ch.receive(0.2, "the slow reply")
    assert time.monotonic() - t0 < 0.9
    ch.close()


def test_a_peer_that_closes_fails_the_wait_at_once(echo):
    ch = Channel("127.0.0.1", echo.port, timeout_s=10, what="the echo server")
    ch.send(9, 0, [])
    t0 = time.monotonic()
    with pytest.raises(ChannelClosed, match="the echo server closed the channel while this side waited for a reply"):
        ch.receive(30, "a reply")
    assert time.monotonic() - t0 < 5
    ch.close()


def test_connecting_to_no_server_says_where():
    with pytest.raises(ConnectionError, match=r"could not connect to the lane at 127\.0\.0\.1:1"):
        Channel("127.0.0.1", 1, timeout_s=2, what="the lane")
