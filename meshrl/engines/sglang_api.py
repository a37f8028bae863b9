"""SGLang's generation and control endpoints over TorchEngine: ``/generate``, health, info, pause, memory.

They speak the request/response schemas of SGLang's server (see ``shared/SGLANG_PROTOCOL.md``), so
agents, tools and meshrl's SGLang adapter can use them unchanged: ``meta_info`` carries
``finish_reason`` dicts, ``weight_version`` / ``weight_versions`` spans, and
``output_token_logprobs`` as ``[logprob, token_id, null]``; ``/health`` answers 503 while paused.
An aborted single-prompt request answers 499 ``Request <rid> was aborted``, as SGLang does (a batch
gets its outputs, an abort in each). ``SGLangServer.routes()`` are served by ``serve.make_app``
beside the weight-update endpoints (``serve_weights.py``) and OpenAI's (``openai_api.py``).

``stream: true`` answers with server-sent events as SGLang does by default: each chunk holds one
sample's whole output so far (``finish_reason`` null until its last chunk, ``index`` when there
are several outputs), then ``data: [DONE]``; chunks come every ``stream_interval_steps`` decode
steps (``streaming.py``).

Simplifications, on purpose: no incremental streaming output; no input-token or top-k log-probs;
sampling params that TorchEngine does not implement (``min_p``, penalties, ``stop`` strings,
grammars) are accepted only at their neutral value, anything else is a 400 naming the field;
``pause_generation`` takes ``abort``, ``in_place`` and ``retract``, where a retracted sequence is kept
as an in-place one is (it keeps its KV; SGLang would recompute it under the weights it resumes
with): a retract followed by ``/abort_request {abort_all}``, the trainer's abort without
SGLang's one-second wait, behaves exactly as on SGLang. Text in/out works only
when the checkpoint directory has a ``tokenizer.json``; otherwise the server behaves like SGLang
with ``skip_tokenizer_init``.
``/release_memory_occupation`` always frees the KV cache (and the weights when asked and started
with ``--enable-memory-saver``), and ``/resume_memory_occupation`` brings everything back at once.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

from aiohttp import web

from meshrl.engines.serve_http import (ABORTED_STATUS, DISCONNECT_POLL_S, ENGINE_ERRORS, BadRequest, client_closed,
                                       disconnected, engine_error, error_response, flag, is_int, read_json, sse,
                                       sse_done, sse_error, sse_response, until_disconnect)
from meshrl.engines.streaming import IncrementalText, Merged
from meshrl.engines.torch_engine import TorchEngine
from meshrl.engines.types import Completion, GenerateRequest, GenerateResult, SamplingParams
from meshrl.reshard.sglang import parse_version

__all__ = ["SGLANG_COMPAT_VERSION", "SGLangServer", "load_tokenizer"]

SGLANG_COMPAT_VERSION = "0.5.23"
"""The SGLang release whose HTTP surface this server follows (reported as ``version``)."""

_SUPPORTED_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n",
                       "sampling_seed"}
_NEUTRAL_SAMPLING = {"min_p": 0.0, "min_new_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                     "presence_penalty": 0.0, "stop": None, "json_schema": None, "regex": None, "ebnf": None,
                     "structural_tag": None, "logit_bias": None, "custom_params": None}
_IGNORED_SAMPLING = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
"""Accepted and not used by the engine (no_stop_trim is read by the reply's text: `_out`)."""
_GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
                    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "rid"}
_NULL_FIELDS = {"image_data", "audio_data", "video_data", "lora_path", "custom_logit_processor", "session_params",
                "return_hidden_states", "data_parallel_rank", "priority", "bootstrap_host", "bootstrap_port",
                "bootstrap_room", "input_embeds", "log_metrics", "modalities"}


def _per_prompt(body: dict[str, Any], key: str, n: int) -> list[bool]:
    value = body.get(key)
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"/generate: {key} has {len(value)} values for {n} prompts")
        return list(value)
    return [bool(value)] * n


_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def _memory_tags(body: dict[str, Any], where: str) -> set[str]:
    tags = body.get("tags")
    if tags is None:
        return {"kv_cache", "weights"}
    if not isinstance(tags, list) or not tags or any(t not in _MEMORY_TAGS for t in tags):
        raise BadRequest(f"{where}: tags must be null or a non-empty list of {list(_MEMORY_TAGS)}, got {tags!r}")
    return set(tags)


