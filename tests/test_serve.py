"""The SGLang-compatible server over real HTTP on 127.0.0.1: every endpoint against its schema.

Response shapes are checked by converting the JSON into msgspec Structs written from
SGLANG_PROTOCOL.md (strict types, tagged ``finish_reason`` unions), and the generated tokens against
the engine called directly.
"""

from __future__ import annotations

import asyncio
import json
import contextlib
import time

import aiohttp
import msgspec
import pytest
import torch
from aiohttp import web

import tiny
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.engines.serve import SGLANG_COMPAT_VERSION, make_app
from serving import app_session, running_server

torch.set_num_threads(1)
TIMEOUT = aiohttp.ClientTimeout(total=30)


class FinishStop(msgspec.Struct, tag_field="type", tag="stop"):
    matched: int


class FinishLength(msgspec.Struct, tag_field="type", tag="length"):
    length: int


class FinishAbort(msgspec.Struct, tag_field="type", tag="abort"):
    message: str


class Span(msgspec.Struct, forbid_unknown_fields=True):
    version: str
    start: int
    end: int


class Meta(msgspec.Struct):
    id: str
    finish_reason: FinishStop | FinishLength | FinishAbort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_versions: list[Span]
    output_token_logprobs: list[tuple[float, int, None]] | None = None


class Out(msgspec.Struct):
    output_ids: list[int]
    meta_info: Meta


@pytest.fixture(scope="module")
def hf():
    return tiny.hf_model(tiny.qwen2(hidden_size=64), sharp=6.0)


def make_engine(hf) -> TorchEngine:
    return TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=8, max_seq_len=80))


@contextlib.asynccontextmanager
async def serve(engine: TorchEngine):
    """The app on a free port of 127.0.0.1; yields (session, base_url)."""
    async with app_session(make_app(engine, server_args={"host": "127.0.0.1"})) as (session, _):
        yield session


async def post(s: aiohttp.ClientSession, path: str, body: dict | None = None):
    async with s.post(path, json=body or {}) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def get(s: aiohttp.ClientSession, path: str):
    async with s.get(path) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def until(pred, what: str, timeout_s: float = 20.0) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


P0, P1 = [5, 9, 17, 4, 30], [11, 12, 13]


