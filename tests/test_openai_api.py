"""The OpenAI-compatible endpoints over real HTTP on 127.0.0.1, on a real TorchEngine.

What an agent framework gets must be enough to train on: the prompt and generated token ids, and
behaviour log-probs equal to the model's own log-probs of those tokens (checked against the HF
model), whatever the chat template or stop strings did to the text.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.engines.openai_api import render_simple_chat
from meshrl.engines.serve import make_app
from meshrl.modeling import pack, response_logprobs
from serving import app_session

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_2l):
    return tiny_model_2l


@contextlib.asynccontextmanager
async def serve(model_dir: str, engine_config: TorchEngineConfig = TorchEngineConfig(max_batch_size=8), **kwargs):
    engine = TorchEngine.from_pretrained(model_dir, engine_config)
    async with app_session(make_app(engine, **kwargs)) as (session, _):
        yield session, engine


async def post(s: aiohttp.ClientSession, path: str, body) -> tuple[int, dict]:
    async with s.post(path, json=body) as r:
        return r.status, await r.json()


def hf_logprobs(model_dir: str, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    packed = pack([prompt], [ids], pad_id=0)
    with torch.no_grad():
        return response_logprobs(hf(input_ids=packed.input_ids).logits, packed, temperature=temperature)[0]


def test_completions_return_trainable_token_ids_and_logprobs(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)

    async def main():
        async with serve(model_dir) as (s, engine):
            greedy = await post(s, "/v1/completions", {"model": "m", "prompt": "12+30=", "max_tokens": 6, "temperature": 0})
            direct = await engine.generate([GenerateRequest(input_ids=tok.encode("12+30="),
                                                            sampling=SamplingParams(max_new_tokens=6, temperature=0))])
            sampled = await post(s, "/v1/completions", {"prompt": [tok.encode("7+1="), tok.encode("3+3=")], "max_tokens": 5,
                                                        "temperature": 1.0, "n": 2, "seed": 3, "logprobs": 1})
            models = await (await s.get("/v1/models")).json()
            return greedy, direct, sampled, models

    (st, greedy), direct, (st2, sampled), models = asyncio.run(main())
    assert st == 200 and greedy["object"] == "text_completion" and greedy["model"] == "m"
    c = greedy["choices"][0]
    assert c["token_ids"] == direct[0].completions[0].output_ids and c["prompt_token_ids"] == tok.encode("12+30=")
    assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True) and c["finish_reason"] == "length"
    assert c["meshrl"]["versions"] == [0] * 6 and greedy["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}

    assert st2 == 200 and len(sampled["choices"]) == 4  # prompt-major: 2 prompts x n=2
    for choice in sampled["choices"]:
        want = hf_logprobs(model_dir, choice["prompt_token_ids"], choice["token_ids"], temperature=1.0)
        torch.testing.assert_close(torch.tensor(choice["meshrl"]["logprobs"]), want, atol=2e-4, rtol=0)
        lp = choice["logprobs"]
        assert lp["token_logprobs"] == choice["meshrl"]["logprobs"] and "".join(lp["tokens"]) == tok.decode(choice["token_ids"])
        assert lp["text_offset"][0] == 0 and len(lp["top_logprobs"]) == len(choice["token_ids"])
    assert sampled["choices"][0]["token_ids"] != sampled["choices"][1]["token_ids"]
    assert models["data"][0]["id"] == "model"  # the checkpoint folder's name


def test_chat_uses_the_template_or_a_simple_one_and_honours_stop_strings(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    templated = AutoTokenizer.from_pretrained(model_dir)
    templated.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]

    async def main():
        async with serve(model_dir) as (s, _):
            plain = await post(s, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 12,
                                                           "temperature": 0, "logprobs": True})
            free = plain[1]["choices"][0]["message"]["content"]
            stop_long, stop_one = free[1:3], free[1]  # a two-character and a one-character stop string
            long = await post(s, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0,
                                                          "stop": [stop_long]})
            one = await post(s, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0,
                                                         "stop": stop_one})
        async with serve(model_dir, hf_tokenizer=templated) as (s, _):
            tmpl = await post(s, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 3, "temperature": 0})
        return plain, long, one, tmpl, free, stop_long, stop_one

    (st, plain), (_, long), (_, one), (_, tmpl), free, stop_long, stop_one = asyncio.run(main())
    c = plain["choices"][0]
    assert st == 200 and plain["object"] == "chat.completion" and c["message"]["role"] == "assistant"
    assert c["prompt_token_ids"] == tok.encode(render_simple_chat(messages)) == tok.encode("system: add\nuser: 1+2=\nassistant:")
    assert len(c["logprobs"]["content"]) == len(c["token_ids"]) == 12
    assert [x["logprob"] for x in c["logprobs"]["content"]] == c["meshrl"]["logprobs"]
    want = hf_logprobs(model_dir, c["prompt_token_ids"], c["token_ids"], temperature=0.0)  # greedy: unscaled logits
    torch.testing.assert_close(torch.tensor(c["meshrl"]["logprobs"]), want, atol=2e-4, rtol=0)

    cut = long["choices"][0]
    i = free.find(stop_long)
    assert cut["message"]["content"] == free[:i] and cut["finish_reason"] == "stop"
    assert tok.decode(cut["token_ids"]) == free[: i + len(stop_long)]  # ids end with the token completing the stop
    early = one["choices"][0]
    assert early["message"]["content"] == free[: free.find(stop_one)] and early["finish_reason"] == "stop"
    assert tok.decode(early["token_ids"]) == free[: free.find(stop_one) + 1]  # one-token stop: the engine stopped there
    assert tmpl["choices"][0]["prompt_token_ids"] == tok.encode("[system]add[user]1+2=[assistant]", add_special_tokens=False)


def test_bad_requests_get_one_line_openai_errors(model_dir):
    async def main():
        async with serve(model_dir) as (s, _):
            out = []
            for path, body in [
                ("/v1/completions", {"prompt": "1+1=", "max_tokns": 3}),
                ("/v1/completions", {"prompt": "1+1=", "stream": True, "stream_options": {"include_usage": 1}}),
                ("/v1/completions", {"prompt": "1+1=", "max_tokens": 500}),
                ("/v1/completions", {"prompt": [1.5]}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
                ("/v1/chat/completions", {"messages": []}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
            ]:
                out.append(await post(s, path, body))
            async with s.post("/v1/completions", data=b"{not json") as r:
                out.append((r.status, await r.json()))
            return out

    answers = asyncio.run(main())
    assert all(st == 400 and set(body) == {"error"} and "\n" not in body["error"]["message"] for st, body in answers)
    messages = [body["error"]["message"] for _, body in answers]
    for got, want in zip(messages, ["unknown fields ['max_tokns']", "stream_options", "max_seq_len", "prompt must be",
                                    "tools=", "messages must be", "temperature", "not valid JSON"]):
        assert want in got, (want, got)


def test_chat_without_max_tokens_fits_the_context(model_dir):
    """No max_tokens means "up to the context" in OpenAI's API: the default must not overflow a short one."""
    messages = [{"role": "user", "content": "12+30="}]

    async def main():
        async with serve(model_dir) as (s, engine):
            return await post(s, "/v1/chat/completions", {"messages": messages, "temperature": 0}), engine.cache.max_seq_len

    (st, out), max_seq_len = asyncio.run(main())
    assert max_seq_len < len(render_simple_chat(messages)) + 128  # a fixed 128-token default would not fit
    assert st == 200, out
    c = out["choices"][0]
    room = max_seq_len - len(c["prompt_token_ids"])
    assert len(c["token_ids"]) == room if c["finish_reason"] == "length" else len(c["token_ids"]) < room


