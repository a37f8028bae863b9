"""The OpenAI endpoints' edges over real HTTP on 127.0.0.1, on a real TorchEngine: requests they
must refuse with a 400 naming the field, states they must answer with OpenAI's error object, and
work they must stop as soon as nobody needs it (a client gone, a stop string met).

Most engines here have no EOS (``eos_ids=()``), so that a request runs to its length unless
something stops it: a check that counts decode steps then tells "stopped early" from "ran on".
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
import torch
from transformers import AutoTokenizer

import tiny
from meshrl.engines import TorchEngine, TorchEngineConfig
from meshrl.engines.serve import make_app
from meshrl.engines.weights import iter_safetensors, load_hf_config
from serving import app_session

torch.set_num_threads(1)
CHAT = [{"role": "user", "content": "1+2="}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Qwen2 with the char tokenizer and a 1024-token context (room for long answers)."""
    return tiny.model_dir(tmp_path_factory.mktemp("openai_errors") / "model", positions=1024)


@contextlib.asynccontextmanager
async def serve(model_dir: str, config: TorchEngineConfig = TorchEngineConfig(max_batch_size=4), *, eos: bool = False,
                **kwargs):
    """A server on a free port: ``(session, engine, port)``; no EOS unless ``eos``."""
    if eos:
        engine = TorchEngine.from_pretrained(model_dir, config)
    else:
        engine = TorchEngine(load_hf_config(model_dir), iter_safetensors(model_dir), config, eos_ids=(),
                             model_path=model_dir)
    async with app_session(make_app(engine, **kwargs)) as (session, port):
        yield session, engine, port


async def post(s: aiohttp.ClientSession, path: str, body) -> tuple[int, dict]:
    async with s.post(path, json=body) as r:
        return r.status, await r.json()


async def until(predicate, limit_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not within {limit_s} s"
        await asyncio.sleep(0.02)


def _pumps() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "Merged._pump"]


