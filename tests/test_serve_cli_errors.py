"""What ``python -m meshrl.engines.serve`` says when it cannot start, and what its server does with a
request body that never arrives (issue 54: nothing lost, nothing left running, one clear line).

- Start-up: each problem with the command (the model directory, its architecture, its weights, the
  port, ``--tp``) is one line on stderr naming the fix, exit code 2, no traceback. In-process
  through ``serve_cli.main`` (a subprocess costs seconds of imports), and once as a user runs it.
- Bodies: a client that announces more bytes than it sends gets a 408 and its connection closed
  within the server's read timeout, on every endpoint that reads a body; one that hangs up mid-body
  leaves no traceback; the server answers the next request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import tiny
from aiohttp import web
from serving import app_session

from meshrl.engines import TorchEngine, TorchEngineConfig
from meshrl.engines.serve import make_app
from meshrl.engines.serve_cli import main
from meshrl.mesh.distributed import free_port

PROG = "meshrl.engines.serve: error: "


def _start(argv: list[str], capsys) -> str:
    """``main(argv)``, which must refuse to start: its one stderr line (exit code 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv, make_app)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, err
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(PROG) and "Traceback" not in err, err
    return err[len(PROG):].rstrip("\n")


def _copy(model: str, tmp_path) -> str:
    return str(shutil.copytree(model, tmp_path / "model"))


def _truncate(path: str) -> None:
    weights = os.path.join(path, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)


def _edit_config(path: str, **fields) -> None:
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({**config, **fields}, fh)


def test_a_model_directory_that_is_not_there_or_has_no_model(tiny_model, tmp_path, capsys):
    line = _start(["--model", str(tmp_path / "nope")], capsys)
    assert line == f"--model {tmp_path / 'nope'} does not exist: give a Hugging Face checkpoint directory " \
                   "(config.json + *.safetensors)"
    (tmp_path / "empty").mkdir()
    assert _start(["--model", str(tmp_path / "empty")], capsys) == (
        f"--model {tmp_path / 'empty'} has no config.json: give a Hugging Face checkpoint directory (save_pretrained "
        "writes one)")
    (tmp_path / "config_only").mkdir()
    shutil.copy(os.path.join(tiny_model, "config.json"), tmp_path / "config_only")
    assert _start(["--model", str(tmp_path / "config_only")], capsys) == (
        f"--model '{tmp_path / 'config_only'}' has no *.safetensors files: save the model there with save_pretrained")


def test_a_truncated_safetensors_file(tiny_model, tmp_path, capsys):
    model = _copy(tiny_model, tmp_path)
    _truncate(model)
    line = _start(["--model", model], capsys)
    assert line.startswith(f"--model {model}: model.safetensors is not a whole safetensors file (")
    assert line.endswith("): copy or save it again")


@pytest.mark.parametrize("fields, says", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     "model_type 'gpt2' (GPT2LMHeadModel) is not supported: meshrl runs qwen2, qwen3 or llama checkpoints"),
    # a model_type transformers does not know either: its own error is a paragraph about upgrading
    ({"model_type": "tinyllm9", "architectures": ["TinyLLM9ForCausalLM"]},
     "model_type 'tinyllm9' (TinyLLM9ForCausalLM) is not supported: meshrl runs qwen2, qwen3 or llama "
     "checkpoints"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (only 'silu')"),
], ids=["gpt2", "unknown-to-transformers", "gelu"])
def test_an_unsupported_architecture(tiny_model, tmp_path, capsys, fields, says):
    model = _copy(tiny_model, tmp_path)
    _edit_config(model, **fields)
    assert _start(["--model", model], capsys) == f"--model {model}: {says}"


@pytest.mark.parametrize("port", [70000, -1])
def test_a_port_out_of_range(tiny_model, capsys, port):
    assert _start(["--model", tiny_model, "--port", str(port)], capsys) == (
        f"--port {port} is not a TCP port: give one from 1 to 65535 (or 0: any free port)")


