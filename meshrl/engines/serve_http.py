"""The HTTP plumbing of the TorchEngine server: request parsing, errors, server-sent events, disconnects.

Every endpoint module (``sglang_api.py``, ``openai_api.py``, ``serve_weights.py``) builds on this
one and on nothing of the others', so they read alone and import in one direction only.

Errors: one body format and one mapping. Every error reply is OpenAI's error object, ``{"error":
{"message", "type", "param", "code"}}`` with the HTTP status as ``code`` (as SGLang's and vLLM's
OpenAI servers answer; SGLang's own clients read ``error.message``), on every path, aiohttp's 404,
405 and 413 included (``errors``). A failed generation maps to a status by its exception's type
alone (``status_of``): 400 for a request that is wrong, 504 for one that waited too long, 503 for
an engine that cannot serve now; the same status goes in the error event that ends a stream.

Not errors in this sense, on purpose: ``/health``, ``/health_generate`` and ``/flush_cache``
answer SGLang's plain-text status replies (clients read ``(503, "paused")``), and the weight
endpoints SGLang's ``{"success": false, "message"}`` (``serve_weights.py``). An unexpected
exception is left to aiohttp (a 500, its traceback in the server's log).

Bodies: ``read_bodies`` reads each request's whole body before its handler runs, within the
server's read timeout, so no endpoint (``extra_routes`` included) waits on a client that announced
more bytes than it sends: that one gets a 408 and its connection closed, and a client gone mid-body
a 499; each is one line in the server's log, not a traceback. On purpose no endpoint streams its
body in: each parses one JSON object, of at most the app's ``client_max_size``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DISCONNECT_POLL_S = 0.5
"""How often a waiting request checks whether its client is still connected."""

ABORTED_STATUS = 499
"""nginx's "client closed request": the reply to a request aborted before it finished (SGLang's too)."""

READ_TIMEOUT_S = 30.0
"""How long a request's whole body may take to arrive, by default (``make_app(read_timeout_s=)``,
``--read-timeout-s``): a JSON body on a working link takes milliseconds."""

ENGINE_ERRORS = (ValueError, TimeoutError, RuntimeError)
"""The exceptions of a generation that are the client's answer (``status_of``); others are bugs."""


_log = logging.getLogger("meshrl.engines.serve")


class BadRequest(ValueError):
    """A request the server rejects with HTTP 400; raised anywhere in a handler (``errors`` replies)."""


def status_of(exc: BaseException) -> int:
    """The HTTP status of a failed generation, the one mapping of every endpoint:

    - ``ValueError`` (``BadRequest`` among them): 400, the request is wrong: a field, or the
      engine's own checks (prompt + max tokens past ``max_seq_len``, a request id in flight);
    - ``TimeoutError``: 504, it waited past the engine's ``generate_timeout_s`` (paused) and was aborted;
    - ``RuntimeError``: 503, the engine cannot serve now: its memory is released
      (``/resume_memory_occupation`` first), or a step failed;
    - anything else: 500.
    """
    if isinstance(exc, ValueError):
        return 400
    if isinstance(exc, TimeoutError):
        return 504
    if isinstance(exc, RuntimeError):
        return 503
    return 500


def error_body(status: int, message: str) -> dict[str, Any]:
    """The error object of every error reply and error event."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


def engine_error(exc: BaseException) -> web.Response:
    """The reply to a generation that failed with ``exc`` (one of ``ENGINE_ERRORS``)."""
    return error_response(status_of(exc), str(exc))


def client_closed() -> web.Response:
    """The reply to a request whose client went away (its requests were aborted): nobody reads it,
    but aiohttp logs its status."""
    return error_response(ABORTED_STATUS, "the client closed the connection; its requests were aborted")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A handler's ``BadRequest`` as a 400 naming the problem, and aiohttp's own errors (no such
    endpoint, wrong method, body too large) as the same error object instead of plain text."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(400, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = f"{request.method} {request.path}: no such endpoint{_siblings(request)}"
        elif exc.status == 405:
            message = f"{request.method} {request.path}: method not allowed (use {exc.headers.get('Allow', 'another')})"
        else:
            message = f"{request.method} {request.path}: {exc.reason}"
        resp = error_response(exc.status, message)
        if "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp


def read_bodies(read_timeout_s: float) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware that reads each request's body whole (aiohttp keeps it: ``read_json`` parses that
    copy) before the handler runs, within ``read_timeout_s``:

    - a body that has not all arrived by then (fewer bytes than its Content-Length, and the client
      waits): a 408 if the client still reads, then the connection is closed;
    - a client that closed its connection mid-body: a 499 that nobody reads.

    Either is one warning line in the log; a body past the app's ``client_max_size`` is still
    aiohttp's 413 (``errors``)."""

    @web.middleware
    async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.can_read_body:
            try:
                await asyncio.wait_for(request.read(), read_timeout_s)
            except asyncio.TimeoutError:
                return await _body_timed_out(request, read_timeout_s)
            except ConnectionError:  # aiohttp's "Connection lost": the payload fails when the client goes
                _log.warning("%s %s from %s: the client closed the connection before its body (%s) arrived",
                             request.method, request.path, request.remote, _announced(request))
                return client_closed()
        return await handler(request)

    return read_body