def test_aborted_and_timed_out_requests_are_not_reported_as_finished(model_dir):
    """A request aborted by /pause_generation (a weight update) says so rather than finish_reason "stop";
    one that outwaits generate_timeout_s on a paused engine gets an OpenAI error (504), not a bare 500."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def main():
        async with serve(model_dir, TorchEngineConfig(max_batch_size=8, generate_timeout_s=0.5)) as (s, engine):
            await post(s, "/pause_generation", {"mode": "in_place"})
            timed_out = await post(s, "/v1/chat/completions", body)
            waiting = asyncio.ensure_future(post(s, "/v1/chat/completions", body))
            while engine.num_waiting == 0:
                await asyncio.sleep(0.01)
            await post(s, "/pause_generation", {"mode": "abort"})
            aborted = await waiting
            await post(s, "/continue_generation", {})
            return timed_out, aborted

    (st, timed_out), (st2, aborted) = asyncio.run(main())
    assert st == 504 and timed_out["error"]["type"] == "server_error", timed_out
    assert st2 == 200 and aborted["choices"][0]["finish_reason"] == "abort", aborted


def test_chat_accepts_text_parts_and_openai_defaults_spelled_out(model_dir):
    """OpenAI's SDKs send message content as a list of text parts, and some clients send every
    default (response_format text, parallel_tool_calls true): both mean the plain request."""
    plain = [{"role": "user", "content": "1+2="}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}]}]

    async def main():
        async with serve(model_dir) as (s, _):
            want = await post(s, "/v1/chat/completions", {"messages": plain, "max_tokens": 6, "temperature": 0})
            got = await post(s, "/v1/chat/completions", {
                "messages": parts, "max_tokens": 6, "temperature": 0, "response_format": {"type": "text"},
                "parallel_tool_calls": True, "tool_choice": "none"})
            image = await post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x"}}]}], "max_tokens": 2})
            schema = await post(s, "/v1/chat/completions", {"messages": plain, "max_tokens": 2,
                                                            "response_format": {"type": "json_object"}})
        return want, got, image, schema

    (st, want), (st2, got), (st3, image), (st4, schema) = asyncio.run(main())
    assert st == st2 == 200
    assert got["choices"][0]["prompt_token_ids"] == want["choices"][0]["prompt_token_ids"]
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert st3 == 400 and "text content" in image["error"]["message"]
    assert st4 == 400 and "response_format" in schema["error"]["message"]


def test_a_client_that_disconnects_has_its_chat_request_aborted(model_dir):
    """An agent framework that gives up on a call must not leave it holding a batch row."""
    async def main():
        async with serve(model_dir) as (s, engine):
            await post(s, "/pause_generation", {"mode": "in_place"})  # keep it waiting: nothing finishes it
            with pytest.raises(asyncio.TimeoutError):
                async with s.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+2="}],
                                                                "max_tokens": 4},
                                  timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
            deadline = asyncio.get_running_loop().time() + 10
            while engine.num_waiting or engine.num_running:
                assert asyncio.get_running_loop().time() < deadline, "the server did not drop the request within 10 s"
                await asyncio.sleep(0.05)
            await post(s, "/continue_generation", {})
            st, out = await post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "1+2="}],
                                                             "max_tokens": 2})
            assert st == 200 and len(out["choices"][0]["token_ids"]) == 2

    asyncio.run(main())


async def events(s: aiohttp.ClientSession, path: str, body: dict) -> list:
    """The ``data:`` events of a streamed answer (``[DONE]`` as the string)."""
    import json

    async with s.post(path, json={**body, "stream": True}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream", await r.text()
        out = []
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
        return out


def test_streamed_answers_add_up_to_the_plain_ones(model_dir):
    """``stream: true`` on both endpoints, with stop strings of one and two characters, n=2 and
    logprobs: the chunks of each choice put together are the non-streamed choice (text, token ids,
    meshrl log-probs and versions, finish reason, usage)."""
    messages = [{"role": "user", "content": "1+2="}]

    async def main():
        async with serve(model_dir, TorchEngineConfig(max_batch_size=8, stream_interval_steps=1)) as (s, engine):
            free = (await post(s, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0}))[1]
            text = free["choices"][0]["message"]["content"]
            cases = [("/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0, "stop": [text[2:4]],
                                               "logprobs": True}),
                     ("/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0.9, "n": 2,
                                               "seed": 1, "stop": text[3]}),
                     ("/v1/completions", {"prompt": ["7+1=", "3+3="], "max_tokens": 8, "temperature": 1.0, "n": 2,
                                          "seed": 2, "logprobs": 1}),
                     ("/v1/completions", {"prompt": "12+3=", "max_tokens": 10, "temperature": 0, "stop": [text[1:4]]}),
                     ("/v1/completions", {"prompt": "5+5=", "max_tokens": 10, "temperature": 1.0, "seed": 4,
                                          "stop": ["1", "22", "+3"], "logprobs": 1})]
            out = []
            for path, body in cases:
                plain = (await post(s, path, body))[1]
                streamed = await events(s, path, {**body, "stream_options": {"include_usage": True}})
                out.append((path, plain, streamed))
            return out, engine.num_running

    out, running = asyncio.run(main())
    assert running == 0
    for path, plain, streamed in out:
        chat = path.endswith("chat/completions")
        assert streamed[-1] == "[DONE]" and streamed[-2]["choices"] == [] and streamed[-2]["usage"] == plain["usage"]
        chunks = streamed[:-2]
        assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        if chat:
            assert all(ch["delta"] == {"role": "assistant", "content": ""} for ch in chunks[0]["choices"])
            chunks = chunks[1:]
        for want in plain["choices"]:
            mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == want["index"]]
            text = "".join(ch["delta"].get("content", "") if chat else ch["text"] for ch in mine)
            assert text == (want["message"]["content"] if chat else want["text"]), (path, want["index"])
            assert sum((ch["token_ids"] for ch in mine), []) == want["token_ids"]
            assert sum((ch["meshrl"]["logprobs"] for ch in mine), []) == want["meshrl"]["logprobs"]
            assert sum((ch["meshrl"]["versions"] for ch in mine), []) == want["meshrl"]["versions"]
            assert [ch["finish_reason"] for ch in mine] == [None] * (len(mine) - 1) + [want["finish_reason"]]
            if len(want["token_ids"]) >= 6:
                assert len(mine) > 2  # streamed in pieces, not in one
            if want["logprobs"] is not None:
                got = sum((ch["logprobs"]["content" if chat else "token_logprobs"] for ch in mine), [])
                assert got == (want["logprobs"]["content"] if chat else want["logprobs"]["token_logprobs"])
                if not chat:  # offsets run on across chunks, whatever text was held back
                    assert sum((ch["logprobs"]["text_offset"] for ch in mine), []) == want["logprobs"]["text_offset"]
    assert {ch["finish_reason"] for _, plain, _ in out for ch in plain["choices"]} >= {"stop", "length"}


def test_a_step_that_fails_mid_stream_ends_it_with_an_error_then_done(model_dir):
    """The engine fails for real (its KV cache is taken away) after the first chunk: the stream says
    so in an error event and ends with ``[DONE]``, and the server goes on serving."""
    import json

    async def main():
        async with serve(model_dir) as (s, engine):
            body = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 40, "temperature": 0.0,
                    "stream": True}
            events = []
            async with s.post("/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    line = line.decode().strip()
                    if line.startswith("data: "):
                        events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                        if len(events) == 2:
                            engine.cache.release()  # the next decode step fails
            engine.restore_memory()
            after = await post(s, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 3})
            return events, after

    events, (st, after) = asyncio.run(main())
    assert events[-1] == "[DONE]" and "step failed" in events[-2]["error"]["message"], events[-3:]
    assert st == 200 and len(after["choices"][0]["token_ids"]) == 3


def test_sglang_generate_streams_text_a_few_tokens_at_a_time(model_dir):
    """/generate ``stream: true`` with text: each chunk's text is a prefix of the last one (whole
    characters only), and the last equals the unstreamed answer, per-token texts included."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    body = {"text": "12+30=", "return_logprob": True, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}}

    async def main():
        import json

        from meshrl.engines.serve import load_tokenizer

        async with serve(model_dir, tokenizer=load_tokenizer(model_dir)) as (s, _):
            plain = await post(s, "/generate", body)
            chunks = []
            async with s.post("/generate", json={**body, "stream": True}) as r:
                async for line in r.content:
                    line = line.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
            return plain, chunks

    (st, plain), chunks = asyncio.run(main())
    assert st == 200 and len(chunks) > 3
    final = chunks[-1]
    assert final["text"] == plain["text"] == tok.decode(plain["output_ids"], skip_special_tokens=True)
    assert final["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    for c in chunks[:-1]:
        assert final["text"].startswith(c["text"]) and "\ufffd" not in c["text"]
        assert [x[2] for x in c["meta_info"]["output_token_logprobs"]] == [tok.decode([t], skip_special_tokens=True)
                                                                           for t in c["output_ids"]]