async def open_stream_and_drop(port: int, path: str, body: dict, engine: TorchEngine, *, pause: bool) -> int:
    """POST a streamed request on a raw socket, read three events, (pause in place,) then hang up;
    the engine's decode step count at the hang-up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps({**body, "stream": True}).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (path.encode(), len(data)) + data)
    await writer.drain()
    events = 0
    while events < 3:
        line = await asyncio.wait_for(reader.readline(), 10)
        assert line, "the server closed the stream early"
        events += line.startswith(b"data: ")
    if pause:
        await engine.pause("keep")
    steps = engine.steps
    writer.close()
    await writer.wait_closed()
    return steps


@pytest.mark.parametrize("pause", [False, True], ids=["running", "paused"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
def test_a_streaming_client_that_hangs_up_has_its_request_aborted_at_once(model_dir, path, pause):
    """Streamed OpenAI chat and SGLang /generate: a client that hangs up mid-stream (tokens flowing,
    or paused in place) frees its batch row within a few steps, not at max_tokens, and leaves no
    reader task behind. (On Python 3.11 the readers' cancellation could be swallowed, and the
    request ran on to its end.)"""
    body = {"messages": CHAT, "max_tokens": 900} if path.startswith("/v1/") \
        else {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 900}}

    async def main():
        async with serve(model_dir) as (s, engine, port):
            for _ in range(2):
                at_drop = await open_stream_and_drop(port, path, body, engine, pause=pause)
                await until(lambda: not (engine.num_running or engine.num_waiting), 60, "idle")
                assert engine.steps - at_drop < 100, engine.steps - at_drop
                await until(lambda: not _pumps(), 5, "the readers' end")
                await engine.resume()
            st, out = await post(s, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
            assert st == 200 and len(out["choices"][0]["token_ids"]) == 3

    asyncio.run(main())


def test_a_stop_string_of_several_tokens_ends_a_plain_request_early(model_dir):
    """Not streamed, a stop string of two tokens ends generation when it appears (as streamed), not
    at max_tokens: the answer is the same as cutting the free one, for a fraction of the steps."""
    tok = AutoTokenizer.from_pretrained(model_dir)

    def text_of(path: str, choice: dict) -> str:
        return choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]

    async def main():
        async with serve(model_dir) as (s, engine, _):
            out = []
            for path, body in [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "1+2="})]:
                body = {**body, "temperature": 0}
                free = text_of(path, (await post(s, path, {**body, "max_tokens": 12}))[1]["choices"][0])
                steps = engine.steps
                got = await post(s, path, {**body, "max_tokens": 900, "stop": [free[4:6]]})
                out.append((path, free, got, engine.steps - steps))
            # a client that gives up on such a request has it aborted, as without stop strings
            await engine.pause("keep")
            with pytest.raises(asyncio.TimeoutError):
                async with s.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "stop": ["ab"]},
                                  timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
            await until(lambda: not (engine.num_running or engine.num_waiting), 10, "the dropped request's abort")
            await engine.resume()
            return out

    for path, free, (st, got), steps in asyncio.run(main()):
        c, stop = got["choices"][0], free[4:6]
        cut = free.find(stop)
        assert st == 200 and c["finish_reason"] == "stop", (path, got)
        assert steps < 50, (path, steps)  # 900 when generation ran on to max_tokens
        assert text_of(path, c) == free[:cut]
        assert tok.decode(c["token_ids"]) == free[: cut + len(stop)]  # ids end with the token completing it
        assert len(c["meshrl"]["logprobs"]) == len(c["meshrl"]["versions"]) == len(c["token_ids"])
        assert got["usage"]["completion_tokens"] == len(c["token_ids"])


def test_default_max_tokens_fill_the_context_for_chat_and_are_16_for_completions(model_dir):
    """OpenAI (and vLLM): a chat answer without max_tokens may run to the end of the context, not
    128 tokens; the legacy /v1/completions endpoint's default is 16."""

    async def main():
        async with serve(model_dir, TorchEngineConfig(max_batch_size=4, max_seq_len=200)) as (s, _, _):
            chat = await post(s, "/v1/chat/completions", {"messages": CHAT, "temperature": 0})
            legacy = await post(s, "/v1/completions", {"prompt": "1+2=", "temperature": 0})
            return chat, legacy

    (st, chat), (st2, legacy) = asyncio.run(main())
    c = chat["choices"][0]
    assert st == 200 and c["finish_reason"] == "length" and len(c["token_ids"]) == 200 - len(c["prompt_token_ids"])
    assert st2 == 200 and len(legacy["choices"][0]["token_ids"]) == 16


def test_released_memory_is_a_503_with_openai_error_object(model_dir):
    """While a colocated trainer holds the device (/release_memory_occupation) /v1/* answer 503 with
    OpenAI's error object, as /generate does, streamed or not, stop strings or not; then serve again."""
    chat = {"messages": CHAT, "max_tokens": 2}

    async def main():
        async with serve(model_dir) as (s, _, _):
            assert (await post(s, "/release_memory_occupation", {}))[0] == 200
            out = [await post(s, "/v1/chat/completions", chat),
                   await post(s, "/v1/chat/completions", {**chat, "stream": True}),
                   await post(s, "/v1/chat/completions", {**chat, "stop": ["ab"]}),
                   await post(s, "/v1/completions", {"prompt": "1+2=", "max_tokens": 2})]
            assert (await post(s, "/resume_memory_occupation", {}))[0] == 200
            return out, await post(s, "/v1/chat/completions", chat)

    out, (st, after) = asyncio.run(main())
    for status, body in out:
        assert status == 503 and body["error"]["type"] == "server_error", body
        assert "released" in body["error"]["message"]
    assert st == 200 and len(after["choices"][0]["token_ids"]) == 2


def refused(model_dir: str, cases: list[tuple[str, dict, str]], **kwargs) -> None:
    """Each ``(path, body, words)`` is a 400 with OpenAI's error object whose message holds ``words``."""

    async def main():
        async with serve(model_dir, eos=True, **kwargs) as (s, _, _):
            return [await post(s, path, {**body, "max_tokens": 2}) for path, body, _ in cases]

    for (path, body, want), (st, out) in zip(cases, asyncio.run(main())):
        assert st == 400 and want in out["error"]["message"], (path, body, st, out)