async def _body_timed_out(request: web.Request, read_timeout_s: float) -> web.StreamResponse:
    _log.warning("%s %s from %s: the body (%s) did not arrive within %g s: answered 408 and closed the connection",
                 request.method, request.path, request.remote, _announced(request), read_timeout_s)
    message = (f"{request.method} {request.path}: the body ({_announced(request)}) did not arrive within "
               f"{read_timeout_s:g} s: send all of it, or start the server with a longer --read-timeout-s")
    resp = error_response(408, message)
    resp.force_close()
    try:
        await resp.prepare(request)
        await resp.write_eof()
    except ConnectionError:
        pass  # it went away meanwhile: nobody to answer
    # Closed now: returning with the body unread, aiohttp would first wait its lingering_time (10 s)
    # for the rest of it, which this client is not sending.
    request.protocol.force_close()
    return resp


def _announced(request: web.Request) -> str:
    n = request.content_length
    return "chunked" if n is None else f"Content-Length: {n}"


def _siblings(request: web.Request) -> str:
    """For an unknown ``/head/x`` (``/v1/x``): the endpoints this server has under ``/head/``, in the order
    they were added; none for a path of one part (SGLang's endpoints are many)."""
    head, sep, _ = request.path[1:].partition("/")
    if not sep:
        return ""
    prefix = f"/{head}/"
    paths = list(dict.fromkeys(r.canonical for r in request.app.router.resources() if r.canonical.startswith(prefix)))
    if not paths:
        return ""
    listed = paths[0] if len(paths) == 1 else f"{', '.join(paths[:-1])} and {paths[-1]}"
    return f" (this server has {listed})"


async def read_json(request: web.Request, *, default: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request's JSON object body; ``default`` stands in for no body (or ``null``), else one is required."""
    # (read, not can_read_body: read_bodies has read the body already, and aiohttp keeps it)
    if default is not None and not await request.read():
        return default
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"{request.path}: the body is not valid JSON ({exc})") from None
    if body is None and default is not None:
        return default
    if not isinstance(body, dict):
        raise BadRequest(f"{request.path}: the body must be a JSON object, got {type(body).__name__}")
    return body


def is_int(v: Any) -> bool:
    """A JSON integer (``true`` is a Python int, and no count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def flag(d: dict[str, Any], key: str, where: str) -> bool:
    """A JSON boolean field (absent or null: false); ``"false"`` would be truthy, so strings are refused."""
    value = d.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise BadRequest(f"{where}: {key} must be true or false, got {value!r}")


def sse_response() -> web.StreamResponse:
    """A server-sent events response (``await resp.prepare(request)`` sends its headers)."""
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


async def sse(resp: web.StreamResponse, data: Any) -> None:
    """One server-sent event: ``data: <json>`` and a blank line."""
    await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")


async def sse_done(resp: web.StreamResponse) -> None:
    """The last event of every stream."""
    await resp.write(b"data: [DONE]\n\n")


async def sse_error(resp: web.StreamResponse, exc: BaseException) -> None:
    """The error event that ends a stream whose generation failed (its headers said 200 already), then ``[DONE]``."""
    await sse(resp, error_body(status_of(exc), f"{type(exc).__name__}: {exc}"))
    await sse_done(resp)


def disconnected(request: web.Request) -> bool:
    """Whether the client went away. aiohttp does not cancel handlers itself (``handler_cancellation``
    is off), so a handler that waits checks this every ``DISCONNECT_POLL_S``."""
    return request.transport is None or request.transport.is_closing()


async def until_disconnect(request: web.Request, work: Awaitable[Any]) -> Any:
    """``await work``, cancelled (its requests aborted, as SGLang does) when the client disconnects;
    then None."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if disconnected(request):
                task.cancel()  # TorchEngine.generate aborts its unfinished requests when cancelled
                await asyncio.gather(task, return_exceptions=True)
                return None
    except asyncio.CancelledError:
        task.cancel()
        raise