def _sampling(d: dict[str, Any]) -> SamplingParams:
    if not isinstance(d, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(d).__name__}")
    for key, value in d.items():
        if key in _SUPPORTED_SAMPLING or key in _IGNORED_SAMPLING:
            continue
        if key in _NEUTRAL_SAMPLING:
            if value not in (_NEUTRAL_SAMPLING[key], None, [], ""):
                raise BadRequest(f"sampling param {key}={value!r} is not supported by TorchEngine "
                                 f"(only {_NEUTRAL_SAMPLING[key]!r})")
            continue
        raise BadRequest(f"unknown sampling param {key!r}")
    kw = {k: d[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "n") if d.get(k) is not None}
    kw.setdefault("max_new_tokens", 128)  # SGLang's default
    if d.get("stop_token_ids") is not None:
        if not isinstance(d["stop_token_ids"], list):
            raise BadRequest(f"bad sampling_params: stop_token_ids must be a list of token ids, got {d['stop_token_ids']!r}")
        kw["stop_token_ids"] = tuple(d["stop_token_ids"])  # SamplingParams checks each is an int
    if d.get("sampling_seed") is not None:
        kw["seed"] = d["sampling_seed"]
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"bad sampling_params: {exc}") from None


def _spans(versions: list[int]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang 0.5.23's ``weight_versions``: ``[{version, start, end}]``, end exclusive."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


class SGLangServer:
    """SGLang's handlers bound to one engine (and its ``tokenizer.json`` tokenizer, if any);
    ``compat_version``: the SGLang release whose surface to show."""

    def __init__(self, engine: TorchEngine, tokenizer: Any, server_args: dict[str, Any], compat_version: str):
        self.engine, self.tokenizer, self.server_args = engine, tokenizer, server_args
        self.compat_version, self.version = compat_version, parse_version(compat_version)

    def routes(self) -> list[tuple[str, str, Any]]:
        return [
            ("POST", "/generate", self.generate), ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health_generate), ("GET", "/get_model_info", self.model_info),
            ("GET", "/model_info", self.model_info), ("GET", "/get_server_info", self.server_info),
            ("GET", "/server_info", self.server_info), ("POST", "/pause_generation", self.pause),
            ("POST", "/continue_generation", self.resume), ("POST", "/abort_request", self.abort_request),
            ("GET", "/flush_cache", self.flush_cache), ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/get_weights_by_name", self.get_weights_by_name),
            ("GET", "/get_weights_by_name", self.get_weights_by_name),
            ("POST", "/release_memory_occupation", self.release_memory),
            ("POST", "/resume_memory_occupation", self.resume_memory),
        ]

    def _requests(self, body: dict[str, Any]) -> tuple[list[GenerateRequest], bool, list[bool]]:
        unknown = [k for k in body if k not in _GENERATE_FIELDS and k not in _NULL_FIELDS]
        if unknown:
            raise BadRequest(f"unknown /generate fields {unknown}")
        for k in _NULL_FIELDS:
            if body.get(k):
                raise BadRequest(f"/generate field {k!r} is not supported by TorchEngine")
        flag(body, "stream", "/generate")
        for key in ("return_logprob", "return_text_in_logprobs"):  # SGLang: one boolean, or one per prompt
            if not isinstance(body.get(key), list):
                flag(body, key, "/generate")
            elif not all(isinstance(v, bool) for v in body[key]):
                raise BadRequest(f"/generate: {key} must be true or false, or a list of them, got {body[key]!r}")
        if body.get("logprob_start_len", -1) not in (-1, None) or body.get("top_logprobs_num") \
                or body.get("token_ids_logprob"):
            raise BadRequest("only output-token log-probs are supported (logprob_start_len=-1, no top_logprobs_num)")
        if "input_ids" in body and body["input_ids"] is not None:
            ids = body["input_ids"]
        elif body.get("text") is not None:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer (no tokenizer.json): send input_ids")
            texts = body["text"]
            if not (isinstance(texts, str) or isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
                raise BadRequest("text must be a string or a non-empty list of strings")
            ids = [e.ids for e in self.tokenizer.encode_batch(texts)] if isinstance(texts, list) \
                else self.tokenizer.encode(texts).ids
        else:
            raise BadRequest("send input_ids (or text)")
        single = isinstance(ids, list) and bool(ids) and all(is_int(t) for t in ids)
        batch = [ids] if single else ids
        if not isinstance(batch, list) or not batch \
                or not all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in batch):
            raise BadRequest("input_ids must be a non-empty list of ints or a list of such lists")
        sp = body.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(batch)
        if len(sps) != len(batch):
            raise BadRequest(f"{len(sps)} sampling_params for {len(batch)} prompts")
        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else [rid] * len(batch) if single or rid is None else None
        if rids is None or len(rids) != len(batch) or not all(r is None or isinstance(r, str) for r in rids):
            raise BadRequest("rid must be a string (one prompt) or a list with one string id per prompt")
        for s in sps:
            if isinstance(s, dict):
                flag(s, "no_stop_trim", "/generate")
                if s.get("sampling_seed") is not None and self.version < (0, 5, 3):
                    raise BadRequest(f"unknown sampling param 'sampling_seed': it came with SGLang 0.5.3 (0.5.2 has "
                                     f"none), and this server shows {self.compat_version} (--compat-version)")
        # a server-made id must never be a client's rid (SGLang uses uuid4 hex as well)
        reqs = [GenerateRequest(input_ids=p, sampling=_sampling(s), request_id=r or uuid.uuid4().hex)
                for p, s, r in zip(batch, sps, rids)]
        return reqs, single, [bool(s.get("no_stop_trim")) for s in sps]

    def _out(self, res: GenerateResult, j: int, c: Completion, sp: SamplingParams, return_logprob: bool,
             with_text: bool, latency_s: float, no_stop_trim: bool = False, *, partial_text: str | None = None,
             token_texts: list[str | None] | None = None) -> dict[str, Any]:
        """One output in SGLang's shape. A streamed chunk before the last passes the text decoded so far
        (``partial_text``: whole characters only) and the token texts, instead of decoding it all again."""
        if c.finish_reason is None:  # a streamed chunk before the sample's last
            reason: dict[str, Any] | None = None
        elif c.finish_reason == "stop":
            reason = {"type": "stop", "matched": c.output_ids[-1]}
        elif c.finish_reason == "length":
            reason = {"type": "length", "length": sp.max_new_tokens}
        else:
            reason = {"type": "abort", "message": "Abort before or during generation."}
        meta: dict[str, Any] = {
            # SGLang gives the samples of an n > 1 request fresh ids (TokenizerManager regenerate_rid)
            "id": res.request_id if len(res.completions) == 1 else uuid.uuid5(uuid.NAMESPACE_OID, f"{res.request_id}/{j}").hex,
            "finish_reason": reason, "prompt_tokens": res.prompt_tokens, "completion_tokens": len(c.output_ids),
            "cached_tokens": 0, "weight_version": str(c.versions[-1] if c.versions else self.engine.version),
            "e2e_latency": latency_s,
        }
        if self.version >= (0, 5, 23):  # per-token spans came with 0.5.23
            meta["weight_versions"] = _spans(c.versions)
        if return_logprob:
            texts = token_texts if token_texts is not None else [self.tokenizer.decode([t]) for t in c.output_ids] \
                if with_text and self.tokenizer is not None else [None] * len(c.output_ids)
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(c.logprobs, c.output_ids, texts)]
            meta["input_token_logprobs"] = []
        out: dict[str, Any] = {"output_ids": c.output_ids, "meta_info": meta}
        if partial_text is not None:
            out = {"text": partial_text, **out}
        elif self.tokenizer is not None:
            # SGLang's detokenizer (trim_matched_stop) leaves the matched stop token out of the text
            shown = c.output_ids[:-1] if c.finish_reason == "stop" and not no_stop_trim else c.output_ids
            out = {"text": self.tokenizer.decode(shown), **out}
        return out

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        reqs, single, no_trim = self._requests(body)
        if body.get("stream"):
            return await self._generate_stream(request, body, reqs, no_trim)
        t0 = time.perf_counter()
        try:
            results = await until_disconnect(request, self.engine.generate(reqs))
        except ENGINE_ERRORS as exc:  # the engine's checks (prompt length, token ids, in-flight rid...), paused
            return engine_error(exc)  # past generate_timeout_s, the memory released or a failed step
        if results is None:  # the client went away: its requests were aborted
            return client_closed()
        if single and len(results[0].completions) == 1 and results[0].completions[0].finish_reason == "abort":
            # SGLang's reply to an aborted single-prompt request (a batch gets its outputs, abort in each)
            return error_response(ABORTED_STATUS, f"Request {reqs[0].request_id} was aborted")
        latency = time.perf_counter() - t0
        logprob, text = (_per_prompt(body, key, len(reqs)) for key in ("return_logprob", "return_text_in_logprobs"))
        outs = [self._out(res, j, c, r.sampling, lp, tx, latency, keep)
                for r, res, keep, lp, tx in zip(reqs, results, no_trim, logprob, text) for j, c in enumerate(res.completions)]
        return web.json_response(outs[0] if single and len(outs) == 1 else outs)

    async def _generate_stream(self, request: web.Request, body: dict[str, Any], reqs: list[GenerateRequest],
                               no_trim: list[bool]) -> web.StreamResponse:
        """``stream: true``: server-sent events as SGLang sends them by default: one ``data:`` chunk per
        sample per read (``stream_interval_steps``) holding the sample's whole output so far (not
        incremental), ``finish_reason`` null until its last chunk, ``index`` (the output's position,
        prompt-major) when there is more than one output, then ``data: [DONE]``."""
        logprob, text = (_per_prompt(body, key, len(reqs)) for key in ("return_logprob", "return_text_in_logprobs"))
        try:
            merged = await Merged.open(self.engine, reqs)
        except ENGINE_ERRORS as exc:
            return engine_error(exc)
        many = len(reqs) > 1 or any(r.sampling.n > 1 for r in reqs)
        so_far = [[Completion(output_ids=[], logprobs=[], finish_reason=None, versions=[]) for _ in range(r.sampling.n)]
                  for r in reqs]
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        texts = [[IncrementalText(decode) if decode else None for _ in range(r.sampling.n)] for r in reqs]
        token_texts: list[list[list[str | None]]] = [[[] for _ in range(r.sampling.n)] for r in reqs]
        t0 = time.perf_counter()
        resp = sse_response()
        try:
            await resp.prepare(request)
            while True:
                try:
                    got = await merged.next(DISCONNECT_POLL_S)
                except StopAsyncIteration:
                    await sse_done(resp)
                    break
                except Exception as exc:  # the engine failed or timed out: said in the stream, as SGLang does
                    await sse_error(resp, exc)
                    break
                if got is None:
                    if disconnected(request):
                        break  # the client went away: close() aborts what runs
                    continue
                i, delta = got
                c = so_far[i][delta.index]
                c.output_ids += delta.output_ids
                c.logprobs += delta.logprobs
                c.versions += delta.versions
                c.finish_reason = delta.finish_reason
                inc, tt = texts[i][delta.index], token_texts[i][delta.index]
                if inc is not None:  # this chunk costs its own tokens' decoding, not the whole output's
                    inc.extend(delta.output_ids)
                    if logprob[i] and text[i]:
                        tt += [decode([t]) for t in delta.output_ids]
                res = GenerateResult(request_id=reqs[i].request_id, prompt_tokens=len(reqs[i].input_ids),
                                     completions=so_far[i])
                out = self._out(res, delta.index, c, reqs[i].sampling, logprob[i], text[i], time.perf_counter() - t0,
                                no_trim[i], partial_text=None if inc is None or c.finish_reason else inc.text,
                                token_texts=tt if inc is not None and text[i] else None)
                if many:
                    out["index"] = sum(r.sampling.n for r in reqs[:i]) + delta.index
                await sse(resp, out)
        except ConnectionResetError:
            pass  # the client went away
        finally:
            await merged.close()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.broken is not None:
            return web.Response(status=503, text=self.engine.broken)
        if self.engine.is_paused or self.engine.is_updating or self.engine.memory_released:
            return web.Response(status=503, text="paused" if self.engine.is_paused else "updating weights"
                                if self.engine.is_updating else "memory released")
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.engine.is_paused or self.engine.is_updating:
            return web.Response(status=503, text="paused" if self.engine.is_paused else "updating weights")
        probe = GenerateRequest(input_ids=[0], sampling=SamplingParams(max_new_tokens=1, temperature=0),
                                request_id=f"health-{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(self.engine.generate([probe]), 20.0)
        except asyncio.TimeoutError:
            return web.Response(status=503, text="a one-token generation did not finish within 20 s")
        except (RuntimeError, ValueError) as exc:  # a failed step, or paused/updating just now
            return web.Response(status=503, text=f"a one-token generation failed: {exc}")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({
            "model_path": e.model_path, "tokenizer_path": e.model_path if self.tokenizer is not None else None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": str(e.version),
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": e.spec.model_type,
            "architectures": getattr(e.hf_config, "architectures", None),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({
            **self.server_args, "version": self.compat_version, "engine": "meshrl.TorchEngine",
            "model_path": e.model_path, "tp_size": e.tp.size, "dp_size": 1, "dtype": str(e.dtype).removeprefix("torch."),
            "device": str(e.device), "max_running_requests": e.max_batch_size, "context_length": e.cache.max_seq_len,
            "max_total_num_tokens": e.max_batch_size * e.cache.max_seq_len, "random_seed": e.config.seed,
            "skip_tokenizer_init": self.tokenizer is None, "weight_version": str(e.version),
        })

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await read_json(request, default={})).get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return error_response(400, f"pause mode {mode!r} is not one of 'abort', 'in_place', 'retract'")
        await self.engine.pause("abort" if mode == "abort" else "keep")
        return web.json_response({"success": True, "status": "ok", "message": "Generation paused successfully."})

    async def resume(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"success": True, "status": "ok", "message": "Generation continued successfully."})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request, default={})
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"/abort_request: rid must be a string, got {rid!r}")
        if flag(body, "abort_all", "/abort_request"):
            self.engine.abort_all()
        elif rid and self.engine.samples_of(rid) <= 1:
            # as in SGLang: the samples of an n > 1 request run under fresh ids of the server's, and its
            # own rid is forgotten, so neither reaches them (clients send n samples as a batch of
            # prompts with ids of their own instead, as SGLangEngine does); an unknown rid is a no-op
            await self.engine.abort(rid)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(status=200, text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")

    async def release_memory(self, request: web.Request) -> web.Response:
        """SGLang's ``/release_memory_occupation`` (a colocated trainer takes the device): ``tags``
        "kv_cache" and/or "weights" (null: both). TorchEngine frees the KV cache with any release, and
        the weights too when asked (they need ``--enable-memory-saver``: one contiguous buffer)."""
        body = await read_json(request, default={})
        tags = _memory_tags(body, "/release_memory_occupation")
        if self.engine.tp.size > 1:
            return error_response(400, "/release_memory_occupation is not served with --tp > 1 (it would free rank "
                                       "0's memory only)")
        if body.get("tags") is None and not self.engine.config.contiguous_weights:
            tags.discard("weights")  # null means all this server can release: the KV cache alone here
        try:
            self.engine.release_memory(weights="weights" in tags)
        except RuntimeError as exc:  # busy, or weights without a contiguous buffer
            return error_response(400, f"/release_memory_occupation: {exc}")
        return web.json_response({"success": True, "message": f"released {sorted(tags)}"})

    async def resume_memory(self, request: web.Request) -> web.Response:
        """SGLang's ``/resume_memory_occupation``: everything released comes back at once (whatever the
        tags); released weights hold no values until a whole version is written."""
        _memory_tags(await read_json(request, default={}), "/resume_memory_occupation")
        recaptured = self.engine.restore_memory()
        return web.json_response({"success": True, "message": "resumed" + (" (CUDA graphs re-captured)" if recaptured else "")})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name, rows = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise BadRequest(f"/get_weights_by_name: name must be a weight's name (a string), got {name!r}")
        if not is_int(rows) or rows < 1:
            raise BadRequest(f"/get_weights_by_name: truncate_size must be a positive integer, got {rows!r}")
        try:
            t = self.engine.get_weights_by_name(name)
        except KeyError as exc:
            raise BadRequest(f"/get_weights_by_name: {exc.args[0] if exc.args else name}") from None
        except ValueError as exc:  # a TP shard cannot rebuild a whole tensor
            raise BadRequest(f"/get_weights_by_name: {exc}") from None
        return web.json_response(t[:rows].float().tolist())


def load_tokenizer(path: str | None) -> Any:
    """The checkpoint's ``tokenizer.json`` (``tokenizers``), or None when it has none."""
    f = os.path.join(path, "tokenizer.json") if path else None
    if not f or not os.path.isfile(f):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f)
