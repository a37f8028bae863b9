"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` over TorchEngine.

An external agent framework can drive rollouts through these endpoints while meshrl records what
it needs to train on them: every choice carries ``prompt_token_ids``, ``token_ids`` (the generated
ids, the stop token included) and a ``meshrl`` object with the per-token behaviour ``logprobs``
(the sampling distribution's, as in ``engines/types.py``) and the policy ``versions`` that
produced them, whether or not the request asked for OpenAI ``logprobs``; those are served in
OpenAI's shape when asked. Chat messages are rendered with the tokenizer's chat template, or, for a
model without one, with ``SIMPLE_CHAT_TEMPLATE`` (``role: content`` lines, then ``assistant:``).

``stream: true`` answers with server-sent events in OpenAI's chunk shapes (``chat.completion.chunk``
with a ``delta``, or ``text_completion`` pieces), each also carrying the chunk's ``token_ids`` and
``meshrl`` log-probs and versions, then a ``usage`` chunk when ``stream_options.include_usage``, then
``data: [DONE]``. Text that could be the start of a stop string is held back until it is not.

A stop string ends generation as soon as its text appears, streamed or not: one that is one token
through the engine's stop ids, a longer one by reading the output as it is decoded (every
``stream_interval_steps``) and aborting the request once each of its choices has met one;
``token_ids`` end with the token that completed it. Without ``max_tokens`` (or
``max_completion_tokens``) a chat answer may fill the context (``max_seq_len`` less the prompt),
as OpenAI's and vLLM's do; ``/v1/completions`` keeps OpenAI's default of 16 tokens there.

Errors are OpenAI's error object, as on every path of the server (``serve_http.py``: aiohttp's 404
and 405 too): 400 naming the field for a bad request (a chat template that refuses the messages
included), 503 while the memory is released (``/release_memory_occupation``) or after a failed
step, 504 for a request that waits past the engine's ``generate_timeout_s`` (paused). A request
ended by ``/pause_generation`` (mode ``abort``, as before a weight update) answers
``finish_reason="abort"`` (as ``/generate`` reports it) with the tokens generated so far. A client
that disconnects has its requests aborted, streamed or not, as on ``/generate``.

Simplifications on purpose: no ``tools`` / function calling (agents parse tool calls from the
text), no ``echo``, penalties only at their neutral values, and no alternatives in log-probs (the
engine keeps the sampled token's log-prob alone): chat's ``top_logprobs`` must be 0, and
``/v1/completions`` takes ``logprobs`` 0 or 1 and lists the sampled token alone in each entry of
``top_logprobs`` (the most likely one only under greedy decoding).
Message content may be a string or a list of text parts; without a chat template the roles are
OpenAI's (``_SIMPLE_ROLES``). OpenAI's defaults spelled out (``response_format: {"type": "text"}``,
``parallel_tool_calls: true``, ``tool_choice: "none"``, or ``"auto"`` with no tools) are accepted.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from aiohttp import web
from jinja2 import TemplateError

from meshrl.engines.serve_http import (DISCONNECT_POLL_S, ENGINE_ERRORS, BadRequest, client_closed, disconnected,
                                       engine_error, flag, is_int, read_json, sse, sse_done, sse_error, sse_response,
                                       until_disconnect)
from meshrl.engines.streaming import IncrementalText, Merged
from meshrl.engines.types import GenerateRequest, SamplingParams

__all__ = ["SIMPLE_CHAT_TEMPLATE", "OpenAIServer", "load_hf_tokenizer", "render_simple_chat"]

SIMPLE_CHAT_TEMPLATE = "{role}: {content}\n"
"""One line per message for models without a chat template; the prompt ends with ``assistant:``."""

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "user", "logprobs",
           "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "return_token_ids", "stream_options"}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
                   "parallel_tool_calls"}
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "echo": False, "best_of": 1,
            "suffix": None, "top_logprobs": 0, "tools": None, "tool_choice": None, "response_format": None,
            "parallel_tool_calls": None}