def test_generate_schema_tokens_and_logprobs(hf):
    ref = asyncio.run(make_engine(hf).generate([
        GenerateRequest(input_ids=P0, sampling=SamplingParams(max_new_tokens=6, temperature=0)),
        GenerateRequest(input_ids=P1, sampling=SamplingParams(max_new_tokens=5, temperature=0.8, n=2, seed=3)),
        GenerateRequest(input_ids=P0, sampling=SamplingParams(max_new_tokens=5, temperature=0.8, n=2, seed=4))]))

    async def main():
        async with serve(make_engine(hf)) as s:
            st, one = await post(s, "/generate", {"input_ids": P0, "return_logprob": True, "rid": "a",
                                                  "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
            assert st == 200 and isinstance(one, dict)
            st2, many = await post(s, "/generate", {
                "input_ids": [P1, P0], "return_logprob": True,
                "sampling_params": [{"max_new_tokens": 5, "temperature": 0.8, "n": 2, "sampling_seed": 3},
                                    {"max_new_tokens": 5, "temperature": 0.8, "n": 2, "sampling_seed": 4,
                                     "min_p": 0.0, "skip_special_tokens": True}]})
            return one, st2, many

    one, st2, many = asyncio.run(main())
    o = msgspec.convert(one, Out)
    c = ref[0].completions[0]
    assert o.output_ids == c.output_ids and o.meta_info.id == "a"
    assert o.meta_info.finish_reason == FinishLength(length=6)
    assert o.meta_info.prompt_tokens == len(P0) and o.meta_info.completion_tokens == 6
    assert [t for _, t, _ in o.meta_info.output_token_logprobs] == c.output_ids  # index 1: token id
    assert torch.allclose(torch.tensor([lp for lp, _, _ in o.meta_info.output_token_logprobs]),
                          torch.tensor(c.logprobs), atol=1e-6)  # index 0: log-prob
    assert o.meta_info.weight_version == "0" and o.meta_info.weight_versions == [Span("0", 0, 6)]
    assert st2 == 200 and isinstance(many, list) and len(many) == 4  # prompt-major: P1 s0, P1 s1, P0 s0, P0 s1
    outs = [msgspec.convert(x, Out) for x in many]
    expect = [x.output_ids for x in ref[1].completions + ref[2].completions]
    assert [x.output_ids for x in outs] == expect


def test_stop_abort_pause_health_flush(hf):
    async def main():
        engine = make_engine(hf)
        async with serve(engine) as s:
            st, free = await post(s, "/generate", {"input_ids": P0, "sampling_params": {"max_new_tokens": 8,
                                                                                         "temperature": 0}})
            stop = free["output_ids"][2]
            st, stopped = await post(s, "/generate", {"input_ids": P0, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop]}})
            assert msgspec.convert(stopped, Out).meta_info.finish_reason == FinishStop(matched=stop)
            assert stopped["output_ids"] == free["output_ids"][: free["output_ids"].index(stop) + 1]
            assert (await get(s, "/health"))[0] == 200 and (await get(s, "/health_generate"))[0] == 200
            assert (await get(s, "/flush_cache"))[0] == 200

            # abort one request by rid while it runs
            long = asyncio.create_task(post(s, "/generate", {"input_ids": P1, "rid": "long",
                                                             "sampling_params": {"max_new_tokens": 70}}))
            await until(lambda: engine.steps > 3 and engine.num_running == 1, "the long request to run")
            assert (await post(s, "/flush_cache"))[0] == 400  # busy: SGLang refuses to flush
            assert (await post(s, "/abort_request", {"rid": "long"}))[0] == 200
            st, aborted = await long  # SGLang's reply to an aborted single-prompt request (seen on 0.5.17)
            assert st == 499 and aborted["error"]["message"] == "Request long was aborted"
            # in a batch each output says so itself
            batch = asyncio.create_task(post(s, "/generate", {"input_ids": [P1, P1], "rid": ["b0", "b1"],
                                                              "sampling_params": {"max_new_tokens": 70}}))
            await until(lambda: engine.steps > 3 and engine.num_running == 2, "the batch to run")
            assert (await post(s, "/abort_request", {"rid": "b0"}))[0] == 200
            st, outs = await batch
            a = msgspec.convert(outs[0], Out)
            assert st == 200 and isinstance(a.meta_info.finish_reason, FinishAbort) and 0 < len(a.output_ids) < 70
            assert outs[1]["meta_info"]["finish_reason"]["type"] == "length"

            # pause (abort mode) ends in-flight work; health is 503 until continue
            long = asyncio.create_task(post(s, "/generate", {"input_ids": P1, "sampling_params": {"max_new_tokens": 70}}))
            await until(lambda: engine.num_running == 1, "the request to run")
            st, body = await post(s, "/pause_generation", {"mode": "abort"})
            assert st == 200 and body["success"] is True
            st, aborted = await long
            assert st == 499 and "was aborted" in aborted["error"]["message"]
            assert (await get(s, "/health"))[0] == 503 and (await get(s, "/health_generate"))[0] == 503
            st, body = await post(s, "/pause_generation", {"mode": "sideways"})
            assert st == 400 and "sideways" in body["error"]["message"]
            assert (await post(s, "/continue_generation"))[0] == 200
            assert (await get(s, "/health"))[0] == 200

            # retract, then abort everything (the trainer's abort-mode push): the running request ends
            # aborted, one sent while paused waits outside the scheduler, so a flush succeeds
            long = asyncio.create_task(post(s, "/generate", {"input_ids": P1, "sampling_params": {"max_new_tokens": 70}}))
            await until(lambda: engine.num_running == 1, "the request to run")
            assert (await post(s, "/pause_generation", {"mode": "retract"}))[0] == 200
            assert (await post(s, "/abort_request", {"abort_all": True}))[0] == 200
            assert (await long)[0] == 499
            later = asyncio.create_task(post(s, "/generate", {"input_ids": P1, "sampling_params": {"max_new_tokens": 5}}))
            await until(lambda: engine.num_waiting == 1, "the later request to wait")
            assert (await post(s, "/flush_cache"))[0] == 200
            await post(s, "/continue_generation")
            st, done = await later
            assert st == 200 and done["meta_info"]["finish_reason"] == {"type": "length", "length": 5}

            # in_place pause keeps the request; continue finishes it with every token
            long = asyncio.create_task(post(s, "/generate", {"input_ids": P1, "sampling_params": {"max_new_tokens": 20}}))
            await until(lambda: engine.num_running == 1, "the request to run")
            await post(s, "/pause_generation", {"mode": "in_place"})
            await asyncio.sleep(0.05)
            assert not long.done() and engine.num_running == 1
            await post(s, "/continue_generation")
            st, done = await long
            assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 20}

    asyncio.run(main())