def accepted(model_dir: str, cases: list[tuple[str, dict]], **kwargs) -> list[dict]:
    async def main():
        async with serve(model_dir, eos=True, **kwargs) as (s, _, _):
            return [await post(s, path, {**body, "max_tokens": 2}) for path, body in cases]

    answers = asyncio.run(main())
    assert all(st == 200 for st, _ in answers), answers
    return [out for _, out in answers]


USER = {"role": "user", "content": "hi"}


def test_a_chat_template_that_refuses_the_messages_is_a_400_with_its_words(model_dir):
    """Gemma's template refuses a system role, Llama-2's and Mistral's roles that do not alternate
    (``raise_exception``): the client's mistake, so a 400 with the template's message, not a 500.
    Without a template, the simple one takes OpenAI's roles only."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    refused(model_dir, [("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"}, USER]},
                         "System role not supported"),
                        ("/v1/chat/completions", {"messages": [USER, USER]}, "roles must alternate")], hf_tokenizer=tok)
    accepted(model_dir, [("/v1/chat/completions", {"messages": [USER]})], hf_tokenizer=tok)
    wizard = {"role": "wizard", "content": "hi"}
    refused(model_dir, [("/v1/chat/completions", {"messages": [wizard]}, "unknown roles ['wizard']")])
    accepted(model_dir, [("/v1/chat/completions", {"messages": [{"role": "tool", "content": "4"}, USER]})])


def test_a_stop_of_the_wrong_type_is_a_400_naming_stop(model_dir):
    """A string or a list of strings; a number or a boolean was a 500, an object silently its keys."""
    refused(model_dir, [(path, {**body, "stop": stop}, "stop must be")
                        for stop in (5, True, {"ab": 1}, [1], ["a", 2], "", ["a"] * 5)
                        for path, body in (("/v1/chat/completions", {"messages": [USER]}),
                                           ("/v1/completions", {"prompt": "hi"}))])


def test_logprobs_the_engine_cannot_serve_are_400s(model_dir):
    """The engine keeps the sampled token's log-prob alone: /v1/completions logprobs above 1 (or not
    an integer from 0) is refused, as chat's top_logprobs is, rather than answered without its
    alternatives; chat's logprobs is a boolean ("false" would be truthy)."""
    chat = "/v1/chat/completions"
    refused(model_dir, [*[("/v1/completions", {"prompt": "hi", "logprobs": lp}, "logprobs must be 0 or 1")
                          for lp in (5, 2, -1, "yes", True, 1.5)],
                        *[(chat, {"messages": [USER], "logprobs": lp}, "logprobs must be true or false")
                          for lp in ("false", "true", 1)],
                        (chat, {"messages": [USER], "logprobs": True, "top_logprobs": 2}, "top_logprobs")])
    zero, one, plain = accepted(model_dir, [("/v1/completions", {"prompt": "hi", "logprobs": 0}),
                                            ("/v1/completions", {"prompt": "hi", "logprobs": 1}),
                                            (chat, {"messages": [USER], "logprobs": False})])
    for out in (zero, one):
        c = out["choices"][0]
        assert c["logprobs"]["token_logprobs"] == c["meshrl"]["logprobs"]
        assert len(c["logprobs"]["top_logprobs"]) == len(c["token_ids"])
    assert plain["choices"][0]["logprobs"] is None


def test_openai_errors_and_defaults_on_every_v1_path(model_dir):
    """An unknown /v1/ path or method is OpenAI's error object (SDKs parse it), not aiohttp's text;
    ``tool_choice: "auto"`` with no tools means "none", and is accepted as such."""

    async def main():
        async with serve(model_dir, eos=True) as (s, _, _):
            async with s.get("/v1/nope") as r:
                missing = r.status, await r.json()
            async with s.get("/v1/chat/completions") as r:
                method = r.status, await r.json(), r.headers.get("Allow")
            return missing, method

    (st, missing), (st2, method, allow) = asyncio.run(main())
    assert st == 404 and "no such endpoint" in missing["error"]["message"]
    assert st2 == 405 and "method not allowed" in method["error"]["message"] and allow == "POST"
    accepted(model_dir, [("/v1/chat/completions", {"messages": [USER], "tool_choice": "auto"})])
    refused(model_dir, [("/v1/chat/completions", {"messages": [USER], "tool_choice": "required"}, "tool_choice")])