@pytest.mark.parametrize("listening", [True, False], ids=["listening", "bound"])
def test_a_port_in_use_is_found_before_the_weights_load(tiny_model, tmp_path, capsys, listening):
    """The weights here lack a tensor, which only loading them finds: the port's line comes first."""
    from safetensors.torch import load_file, save_file

    model = _copy(tiny_model, tmp_path)
    weights = os.path.join(model, "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        if listening:
            other.listen()
        port = other.getsockname()[1]
        line = _start(["--model", model, "--port", str(port)], capsys)
    assert line == (f"--port {port}: cannot listen on 127.0.0.1:{port} (Address already in use): stop what serves "
                    "there or give another --port")


def test_a_tp_that_does_not_split_the_model(tiny_model, capsys):
    """Found before any TP rank is spawned (the tiny model has 4 heads, 2 KV heads, MLP width 64)."""
    assert _start(["--model", tiny_model, "--tp", "3", "--device", "cpu"], capsys) == (
        "--tp 3 does not split this model: num_attention_heads=4 is not divisible by tp_size=3; give --tp 1 or 2")


def test_as_a_user_runs_it_one_line_and_exit_code_2(tiny_model, tmp_path):
    model = _copy(tiny_model, tmp_path)
    _truncate(model)
    proc = subprocess.run([sys.executable, "-m", "meshrl.engines.serve", "--model", model, "--port", str(free_port())],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"{PROG}--model {model}: model.safetensors is not a whole safetensors file")


# ---- request bodies ------------------------------------------------------------------------------

READ_TIMEOUT_S = 0.5
MARGIN_S = 2.5
"""What a loaded CI machine may add to the read timeout before the 408 and the close reach the client."""

HEAD = "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
PART = b'{"input_ids": [5, 6'
"""19 of the 100 bytes the head announces."""


def _short_body(port: int, path: str) -> tuple[bytes, float]:
    """POST ``path`` announcing 100 bytes, send 19 and wait: what the server sends until it closes the
    connection, and how long after the 19 bytes it closed. (A server that never closes: socket.timeout.)"""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S + 10) as c:
        c.sendall(HEAD.format(path=path).encode() + PART)
        sent = time.monotonic()
        reply = b""
        while chunk := c.recv(65536):
            reply += chunk
        return reply, time.monotonic() - sent


def _hang_up_mid_body(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(HEAD.format(path="/generate").encode() + PART)


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(await request.json())


def _engine() -> TorchEngine:
    return TorchEngine.from_hf_model(tiny.hf_model(tiny.qwen2()), config=TorchEngineConfig(max_batch_size=2,
                                                                                           max_seq_len=32))


def test_a_body_shorter_than_its_content_length_gets_a_408_and_the_connection_closed(caplog):
    """On one endpoint of each module that reads a body (SGLang's, OpenAI's, the weight endpoints')
    and on an ``extra_routes`` one, at once; then the server answers as before, and the log has one
    line for each, no traceback."""
    engine = _engine()
    paths = ["/generate", "/v1/completions", "/init_weights_update_group", "/echo"]

    async def run():
        app = make_app(engine, hf_tokenizer=None, read_timeout_s=READ_TIMEOUT_S,
                       extra_routes=[("POST", "/echo", _echo)])
        async with app_session(app) as (s, port):
            replies = await asyncio.gather(*(asyncio.to_thread(_short_body, port, p) for p in paths))
            async with s.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}) as r:
                after = r.status, await r.json()
            async with s.post("/echo", json={"a": 1}) as r:
                echoed = await r.json()
        return replies, after, echoed

    with caplog.at_level(logging.WARNING):
        replies, after, echoed = asyncio.run(run())
    for path, (reply, closed_after_s) in zip(paths, replies):
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), (path, reply)
        assert b"\r\nConnection: close" in head, (path, head)
        assert json.loads(body) == {"error": {
            "message": f"POST {path}: the body (Content-Length: 100) did not arrive within {READ_TIMEOUT_S:g} s: send "
                       "all of it, or start the server with a longer --read-timeout-s",
            "type": "invalid_request_error", "param": None, "code": 408}}
        assert READ_TIMEOUT_S * 0.9 <= closed_after_s <= READ_TIMEOUT_S + MARGIN_S, (path, closed_after_s)
    assert after[0] == 200 and len(after[1]["output_ids"]) == 2
    assert echoed == {"a": 1}
    lines = sorted(r.getMessage() for r in caplog.records if "did not arrive" in r.getMessage())
    assert lines == sorted(f"POST {p} from 127.0.0.1: the body (Content-Length: 100) did not arrive within "
                           f"{READ_TIMEOUT_S:g} s: answered 408 and closed the connection" for p in paths)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_client_that_hangs_up_mid_body_leaves_one_line_and_no_traceback(caplog):
    engine = _engine()

    async def run():
        async with app_session(make_app(engine, hf_tokenizer=None, read_timeout_s=30)) as (s, port):
            await asyncio.to_thread(_hang_up_mid_body, port)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not any("before its body" in r.getMessage() for r in caplog.records):
                await asyncio.sleep(0.05)  # until the server has seen it go
            async with s.get("/health") as r:
                return r.status

    with caplog.at_level(logging.WARNING):
        health = asyncio.run(run())
    assert health == 200
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("aiohttp", "asyncio", "meshrl"))] == [
        "POST /generate from 127.0.0.1: the client closed the connection before its body (Content-Length: 100) arrived"]