def test_bad_requests_are_400_naming_the_field(hf):
    async def main():
        async with serve(make_engine(hf)) as s:
            cases = [
                ({"input_ids": P0, "sampling_params": {"max_tokens": 4}}, "max_tokens"),
                ({"input_ids": P0, "sampling_params": {"min_p": 0.1}}, "min_p"),
                ({"input_ids": P0, "sampling_params": {"top_p": 0.0}}, "top_p"),
                ({"input_ids": P0, "stream": "yes"}, "stream"),
                ({"text": "hello"}, "no tokenizer"),
                ({"input_ids": [[1, 2], []]}, "input_ids"),
                ({"input_ids": P0, "frobnicate": 1}, "frobnicate"),
                ({"input_ids": [500]}, "outside [0, 72)"),
                ({"input_ids": P0, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
                # wrong types and out-of-range values: refused with their name, never run
                ({"input_ids": P0, "sampling_params": {"top_k": 2**70}}, "top_k"),
                ({"input_ids": P0, "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
                ({"input_ids": P0, "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
                ({"input_ids": P0, "sampling_params": {"stop_token_ids": 7}}, "stop_token_ids"),
                ({"input_ids": P0, "sampling_params": {"stop_token_ids": [2**70]}}, "stop_token_ids"),
                ({"input_ids": P0, "sampling_params": {"sampling_seed": "x"}}, "seed"),
                ({"input_ids": [True, False]}, "input_ids"),
                ({"input_ids": P0, "rid": 5}, "rid"),
                # booleans are JSON booleans: the string "false" is truthy
                ({"input_ids": P0, "return_logprob": "false"}, "return_logprob must be true or false"),
                ({"input_ids": P0, "sampling_params": {"no_stop_trim": "no"}}, "no_stop_trim must be true or false"),
            ]
            for body, needle in cases:
                st, out = await post(s, "/generate", body)
                assert st == 400 and needle in out["error"]["message"], (body, out)
            raw = [("/generate", b"{bad", "not valid JSON"), ("/generate", b"[1, 2]", "JSON object"),
                   ("/pause_generation", b"{bad", "not valid JSON"), ("/abort_request", b'{"rid": ["x"]}', "rid"),
                   ("/abort_request", b'{"abort_all": "false"}', "abort_all must be true or false"),
                   ("/get_weights_by_name", b'{"name": "model.norm.weight", "truncate_size": "x"}', "truncate_size"),
                   ("/update_weight_version", b"[]", "JSON object"),
                   ("/update_weights_from_distributed", b"{}", "names"),
                   ("/init_weights_update_group", b"{}", "master_address")]
            for path, data, needle in raw:
                async with s.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
                    out = await r.json()
                    assert r.status == 400 and needle in out["error"]["message"] and path in out["error"]["message"], \
                        (path, out)

    asyncio.run(main())


def test_a_bad_request_leaves_the_others_alone(hf):
    """A refused request does not touch the one running beside it, nor what runs after it (a failure in
    the running batch used to fail every request in flight and leave later sampled requests greedy)."""
    async def main():
        engine = make_engine(hf)
        sampled = {"input_ids": P1, "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 3}}
        async with serve(engine) as s:
            st, alone = await post(s, "/generate", sampled)
            running = asyncio.create_task(post(s, "/generate", sampled))
            await until(lambda: engine.num_running == 1, "the sampled request to run")
            st, out = await post(s, "/generate", {"input_ids": P0, "sampling_params": {"top_k": 2**70}})
            assert st == 400 and "top_k" in out["error"]["message"]
            st, beside = await running
            assert st == 200 and beside["output_ids"] == alone["output_ids"]
            assert beside["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
            st, again = await post(s, "/generate", sampled)
            assert again["output_ids"] == alone["output_ids"] and len(set(alone["output_ids"])) > 1

    asyncio.run(main())


def test_a_client_that_disconnects_has_its_request_aborted(hf):
    """As SGLang does: a /generate whose client went away stops running (so a retry may reuse its rid)."""
    async def main():
        engine = make_engine(hf)
        async with serve(engine) as s:
            await post(s, "/pause_generation", {"mode": "in_place"})  # keep it waiting: nothing finishes it
            with pytest.raises(asyncio.TimeoutError):
                async with s.post("/generate", json={"input_ids": P0, "rid": "gone", "sampling_params": {"max_new_tokens": 4}},
                                  timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
            await until(lambda: engine.num_waiting == 0 and engine.num_running == 0, "the server to drop the request",
                        timeout_s=10)
            await post(s, "/continue_generation")
            st, out = await post(s, "/generate", {"input_ids": P0, "rid": "gone", "sampling_params": {"max_new_tokens": 2}})
            assert st == 200 and out["meta_info"]["id"] == "gone"

    asyncio.run(main())


def test_info_endpoints_and_weights(hf):
    async def main():
        engine = make_engine(hf)
        async with serve(engine) as s:
            st, info = await get(s, "/get_server_info")
            assert st == 200 and info["version"] == SGLANG_COMPAT_VERSION and info["tp_size"] == 1
            assert info["max_running_requests"] == 8 and info["context_length"] == 80
            st, mi = await get(s, "/get_model_info")
            assert st == 200 and mi["is_generation"] is True and mi["weight_version"] == "0"
            assert (await get(s, "/model_info"))[1] == mi and (await get(s, "/server_info"))[0] == 200
            name = "model.layers.1.self_attn.k_proj.weight"
            st, rows = await post(s, "/get_weights_by_name", {"name": name, "truncate_size": 3})
            assert st == 200 and torch.equal(torch.tensor(rows), hf.state_dict()[name][:3])
            st, err = await post(s, "/get_weights_by_name", {"name": "model.nope"})
            assert st == 400 and "model.nope" in err["error"]["message"]
            await engine.update_weights({name: torch.zeros(32, 64)}, version=5)
            st, rows = await post(s, "/get_weights_by_name", {"name": name, "truncate_size": 2})
            assert rows == [[0.0] * 64] * 2
            assert (await get(s, "/get_model_info"))[1]["weight_version"] == "5"
            st, out = await post(s, "/generate", {"input_ids": P0, "sampling_params": {"max_new_tokens": 2}})
            assert out["meta_info"]["weight_version"] == "5"
            assert out["meta_info"]["weight_versions"] == [{"version": "5", "start": 0, "end": 2}]

    asyncio.run(main())


def test_cli_serves_a_checkpoint_directory(tmp_path, hf):
    hf.save_pretrained(tmp_path)

    async def main(url: str):
        async with aiohttp.ClientSession(url, timeout=TIMEOUT) as s:
            return await post(s, "/generate", {"input_ids": P0, "sampling_params": {"max_new_tokens": 4,
                                                                                     "temperature": 0}})

    with running_server(tmp_path, "--max-batch-size", "4", "--max-seq-len", "64", timeout_s=60) as url:
        st, out = asyncio.run(main(url))
    ref = asyncio.run(make_engine(hf).generate([GenerateRequest(
        input_ids=P0, sampling=SamplingParams(max_new_tokens=4, temperature=0))]))
    assert st == 200 and out["output_ids"] == ref[0].completions[0].output_ids


def test_server_ids_never_collide_with_a_clients_rid(hf):
    """Requests without a rid got ``srv-N`` ids, and /health_generate ``health-N``: a client whose own
    rid was ``srv-0`` made an innocent request fail with 400 (and /health_generate with a 500)."""
    async def main():
        engine = make_engine(hf)
        async with serve(engine) as s:
            body = {"input_ids": P0, "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}
            clients = [asyncio.ensure_future(post(s, "/generate", {**body, "rid": rid})) for rid in ("srv-0", "health-0")]
            await until(lambda: engine._batch.size >= 2, "both client requests running")
            st, plain = await post(s, "/generate", {"input_ids": P1, "sampling_params": {"max_new_tokens": 2}})
            health = await get(s, "/health_generate")
            done = await asyncio.gather(*clients)
            return st, plain, health, done

    st, plain, health, done = asyncio.run(main())
    assert st == 200 and plain["meta_info"]["id"] not in ("srv-0", "health-0"), plain
    assert health[0] == 200 and [d[1]["meta_info"]["id"] for d in done] == ["srv-0", "health-0"]


def test_text_leaves_out_the_matched_stop_token_unless_no_stop_trim(hf):
    """As SGLang's detokenizer does (trim_matched_stop); output_ids keep it either way."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i % 26) + str(i // 26): i for i in range(72)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    async def main():
        engine = make_engine(hf)
        runner = web.AppRunner(make_app(engine, tokenizer=tok))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession(url, timeout=TIMEOUT) as s:
                _, free = await post(s, "/generate", {"input_ids": P0, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
                stop = free["output_ids"][1]
                sp = {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": [stop]}
                _, trimmed = await post(s, "/generate", {"input_ids": P0, "sampling_params": sp})
                _, kept = await post(s, "/generate", {"input_ids": P0, "sampling_params": {**sp, "no_stop_trim": True}})
                return free, trimmed, kept
        finally:
            await runner.cleanup()

    free, trimmed, kept = asyncio.run(main())
    assert trimmed["output_ids"] == kept["output_ids"] == free["output_ids"][:2]
    assert trimmed["meta_info"]["finish_reason"]["matched"] == free["output_ids"][1]
    assert trimmed["text"] == tok.decode(free["output_ids"][:1]) and kept["text"] == tok.decode(free["output_ids"][:2])


def test_release_and_resume_memory_occupation(hf):
    """SGLang's memory endpoints (a colocated trainer takes the device): the engine must be idle;
    while released /health is 503 and /generate says why; weights need the contiguous buffer
    (--enable-memory-saver) and come back empty until a version is written; the KV cache alone
    comes back as it was."""
    async def main():
        engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=8, max_seq_len=80,
                                                                         contiguous_weights=True))
        greedy = {"input_ids": P0, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        async with serve(engine) as s:
            _, before = await post(s, "/generate", greedy)
            busy = asyncio.ensure_future(post(s, "/generate", {"input_ids": P1, "sampling_params": {"max_new_tokens": 70}}))
            await until(lambda: engine.num_running > 0, "a request running")
            refused = await post(s, "/release_memory_occupation", {"tags": ["kv_cache"]})
            await busy
            bad = await post(s, "/release_memory_occupation", {"tags": ["gpu"]})
            released = await post(s, "/release_memory_occupation", {"tags": ["kv_cache"]})
            health = await get(s, "/health")
            blocked = await post(s, "/generate", greedy)
            resumed = await post(s, "/resume_memory_occupation", {"tags": ["kv_cache"]})
            _, after = await post(s, "/generate", greedy)
            both = await post(s, "/release_memory_occupation", {})
            weights_gone = engine.weights_released
            await post(s, "/resume_memory_occupation", {"tags": None})
            return before, refused, bad, released, health, blocked, resumed, after, both, weights_gone

    before, refused, bad, released, health, blocked, resumed, after, both, weights_gone = asyncio.run(main())
    assert refused[0] == 400 and "busy engine" in refused[1]["error"]["message"]
    assert bad[0] == 400 and "tags must be" in bad[1]["error"]["message"]
    assert released[0] == 200 and health == (503, "memory released")
    assert blocked[0] == 503 and "memory is released" in blocked[1]["error"]["message"]
    assert resumed[0] == 200 and after["output_ids"] == before["output_ids"]
    assert both[0] == 200 and weights_gone


@pytest.mark.parametrize("compat, accepted", [("0.5.2", False), ("0.5.17", True)])
def test_sampling_seed_exists_from_the_version_the_server_shows(hf, compat, accepted):
    """SGLang added sampling_seed after 0.5.2 (0.5.17, on the GPU machine, has it): a server showing an
    older release refuses it, as that release would, so an adapter's version branches meet the same
    answers as against SGLang."""
    async def main():
        runner = web.AppRunner(make_app(make_engine(hf), compat_version=compat))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            async with aiohttp.ClientSession(url, timeout=TIMEOUT) as s:
                return await post(s, "/generate", {"input_ids": P0, "sampling_params": {"max_new_tokens": 2,
                                                                                        "sampling_seed": 3}})
        finally:
            await runner.cleanup()

    status, out = asyncio.run(main())
    if accepted:
        assert status == 200, out
    else:
        assert status == 400 and "sampling_seed" in out["error"]["message"] and compat in out["error"]["message"]


def test_per_prompt_logprob_flags_and_an_abort_of_a_sample_id_that_is_not_running(hf):
    """SGLang takes return_logprob as one boolean per prompt; an abort of ``job_1`` must not end a
    request ``job`` that has one sample (only sample ids of a running n > 1 request map to it)."""
    async def main():
        engine = make_engine(hf)
        async with serve(engine) as s:
            st, outs = await post(s, "/generate", {"input_ids": [P0, P1], "return_logprob": [True, False],
                                                   "sampling_params": {"max_new_tokens": 2}})
            job = asyncio.ensure_future(post(s, "/generate", {"input_ids": P0, "rid": "job", "sampling_params": {
                "max_new_tokens": 60, "ignore_eos": True}}))
            await until(lambda: engine.num_running > 0, "job running")
            await post(s, "/abort_request", {"rid": "job_1"})
            _, done = await job
            return st, outs, done

    st, outs, done = asyncio.run(main())
    assert st == 200 and "output_token_logprobs" in outs[0]["meta_info"] and "output_token_logprobs" not in outs[1]["meta_info"]
    assert done["meta_info"]["finish_reason"]["type"] == "length"


def test_update_weights_from_disk(hf, tmp_path):
    """SGLang's ``/update_weights_from_disk``: the checkpoint's weights serve the next request under
    ``weight_version``; another model's checkpoint or a missing directory is a 400 that changes nothing."""
    from safetensors.torch import save_file

    new = {k: v * 0.7 if v.dim() == 2 else v for k, v in hf.state_dict().items()}
    save_file({k: v.contiguous() for k, v in new.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    other = tmp_path / "other"
    other.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(5, 3)}, str(other / "model.safetensors"))
    req = GenerateRequest(input_ids=P0, sampling=SamplingParams(max_new_tokens=6, temperature=0))

    async def expected():
        eng = make_engine(hf)
        before = await eng.generate([req])
        await eng.update_weights(new.items(), 3)
        return before[0].completions[0].output_ids, (await eng.generate([req]))[0].completions[0].output_ids

    before, after = asyncio.run(expected())
    assert before != after

    async def main():
        async with serve(make_engine(hf)) as s:
            gen = {"input_ids": P0, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
            bad = [await post(s, "/update_weights_from_disk", {"model_path": str(other)}),
                   await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")}),
                   await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path), "load_format": "pt"})]
            still = await post(s, "/generate", gen)
            ok = await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "3"})
            return bad, still, ok, await post(s, "/generate", gen)

    bad, still, ok, now = asyncio.run(main())
    for st, b in bad:
        assert st == 400 and b["success"] is False and b["num_paused_requests"] == 0
    assert "expected shape" in bad[0][1]["message"] and "no checkpoint directory" in bad[1][1]["message"]
    assert still[1]["output_ids"] == before and still[1]["meta_info"]["weight_version"] == "0"
    assert ok[0] == 200 and ok[1]["success"] is True
    assert now[1]["output_ids"] == after and now[1]["meta_info"]["weight_version"] == "3"


async def _events(s: aiohttp.ClientSession, body: dict) -> tuple[int, list]:
    """POST /generate with stream=true; the parsed ``data:`` events, ``[DONE]`` as the string."""
    async with s.post("/generate", json={**body, "stream": True}) as r:
        if r.status != 200:
            return r.status, [await r.json()]
        assert r.content_type == "text/event-stream"
        events = []
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, events


class ChunkMeta(Meta):
    finish_reason: FinishStop | FinishLength | FinishAbort | None  # null until the sample's last chunk


class Chunk(msgspec.Struct):
    output_ids: list[int]
    meta_info: ChunkMeta


def test_generate_stream_chunks_add_up_to_the_answer(hf):
    """``stream: true``: SGLang's server-sent events, each with the output so far and a null
    finish_reason until the last, then ``[DONE]``; the last chunks equal the non-streamed answer."""
    body1 = {"input_ids": P0, "return_logprob": True, "rid": "s1",
             "sampling_params": {"max_new_tokens": 12, "temperature": 0.9, "sampling_seed": 4}}
    body2 = {"input_ids": [P1, P0], "sampling_params": {"max_new_tokens": 7, "temperature": 0.8, "n": 2,
                                                       "sampling_seed": 5}}

    async def main():
        eng = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=8, max_seq_len=80,
                                                                      stream_interval_steps=2))
        async with serve(eng) as s:
            plain1 = await post(s, "/generate", body1)
            plain2 = await post(s, "/generate", body2)
            st1, ev1 = await _events(s, body1)
            st2, ev2 = await _events(s, body2)
            bad = await _events(s, {"input_ids": [100000], "sampling_params": {"max_new_tokens": 2}})
            await eng.pause("keep")  # so that a request queued by mistake would still be waiting below
            mismatch = await _events(s, {"input_ids": [P0, P1], "return_logprob": [True],
                                         "sampling_params": {"max_new_tokens": 2}})
            queued = eng.num_waiting
            await eng.resume()
            return plain1, plain2, (st1, ev1), (st2, ev2), bad, eng.num_running, mismatch, queued

    plain1, plain2, (st1, ev1), (st2, ev2), bad, running, mismatch, queued = asyncio.run(main())
    assert mismatch[0] == 400 and "return_logprob" in mismatch[1][0]["error"]["message"] and queued == 0
    assert st1 == 200 and ev1[-1] == "[DONE]" and len(ev1) >= 5  # 12 tokens, read every 2 steps
    chunks = [msgspec.convert(e, Chunk) for e in ev1[:-1]]
    lengths = [len(c.output_ids) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    assert all(c.meta_info.finish_reason is None for c in chunks[:-1])
    for c in chunks:  # each chunk's output is a prefix of the whole
        assert c.output_ids == plain1[1]["output_ids"][: len(c.output_ids)]
        assert len(c.meta_info.output_token_logprobs) == len(c.output_ids)
    assert msgspec.to_builtins(chunks[-1].meta_info.finish_reason) == plain1[1]["meta_info"]["finish_reason"]
    assert chunks[-1].meta_info.output_token_logprobs == [tuple(x) for x in plain1[1]["meta_info"]["output_token_logprobs"]]
    assert st2 == 200 and ev2[-1] == "[DONE]"
    last = {}
    for e in ev2[:-1]:
        last[e["index"]] = e
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["output_ids"] for i in range(4)] == [o["output_ids"] for o in plain2[1]]
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in range(4))
    assert bad[0] == 400 and "outside" in bad[1][0]["error"]["message"]
    assert running == 0


def test_generate_stream_client_going_away_aborts_it(hf):
    async def main():
        eng = make_engine(hf)
        async with serve(eng) as s:
            body = {"input_ids": P0, "stream": True, "sampling_params": {"max_new_tokens": 70, "ignore_eos": True}}
            await eng.pause("keep")  # the request waits until the client has gone
            async with s.post("/generate", json=body) as r:
                assert r.status == 200 and eng.num_waiting == 1
            await until(lambda: eng.num_waiting == 0, "the stream's request to be aborted", timeout_s=10)
            await eng.resume()
            return eng.steps, eng.num_running

    assert asyncio.run(main()) == (0, 0)