_ALSO_NEUTRAL = {"response_format": [{"type": "text"}], "parallel_tool_calls": [True], "tool_choice": ["none", "auto"]}
"""OpenAI's defaults, as clients that always send them spell them ("auto" with no tools means "none")."""
_SIMPLE_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles ``SIMPLE_CHAT_TEMPLATE`` renders (a checkpoint's own template decides for itself)."""
_MAX_STOPS = 4  # OpenAI's limit


def _text_content(content: Any) -> str | None:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined
    (the shape OpenAI's SDKs send); None when it holds anything else (an image, ...)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    return None


def render_simple_chat(messages: list[dict[str, Any]]) -> str:
    return "".join(SIMPLE_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + "assistant:"


def load_hf_tokenizer(path: str | None) -> Any:
    """The checkpoint's transformers tokenizer (for these endpoints), or None when it has none."""
    if not path or not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class OpenAIServer:
    """The OpenAI handlers for one engine; the tokenizer (transformers) is the checkpoint's."""

    def __init__(self, engine: Any, tokenizer: Any, *, model_name: str = "meshrl") -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self._ids = itertools.count()

    def routes(self) -> list[tuple[str, str, Any]]:
        return [("POST", "/v1/completions", self.completions), ("POST", "/v1/chat/completions", self.chat),
                ("GET", "/v1/models", self.models)]

    # -- request parsing ----------------------------------------------------------------------

    def _check(self, body: Any, allowed: set[str], endpoint: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        unknown = sorted(k for k in body if k not in allowed)
        if unknown:
            raise BadRequest(f"{endpoint}: unknown fields {unknown}")
        if not isinstance(body.get("stream", False), (bool, type(None))):
            raise BadRequest(f"{endpoint}: stream must be true or false, got {body['stream']!r}")
        options = body.get("stream_options")
        if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}
                                        and isinstance(options.get("include_usage", False), bool)):
            raise BadRequest(f"{endpoint}: stream_options may hold include_usage (true or false) only, got {options!r}")
        for key, neutral in _NEUTRAL.items():
            if body.get(key) not in (neutral, None, [], {}) and body.get(key) not in _ALSO_NEUTRAL.get(key, []):
                raise BadRequest(f"{endpoint}: {key}={body[key]!r} is not supported by TorchEngine (only {neutral!r})")
        return body

    def _sampling(self, body: dict[str, Any], max_tokens: Any, single_token_stops: tuple[int, ...]) -> SamplingParams:
        def get(key: str, default: Any) -> Any:
            return default if body.get(key) is None else body[key]

        try:  # SamplingParams checks the types: a string or a fraction where an int belongs is a 400
            return SamplingParams(
                max_new_tokens=max_tokens, temperature=get("temperature", 1.0), top_p=get("top_p", 1.0),
                top_k=get("top_k", -1), n=get("n", 1), seed=body.get("seed"), stop_token_ids=single_token_stops,
            )
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad sampling parameters: {exc}") from None

    def _stops(self, body: dict[str, Any], endpoint: str) -> tuple[list[str], tuple[int, ...]]:
        """The stop strings, and the token ids of those that are one token (the engine stops on them)."""
        stop = body.get("stop")
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > _MAX_STOPS:
            raise BadRequest(f"{endpoint}: stop must be a non-empty string or a list of at most {_MAX_STOPS} such "
                             f"strings, got {stop!r}")
        single = []
        for s in stops:
            ids = self._encode(s)
            if len(ids) == 1:
                single.append(ids[0])
        return stops, tuple(sorted(set(single)))

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer (no tokenizer files in the checkpoint): send token ids")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt) if self.tokenizer is not None else self._encode(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [ids for p in prompt for ids in self._prompts(p)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return prompt
        raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of such lists")

    # -- generation and answers ---------------------------------------------------------------

    def _requests(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerateRequest]:
        return [GenerateRequest(input_ids=p, sampling=sampling, request_id=f"oai-{next(self._ids)}") for p in prompts]

    async def _generate(self, request: web.Request, prompts: list[list[int]], sampling: SamplingParams,
                        stops: list[str]) -> list[dict[str, Any]] | None:
        """One dict per choice (prompt-major): ids, text, finish reason, log-probs, versions; None
        when the client went away (its requests were aborted, freeing their batch rows)."""
        if stops:
            return await self._generate_watched(request, prompts, sampling, stops)
        results = await until_disconnect(request, self.engine.generate(self._requests(prompts, sampling)))
        if results is None:
            return None
        return [{"prompt_ids": prompt, "ids": c.output_ids, "text": self._decode(c.output_ids), "logprobs": c.logprobs,
                 "versions": c.versions, "finish": c.finish_reason}
                for prompt, res in zip(prompts, results) for c in res.completions]

    async def _generate_watched(self, request: web.Request, prompts: list[list[int]], sampling: SamplingParams,
                                stops: list[str]) -> list[dict[str, Any]] | None:
        """``_generate`` with stop strings: read as it is decoded, as a stream is (``_next_piece``), so
        that a request ends when its choices have met their stop strings, not at ``max_tokens``."""
        requests = self._requests(prompts, sampling)
        merged = await Merged.open(self.engine, requests)
        choices = [_StreamedChoice(prompts[k // sampling.n], self._decode) for k in range(len(prompts) * sampling.n)]
        texts, finish = [""] * len(choices), [None] * len(choices)
        try:
            while True:
                if disconnected(request):
                    return None  # the client went away: close() aborts what runs
                try:
                    got = await self._next_piece(merged, requests, choices, sampling, stops)
                except StopAsyncIteration:
                    break
                if got is not None:
                    k, piece = got
                    texts[k] += piece["text"]
                    finish[k] = piece["finish"]
        finally:
            await merged.close()
        return [{"prompt_ids": c.prompt_ids, "ids": c.ids[: c.sent_ids], "text": text, "finish": f,
                 "logprobs": c.logprobs[: c.sent_ids], "versions": c.versions[: c.sent_ids]}
                for c, text, f in zip(choices, texts, finish)]

    async def _next_piece(self, merged: Merged, requests: list[GenerateRequest], choices: list[_StreamedChoice],
                          sampling: SamplingParams, stops: list[str]) -> tuple[int, dict[str, Any]] | None:
        """The next piece of a choice to answer: ``(choice index, piece)`` (``_StreamedChoice.add``), or
        None when the engine gave nothing for ``DISCONNECT_POLL_S`` (the caller checks its client). A
        request whose choices have all met a stop string is aborted at once, freeing its rows. Raises
        ``StopAsyncIteration`` once every choice has ended, and the engine's errors."""
        n = sampling.n
        while True:
            got = await merged.next(DISCONNECT_POLL_S)
            if got is None:
                return None
            i, delta = got
            k = i * n + delta.index
            piece = choices[k].add(delta, self, stops, sampling.stop_token_ids)
            if piece is None:
                continue
            rid = requests[i].request_id
            if all(c.done for c in choices[i * n:(i + 1) * n]) and self.engine.is_running(rid):
                await self.engine.abort(rid)  # every choice met a stop string: free its rows now
            return k, piece

    def _stop_end(self, ids: list[int], stops: list[str]) -> int:
        """The shortest prefix length whose text holds a stop string (the whole text does): a binary
        search, since a prefix's text only grows, so O(log n) decodes rather than n on the event loop."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            text = self._decode(ids[:mid])
            if any(s in text for s in stops):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _token_text(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else f"<{t}>"

    def _choice(self, i: int, c: dict[str, Any]) -> dict[str, Any]:
        return {"index": i, "finish_reason": c["finish"], "prompt_token_ids": c["prompt_ids"], "token_ids": c["ids"],
                "meshrl": {"logprobs": c["logprobs"], "versions": c["versions"],
                           "behavior_version": min(c["versions"]) if c["versions"] else self.engine.version}}

    def _usage(self, choices: list[dict[str, Any]], prompts: list[list[int]]) -> dict[str, int]:
        p, c = sum(len(x) for x in prompts), sum(len(x["ids"]) for x in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = self._check(await read_json(request), _COMPLETION, "/v1/completions")
        if "prompt" not in body:
            raise BadRequest("/v1/completions: send a prompt")
        prompts = self._prompts(body["prompt"])
        stops, single = self._stops(body, "/v1/completions")
        logprobs = body.get("logprobs")
        if logprobs is not None and not (is_int(logprobs) and 0 <= logprobs <= 1):
            raise BadRequest(f"/v1/completions: logprobs must be 0 or 1 (alternatives per token: the engine keeps "
                             f"the sampled token's log-prob alone), got {logprobs!r}")
        max_tokens = 16 if body.get("max_tokens") is None else body["max_tokens"]  # OpenAI's default; 0 is a 400
        sampling = self._sampling(body, max_tokens, single)
        if body.get("stream"):
            return await self._stream(request, body, prompts, sampling, stops, chat=False)
        try:
            choices = await self._generate(request, prompts, sampling, stops)
        except ENGINE_ERRORS as exc:  # the engine's own checks (prompt + max_tokens past max_seq_len), paused
            return engine_error(exc)  # past generate_timeout_s, the memory released or a failed step
        if choices is None:  # the client went away: its requests were aborted
            return client_closed()
        out = []
        for i, c in enumerate(choices):
            choice = {**self._choice(i, c), "text": c["text"], "logprobs": None}
            if body.get("logprobs") is not None:
                tokens = [self._token_text(t) for t in c["ids"]]
                offsets = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": c["logprobs"], "text_offset": offsets,
                                      "top_logprobs": [{t: lp} for t, lp in zip(tokens, c["logprobs"])]}
            out.append(choice)
        return web.json_response({"id": f"cmpl-{next(self._ids)}", "object": "text_completion", "created": int(time.time()),
                                  "model": body.get("model") or self.model_name, "choices": out,
                                  "usage": self._usage(choices, prompts)})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = self._check(await read_json(request), _CHAT, "/v1/chat/completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and _text_content(m.get("content")) is not None
                for m in messages):
            raise BadRequest("/v1/chat/completions: messages must be a non-empty list of {role, content} with text "
                             "content (a string, or a list of {type: text, text} parts)")
        messages = [{**m, "content": _text_content(m["content"])} for m in messages]
        flag(body, "logprobs", "/v1/chat/completions")  # "false" would be truthy
        prompt_ids = self._chat_prompt(messages)
        stops, single = self._stops(body, "/v1/chat/completions")
        # no limit means "up to the context" in OpenAI's API (EOS ends it first, as a rule); a prompt
        # that fills the context gets 1, which the engine refuses (a 400 naming max_seq_len)
        room = max(1, self.engine.cache.max_seq_len - len(prompt_ids))
        max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), room)
        sampling = self._sampling(body, max_tokens, single)
        if body.get("stream"):
            return await self._stream(request, body, [prompt_ids], sampling, stops, chat=True)
        try:
            choices = await self._generate(request, [prompt_ids], sampling, stops)
        except ENGINE_ERRORS as exc:  # the engine's own checks (prompt + max_tokens past max_seq_len), paused
            return engine_error(exc)  # past generate_timeout_s, the memory released or a failed step
        if choices is None:  # the client went away: its requests were aborted
            return client_closed()
        out = []
        for i, c in enumerate(choices):
            choice = {**self._choice(i, c), "message": {"role": "assistant", "content": c["text"]}, "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [{"token": (s := self._token_text(t)), "logprob": lp,
                                                   "bytes": list(s.encode()), "top_logprobs": []}
                                                  for t, lp in zip(c["ids"], c["logprobs"])]}
            out.append(choice)
        return web.json_response({"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": int(time.time()),
                                  "model": body.get("model") or self.model_name, "choices": out,
                                  "usage": self._usage(choices, [prompt_ids])})

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest("/v1/chat/completions needs the checkpoint's tokenizer (none was found)")
        if getattr(self.tokenizer, "chat_template", None):
            try:
                prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except TemplateError as exc:  # its raise_exception: no system role, roles must alternate, ...
                message = f"/v1/chat/completions: the model's chat template refused the messages: {exc}"
                raise BadRequest(message) from None
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        unknown = sorted({m["role"] for m in messages} - set(_SIMPLE_ROLES))
        if unknown:
            raise BadRequest(f"/v1/chat/completions: unknown roles {unknown}: this model has no chat template, and the "
                             f"simple one takes {list(_SIMPLE_ROLES)}")
        return self.tokenizer.encode(render_simple_chat(messages))

    # -- streaming ----------------------------------------------------------------------------

    async def _stream(self, request: web.Request, body: dict[str, Any], prompts: list[list[int]],
                      sampling: SamplingParams, stops: list[str], *, chat: bool) -> web.StreamResponse:
        """``stream: true``: one chunk per choice per engine read (``stream_interval_steps``)."""
        requests = self._requests(prompts, sampling)
        try:
            merged = await Merged.open(self.engine, requests)
        except ENGINE_ERRORS as exc:  # the engine's own checks, or the memory released: before the stream starts
            return engine_error(exc)
        choices = [_StreamedChoice(prompts[k // sampling.n], self._decode) for k in range(len(prompts) * sampling.n)]
        usage = (body.get("stream_options") or {}).get("include_usage", False)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name, **({"usage": None} if usage else {})}
        resp = sse_response()
        try:
            await resp.prepare(request)
            if chat:
                await sse(resp, {**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}
                                                     for k in range(len(choices))]})
            while True:
                try:
                    got = await self._next_piece(merged, requests, choices, sampling, stops)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # paused past generate_timeout_s (aborted), or a failed step
                    await sse_error(resp, exc)
                    return resp
                if got is None:
                    if disconnected(request):
                        return resp  # the client went away: close() aborts what runs
                    continue
                k, piece = got
                await sse(resp, {**head, "choices": [self._chunk_choice(k, choices[k], piece, body, chat)]})
            if usage:
                sent = [{"ids": c.ids[: c.sent_ids]} for c in choices]
                await sse(resp, {**head, "choices": [], "usage": self._usage(sent, prompts)})
            await sse_done(resp)
        except ConnectionResetError:
            pass  # the client went away
        finally:
            await merged.close()
        return resp

    def _chunk_choice(self, index: int, c: _StreamedChoice, piece: dict[str, Any], body: dict[str, Any],
                      chat: bool) -> dict[str, Any]:
        ids, lps, text, finish = piece["ids"], piece["logprobs"], piece["text"], piece["finish"]
        out: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None, "token_ids": ids,
                               "meshrl": {"logprobs": lps, "versions": piece["versions"]}}
        if chat:
            out["delta"] = {"content": text} if text or finish is None else {}
            if body.get("logprobs"):
                out["logprobs"] = {"content": [{"token": (s := self._token_text(t)), "logprob": lp, "bytes": list(s.encode()),
                                                "top_logprobs": []} for t, lp in zip(ids, lps)]}
        else:
            out["text"] = text
            if body.get("logprobs") is not None:
                tokens = [self._token_text(t) for t in ids]
                offsets = list(itertools.accumulate([c.token_chars] + [len(t) for t in tokens[:-1]]))
                c.token_chars += sum(len(t) for t in tokens)
                out["logprobs"] = {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets if tokens else [],
                                   "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)]}
        return out

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                              "owned_by": "meshrl"}]})


class _StreamedChoice:
    """One streamed choice: what the engine produced, its text so far, and what was sent of it."""

    def __init__(self, prompt_ids: list[int], decode: Any):
        self.prompt_ids = prompt_ids
        self.text = IncrementalText(decode)
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.sent_ids = 0  # tokens sent
        self.sent_text = 0  # characters of the text sent
        self.token_chars = 0  # characters of the sent tokens' own texts (legacy logprobs' text_offset)
        self.searched = 0  # characters of the text already searched for stop strings
        self.done = False

    @property
    def ids(self) -> list[int]:
        return self.text.ids

    def add(self, delta: Any, server: OpenAIServer, stops: list[str], stop_ids: tuple[int, ...]) -> dict[str, Any] | None:
        """Take an engine delta; the piece to send now (None: nothing new to say). Costs the delta's
        tokens, not the whole output: text is decoded incrementally and searched from where it was."""
        if self.done:  # cut at a stop string already: the rest of the sample is not the answer's
            return None
        self.text.extend(delta.output_ids)
        self.logprobs += delta.logprobs
        self.versions += delta.versions
        finish, end = delta.finish_reason, len(self.ids)
        text = server._decode(self.ids) if finish is not None else self.text.text  # the last: exactly as unstreamed
        longest = max((len(x) for x in stops), default=0)
        start = max(0, self.searched - longest + 1)
        cut = min((i for i in (text.find(x, start) for x in stops) if i >= 0), default=-1)
        self.searched = len(text)
        if cut >= 0:  # as the whole answer is cut: up to the token that completed the stop string
            end, text, finish = server._stop_end(self.ids, stops), text[:cut], "stop"
        elif finish == "stop" and self.ids and self.ids[-1] in stop_ids:
            text = server._decode(self.ids[:-1])  # a one-token stop string is not part of the text
        elif finish is None:  # hold back what may be the start of a stop string
            hold = max((k for x in stops for k in range(1, len(x)) if text.endswith(x[:k])), default=0)
            text = text[: len(text) - hold]
        new_text = text[self.sent_text:]
        if finish is None and not new_text and end == self.sent_ids:
            return None
        a = self.sent_ids
        piece = {"ids": self.ids[a:end], "logprobs": self.logprobs[a:end], "versions": self.versions[a:end],
                 "text": new_text, "finish": finish}
        self.sent_ids, self.sent_text = end, max(self.sent_text, len(text))
        self.done = finish is not None
        return piece
