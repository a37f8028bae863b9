"""``SGLangEngine``'s HTTP client against real servers on 127.0.0.1: the TorchEngine server in this
process, and raw sockets that misbehave as a broken proxy or server would. What is checked beyond
``test_sglang_engine.py``: control calls are never starved by generations filling the pool, and
every failure names the call it was waiting for."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiohttp import web

import tiny
from meshrl.engines import GenerateRequest, SamplingParams
from meshrl.engines.serve import make_app
from meshrl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
from test_serve import make_engine


def _engine():
    """test_serve's engine, on a fresh copy of its model."""
    return make_engine(tiny.hf_model(tiny.qwen2(hidden_size=64), sharp=6.0))


@contextlib.asynccontextmanager
async def serving(engine):
    runner = web.AppRunner(make_app(engine, server_args={"host": "127.0.0.1"}))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_a_pause_gets_through_while_generations_fill_the_pool():
    """max_connections generations held on the server (paused in place): the pause of a weight sync
    must still reach it; it used to wait for a pooled connection until its timeout."""
    async def main():
        engine = _engine()
        async with serving(engine) as url:
            client = SGLangEngine(url, config=SGLangEngineConfig(max_connections=2, request_timeout_s=5.0))
            try:
                await client.pause("keep")
                reqs = [GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=20)) for _ in range(3)]
                rollout = asyncio.ensure_future(client.generate(reqs))
                while len(engine._waiting) < 2:  # two are on the server; the third waits for a slot
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                await client.pause("abort")
                paused_in = time.monotonic() - t0
                await client.resume()
                results = await asyncio.wait_for(rollout, 30)
                return paused_in, results
            finally:
                await client.close()

    paused_in, results = asyncio.run(main())
    assert paused_in < 2.0
    assert [r.completions[0].finish_reason for r in results[:2]] == ["abort", "abort"]
    assert results[2].completions[0].finish_reason == "length"  # sent after the pause ended


@pytest.mark.parametrize("reply, error, needle, attempts", [
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"version\": \"0.5",
     ConnectionError, "ClientPayloadError", 4),  # cut short: retried (a safe call), then named
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{version:",
     RuntimeError, "the reply is not valid JSON", 1),
])
def test_broken_replies_fail_naming_the_call(reply, error, needle, attempts):
    async def main():
        hits = []

        async def handle(reader, writer):
            hits.append(1)
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = SGLangEngine(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",
                              config=SGLangEngineConfig(request_timeout_s=5, retry_backoff_s=0.01))
        try:
            with pytest.raises(error, match=needle) as info:
                await client.server_version()
            return str(info.value), len(hits)
        finally:
            await client.close()
            server.close()

    message, hits = asyncio.run(main())
    assert "GET http://127.0.0.1:" in message and "/get_server_info" in message and hits == attempts


def test_samples_of_an_n_request_are_named_and_aborted_the_sglang_way():
    """SGLang gives the samples of an n > 1 request fresh ids of its own and forgets the request's rid,
    so no abort reaches them (this server does the same). The adapter sends the n samples as a batch
    of n prompts with ids of its own, ``{rid}_{i}``, and aborts those."""
    async def main():
        engine = _engine()
        async with serving(engine) as url:
            client = SGLangEngine(url, config=SGLangEngineConfig(request_timeout_s=10.0))
            try:
                long = SamplingParams(max_new_tokens=70, temperature=1.0, n=3, ignore_eos=True)
                run = asyncio.ensure_future(client.generate([GenerateRequest(input_ids=[1, 2], request_id="job", sampling=long)]))
                while not engine.is_running("job_0") or engine.steps < 2:
                    await asyncio.sleep(0.01)
                assert [engine.is_running(f"job_{i}") for i in range(3)] == [True] * 3 and not engine.is_running("job")
                await client.abort("job")
                (aborted,) = await asyncio.wait_for(run, 30)
                # a raw n > 1 request, as SGLang runs it: fresh sample ids, and its own rid reaches nothing
                raw = asyncio.ensure_future(client.request("POST", "/generate", {
                    "input_ids": [3, 4], "rid": "ids", "sampling_params": {"max_new_tokens": 40, "n": 2,
                                                                           "ignore_eos": True}}))
                while not engine.is_running("ids"):
                    await asyncio.sleep(0.01)
                await client.abort("ids")  # not in flight as far as the adapter knows: n = 1, one abort of "ids"
                status, reply = await asyncio.wait_for(raw, 30)
                return aborted, status, reply
            finally:
                await client.close()

    aborted, status, reply = asyncio.run(main())
    assert [c.finish_reason for c in aborted.completions] == ["abort"] * 3
    assert all(len(c.output_ids) < 70 for c in aborted.completions)
    ids = [o["meta_info"]["id"] for o in reply]
    assert status == 200 and len(set(ids)) == 2 and not any(i.startswith("ids") for i in ids)
    assert [o["meta_info"]["finish_reason"]["type"] for o in reply] == ["length", "length"]


def test_a_generation_that_never_got_a_slot_says_so():
    async def main():
        engine = _engine()
        async with serving(engine) as url:
            client = SGLangEngine(url, config=SGLangEngineConfig(max_connections=1, generate_timeout_s=30.0))
            try:
                await client.pause("keep")
                held = asyncio.ensure_future(client.generate([GenerateRequest(
                    input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=4))]))
                while not engine._waiting:
                    assert not held.done(), held
                    await asyncio.sleep(0.01)
                with pytest.raises(TimeoutError, match="no free slot within 0.5s .*not sent"):
                    await client.request("POST", "/generate", {"input_ids": [3]}, timeout_s=0.5)
                await client.pause("abort")  # ends the held one
                assert (await held)[0].completions[0].finish_reason == "abort"
            finally:
                await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("n", [1, 2])
def test_samples_a_pause_aborts_are_sent_again_whole(n):
    """A weight sync's abort-mode pause ends the samples in flight: SGLang answers a single-prompt
    request with 499 "Request <rid> was aborted" (n = 1, seen on 0.5.17) and a batch with an abort
    in each output (n > 1). With reissue_aborted each is sent again and comes back whole, from
    the weights served after the pause, counted once in ``reissued``."""
    async def main():
        engine = _engine()
        async with serving(engine) as url:
            client = SGLangEngine(url, config=SGLangEngineConfig(request_timeout_s=10.0, reissue_aborted=2))
            try:
                sampling = SamplingParams(max_new_tokens=40, temperature=1.0, n=n, ignore_eos=True, seed=3)
                run = asyncio.ensure_future(client.generate([GenerateRequest(input_ids=[1, 2], sampling=sampling)]))
                while engine.num_running < n or engine.steps < 3:
                    await asyncio.sleep(0.01)
                await client.pause("abort")
                await asyncio.sleep(0.2)  # the re-issued samples wait for the pause to end
                assert not run.done()
                await client.resume()
                (result,) = await asyncio.wait_for(run, 30)
                return result, client.reissued
            finally:
                await client.close()

    result, reissued = asyncio.run(main())
    assert [c.finish_reason for c in result.completions] == ["length"] * n
    assert all(len(c.output_ids) == 40 == len(c.logprobs) for c in result.completions)
    assert reissued == n
