"""The server's one error format and mapping (``meshrl.engines.serve_http``): the same failure gets the
same status and the same body from SGLang's ``/generate`` and OpenAI's ``/v1/completions``, and
aiohttp's own errors are that body too, on every path."""

from __future__ import annotations

import asyncio

import pytest
import tiny
from aiohttp import web
from serving import app_session

from meshrl.engines import TorchEngine, TorchEngineConfig
from meshrl.engines.serve import make_app
from meshrl.engines.serve_http import BadRequest, errors, status_of


def _shape(status: int, body: dict) -> tuple:
    """What must not differ between the servers: the keys, the type and the code."""
    return status, set(body), set(body["error"]), body["error"]["type"], body["error"]["code"]


async def _call(s, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with s.request(method, path, json=body) as r:
        assert r.content_type == "application/json", (path, r.status, await r.text())
        return r.status, await r.json()


def test_one_exception_to_status_mapping():
    assert [status_of(e) for e in (BadRequest("x"), ValueError("x"), TimeoutError("x"), asyncio.TimeoutError(),
                                   RuntimeError("x"), KeyError("x"))] == [400, 400, 504, 504, 503, 500]


def test_aiohttp_errors_and_bad_requests_are_json_on_every_path():
    async def bad(request: web.Request) -> web.Response:
        raise BadRequest("/bad: field x is wrong")

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    async def main():
        app = web.Application(middlewares=[errors])
        app.router.add_post("/bad", bad)
        app.router.add_post("/v1/one", ok)
        app.router.add_get("/v1/two", ok)
        async with app_session(app) as (s, _):
            return [await _call(s, *call) for call in
                    [("POST", "/bad"), ("GET", "/nope"), ("GET", "/v1/nope"), ("GET", "/bad"), ("GET", "/v1/one")]]

    (refused, missing, missing_v1, method, method_v1) = asyncio.run(main())
    assert refused == (400, {"error": {"message": "/bad: field x is wrong", "type": "invalid_request_error", "param": None,
                                   "code": 400}})
    assert missing[0] == 404 and missing[1]["error"]["message"] == "GET /nope: no such endpoint"
    assert missing_v1[1]["error"]["message"] == "GET /v1/nope: no such endpoint (this server has /v1/one and /v1/two)"
    assert method[0] == method_v1[0] == 405 and "method not allowed (use POST)" in method[1]["error"]["message"]
    for status, body in (missing, missing_v1, method, method_v1):
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == status and body["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def hf():
    return tiny.hf_model(tiny.qwen2(hidden_size=64), sharp=6.0)


def test_both_servers_answer_the_same_failure_alike(hf):
    """A prompt past ``max_seq_len`` (the engine's own check: 400) and a generation while the memory is
    released (503), on ``/generate`` and ``/v1/completions``: one status and one body format."""
    engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=4, max_seq_len=32))
    long = [5] * 40

    async def main():
        async with app_session(make_app(engine, hf_tokenizer=None)) as (s, _):
            out = [await _call(s, "POST", "/generate", {"input_ids": long, "sampling_params": {"max_new_tokens": 2}}),
                   await _call(s, "POST", "/v1/completions", {"prompt": long, "max_tokens": 2})]
            assert (await _call(s, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}))[0] == 200
            out += [await _call(s, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}),
                    await _call(s, "POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})]
            await _call(s, "POST", "/resume_memory_occupation", {})
            return out

    sglang_long, openai_long, sglang_released, openai_released = asyncio.run(main())
    assert _shape(*sglang_long) == _shape(*openai_long) == (
        400, {"error"}, {"message", "type", "param", "code"}, "invalid_request_error", 400)
    assert "max_seq_len" in sglang_long[1]["error"]["message"] and "max_seq_len" in openai_long[1]["error"]["message"]
    assert _shape(*sglang_released) == _shape(*openai_released) == (
        503, {"error"}, {"message", "type", "param", "code"}, "server_error", 503)
