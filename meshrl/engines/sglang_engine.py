"""SGLangEngine: the ``Engine`` interface over an SGLang server URL or an in-process ``sglang.Engine``.

A thin translation (``shared/SGLANG_PROTOCOL.md``): ``generate`` posts one ``/generate`` per
request (``max_new_tokens`` always sent, ``return_logprob`` on, ``rid`` = the request id; the
n samples of an n > 1 request as a batch of n prompts ``{rid}_{i}``, each seeded ``mix_seed(seed, i)``,
since SGLang renames the samples of an n > 1 request where no abort reaches them) and reads ``output_ids``, ``output_token_logprobs[i][0]``, ``finish_reason["type"]`` and the
per-token ``weight_versions`` spans (0.5.23; older releases: ``weight_version`` for every token);
``pause``/``resume``/``abort`` map to ``/pause_generation`` (``keep`` -> ``in_place``),
``/continue_generation`` and ``/abort_request``; ``update_weights`` makes this process rank 0 of
SGLang's weight-update group and runs ``meshrl.reshard.sglang.SGLangWeightSender`` (pause, begin,
buckets, flush, end, continue). To push to several servers at once, give one sender all of them.

Every HTTP call has a timeout; calls that are safe to repeat (reads, pause/continue/abort/flush)
are retried on connection errors, the others never (a repeated ``/generate`` would generate twice).
The server's version (``/get_server_info``) is read once and gates ``sampling_seed`` (0.5.3+; seen
on 0.5.17) and ``in_place`` pauses (0.5.10+). With ``reissue_aborted``, samples the server aborts on
its own (a weight push's pause in abort mode) are sent again, each alone with its own seed.

Simplification, on purpose: log-probs are whatever SGLang returns for the sampled tokens (the
``Engine`` protocol asks for temperature-scaled log-probs; SGLang computes them after its own
logit processing, which matches for plain temperature sampling).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from typing import Any, Iterable, Sequence

import msgspec

from meshrl.engines.sampling import mix_seed
from meshrl.engines.types import Completion, GenerateRequest, GenerateResult, PauseMode, SamplingParams
from meshrl.reshard.sglang import SGLangSyncConfig, SGLangWeightSender, parse_version

__all__ = ["SGLangEngine", "SGLangEngineConfig"]

_ABORT_TIMEOUT_S = 10.0
"""How long an abort of a request given up on may take (best effort: a dead server must not stall the caller)."""

_RETRY_SAFE = {"/get_server_info", "/server_info", "/get_model_info", "/model_info", "/health", "/health_generate",
               "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache", "/get_weights_by_name"}


_CONTROL_CONNECTIONS = 16
"""Connections beyond ``max_connections`` for control calls."""


class SGLangEngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to talk to one SGLang server."""

    request_timeout_s: float = 60.0
    """Bound on one control call (pause, flush, info, ...)."""
    generate_timeout_s: float = 3600.0
    """Bound on one /generate call."""
    retries: int = 3
    """Extra attempts for retry-safe calls after a connection error."""
    retry_backoff_s: float = 0.5
    """Sleep before the first retry; doubles each time."""
    max_connections: int = 256
    """Concurrent /generate calls to the server; control calls (pause, abort, flush, ...) have room
    beyond it, so a full pool of generations never holds up the pause of a weight sync."""
    initial_version: int = 0
    """Policy version the server starts with (SGLang reports 'default' until told otherwise)."""
    reissue_aborted: int = 0
    """Times a sample the server aborted on its own (a pause for a weight push in abort mode) is sent
    again, alone and with its own seed, so it comes back whole from the new weights; 0: returned as
    aborted. Requests aborted through ``abort`` are never sent again."""
    sync: SGLangSyncConfig = SGLangSyncConfig()
    """How ``update_weights`` pushes (bucket size, backend, pause mode, timeouts)."""


class SGLangEngine:
    """An SGLang server (``url``) or in-process ``sglang.Engine`` (``engine=``) behind the ``Engine`` protocol."""

    def __init__(self, url: str | None = None, *, engine: Any = None, config: SGLangEngineConfig = SGLangEngineConfig()):
        if (url is None) == (engine is None):
            raise ValueError("SGLangEngine needs exactly one of url='http://host:port' or engine=sglang.Engine(...)")
        self.url, self.config = (url.rstrip("/") if url else None), config
        self._offline = None
        if engine is not None:
            from meshrl.engines.sglang_offline import OfflineBackend

            self._offline = OfflineBackend(engine)
        self._session: Any = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._generating: asyncio.Semaphore | None = None
        self._in_flight: dict[str, int] = {}
        """Request id -> n of the /generate calls under way (an n > 1 request is aborted sample by sample)."""
        self._server_version: tuple[int, int, int] | None = None
        self._version = config.initial_version
        self._sender: SGLangWeightSender | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._aborted: set[str] = set()
        """Request ids ended through ``abort``: their aborted samples are not sent again."""
        self.reissued = 0
        """Samples sent again after the server aborted them (``reissue_aborted``)."""

    @classmethod
    def launch(cls, config: SGLangEngineConfig = SGLangEngineConfig(), **server_args: Any) -> "SGLangEngine":
        """Start an in-process ``sglang.Engine(**server_args)`` (``pip install meshrl[sglang]``)."""
        try:
            import sglang
        except ImportError as exc:
            raise ImportError("SGLangEngine.launch needs sglang: pip install 'meshrl[sglang]'") from exc
        return cls(engine=sglang.Engine(**server_args), config=config)

    @property
    def name(self) -> str:
        return self.url or "in-process"

    @property
    def version(self) -> int:
        """The policy version this process last pushed (or read with ``refresh_version``)."""
        return self._version

    # ---- transport --------------------------------------------------------------------------

    async def _http(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            if self._session is not None and not self._session.closed:  # made on a loop that is gone or elsewhere
                with contextlib.suppress(Exception):  # its transports may belong to a closed loop: best effort
                    await self._session.close()
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                limit=self.config.max_connections + _CONTROL_CONNECTIONS))
            self._generating = asyncio.Semaphore(self.config.max_connections)
            self._session_loop = loop
        return self._session

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> tuple[int, Any]:
        """One call: ``(HTTP status, JSON or text reply)``; retried on connection errors when safe."""
        timeout = timeout_s or self.config.request_timeout_s
        if self._offline is not None:
            try:
                return await asyncio.wait_for(self._offline.request(method, path, body), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{method} in-process {path}: no reply within {timeout}s") from None
        import aiohttp

        session, delay = await self._http(), self.config.retry_backoff_s
        attempts = 1 + (self.config.retries if path in _RETRY_SAFE else 0)
        where = f"{method} {self.url}{path}"
        for attempt in range(attempts):
            async with contextlib.AsyncExitStack() as stack:
                if path == "/generate":  # generations queue here, not in the pool control calls need
                    try:
                        await asyncio.wait_for(self._generating.acquire(), timeout)
                    except asyncio.TimeoutError:
                        raise TimeoutError(f"{where}: no free slot within {timeout}s (max_connections="
                                           f"{self.config.max_connections} generations in flight); not sent") from None
                    stack.callback(self._generating.release)
                try:
                    resp = await stack.enter_async_context(session.request(
                        method, self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)))
                    if resp.content_type == "application/json":
                        return resp.status, await resp.json()
                    return resp.status, await resp.text()
                except asyncio.TimeoutError:
                    raise TimeoutError(f"{where}: no reply within {timeout}s") from None
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:  # refused, reset, cut short
                    if attempt + 1 == attempts:
                        raise ConnectionError(f"{where}: {type(exc).__name__}: {exc} (after {attempts} attempts)") from exc
                except json.JSONDecodeError as exc:  # a JSON body that does not parse
                    raise RuntimeError(f"{where}: the reply is not valid JSON ({exc})") from exc
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    async def _ok(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        status, reply = await self.request(method, path, body)
        if status != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            raise RuntimeError(f"{method} {self.name}{path} failed: HTTP {status} {reply!r}"[:1000])
        return reply

    async def server_version(self) -> tuple[int, int, int]:
        """The SGLang release the server reports (read once)."""
        if self._server_version is None:
            info = await self._ok("/get_server_info", method="GET")
            self._server_version = parse_version(info.get("version", "0"))
        return self._server_version

    # ---- Engine protocol --------------------------------------------------------------------

    def _sampling(self, sp: SamplingParams, version: tuple[int, int, int], sample: int | None = None) -> dict[str, Any]:
        """SGLang's sampling params of ``sp``; ``sample``: one of its n samples, sent as a prompt of its
        own (n = 1) whose seed is that sample's (``mix_seed``, as TorchEngine seeds its rows)."""
        out: dict[str, Any] = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                               "top_k": sp.top_k, "ignore_eos": sp.ignore_eos, "n": sp.n if sample is None else 1}
        if sp.stop_token_ids:
            out["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.seed is not None:
            # sampling_seed came with deterministic sampling (sgl-project/sglang#10678, after 0.5.2); seen
            # on 0.5.17 and 0.5.23. A release between them that lacks it refuses the key with a 400.
            if version < (0, 5, 3):
                raise ValueError(f"per-request seeds need SGLang 0.5.3+ (sampling_seed); {self.name} runs {version}")
            out["sampling_seed"] = sp.seed if sample is None else mix_seed(sp.seed, sample)
        return out

    def _completion(self, out: dict[str, Any]) -> Completion:
        meta = out.get("meta_info") or {}
        ids = list(out.get("output_ids") or [])
        reason = meta.get("finish_reason") or {"type": "abort"}
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        if len(lps) != len(ids):
            raise RuntimeError(f"{self.name}: {len(lps)} log-probs for {len(ids)} output tokens")
        spans = meta.get("weight_versions")
        if self._server_version is not None and self._server_version < (0, 5, 0):
            versions = [self._version] * len(ids)  # 0.4.x has no weight versions: ours is the last push
        elif spans:
            versions = [self._as_version(meta.get("weight_version"))] * len(ids)  # tokens no span covers
            for s in spans:
                versions[int(s["start"]): int(s["end"])] = [self._as_version(s["version"])] * (int(s["end"]) - int(s["start"]))
        else:
            versions = [self._as_version(meta.get("weight_version"))] * len(ids)
        return Completion(output_ids=ids, logprobs=lps, versions=versions,
                          finish_reason=kind if kind in ("stop", "length") else "abort")

    def _as_version(self, v: Any) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            return self._version  # SGLang says "default" before any versioned update

    async def _generate_one(self, req: GenerateRequest, version: tuple[int, int, int]) -> GenerateResult:
        rid = req.request_id or f"meshrl-{self._prefix}-{next(self._ids)}"
        n = req.sampling.n
        if n == 1:
            body = {"input_ids": list(req.input_ids), "sampling_params": self._sampling(req.sampling, version),
                    "return_logprob": True, "stream": False, "rid": rid}
        else:
            # n samples as a batch of n prompts with ids of ours: SGLang gives the samples of an n > 1
            # request fresh ids of its own (TokenizerManager regenerate_rid), so neither an abort of
            # `rid` nor of `{rid}_{i}` would reach them; and each sample gets a seed of its own (one
            # sampling_seed for all n would draw the same tokens n times under deterministic inference).
            # Identical prompts still share their prefill through SGLang's radix cache.
            body = {"input_ids": [list(req.input_ids)] * n, "return_logprob": True, "stream": False,
                    "sampling_params": [self._sampling(req.sampling, version, i) for i in range(n)],
                    "rid": self._server_rids(rid, n)}
        self._in_flight[rid] = req.sampling.n
        try:
            status, reply = await self.request("POST", "/generate", body, timeout_s=self.config.generate_timeout_s)
        except BaseException:  # timed out, connection lost or cancelled: the server must not go on with it
            await self._abort_quietly(rid, req.sampling.n)
            raise
        finally:
            self._in_flight.pop(rid, None)
        if status == 400:
            raise ValueError(f"{self.name} rejected request {rid!r}: {reply}")
        if status == 499 and n == 1:
            # SGLang answers an aborted single-prompt request (a pause in abort mode, /abort_request)
            # with 499 "Request <rid> was aborted" (seen on 0.5.17); a batch gets 200, abort per output
            reply = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}
        elif status != 200:
            raise RuntimeError(f"{self.name}/generate failed for request {rid!r}: HTTP {status} {reply!r}"[:1000])
        outs = reply if isinstance(reply, list) else [reply]
        if len(outs) != req.sampling.n:
            raise RuntimeError(f"{self.name}: {len(outs)} outputs for n={req.sampling.n}")
        completions = [self._completion(o) for o in outs]
        for attempt in range(self.config.reissue_aborted):
            again = [i for i, c in enumerate(completions) if c.finish_reason == "abort"]
            if not again or rid in self._aborted:
                break
            # sample i alone, under its own seed (what its row of the batch had): the same draw, from
            # the weights the server serves once generation continues (it holds new requests till then)
            redo = await asyncio.gather(*(self._generate_one(self._sample_request(req, i, f"{rid}-re{attempt}-{i}"), version)
                                          for i in again))
            for i, result in zip(again, redo):
                completions[i] = result.completions[0]
            self.reissued += len(again)
        self._aborted.discard(rid)
        return GenerateResult(request_id=rid, prompt_tokens=len(req.input_ids), completions=completions)

    @staticmethod
    def _sample_request(req: GenerateRequest, i: int, rid: str) -> GenerateRequest:
        """Sample ``i`` of ``req`` as a request of its own (n = 1, the seed its row was sent with)."""
        sp = req.sampling
        seed = sp.seed if sp.seed is None or sp.n == 1 else mix_seed(sp.seed, i)
        return msgspec.structs.replace(req, request_id=rid, sampling=msgspec.structs.replace(sp, n=1, seed=seed))

    @staticmethod
    def _server_rids(rid: str, n: int) -> list[str]:
        """The ids the samples of request ``rid`` run under on the server: itself, or ``{rid}_{i}`` for
        n > 1 (a batch of n prompts with these ids, ``_generate_one``)."""
        return [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]

    async def _abort_quietly(self, rid: str, n: int = 1) -> None:
        """Best effort ``/abort_request`` for a request this process gave up on (a short timeout of its own)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(
                self.request("POST", "/abort_request", {"rid": r, "abort_all": False}, timeout_s=_ABORT_TIMEOUT_S)
                for r in self._server_rids(rid, n))), _ABORT_TIMEOUT_S)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """One /generate per request, all in flight at once (the server batches them); results in order.

        When one fails (or the call is cancelled) the others are cancelled and aborted on the server,
        so no request keeps running there, and a retry may reuse the request ids."""
        version = await self.server_version()
        tasks = [asyncio.ensure_future(self._generate_one(r, version)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "keep"):
            raise ValueError(f"pause mode must be 'abort' or 'keep', got {mode!r}")
        if mode == "keep" and await self.server_version() < (0, 5, 10):
            raise ValueError(f"in-place pause needs SGLang 0.5.10+; {self.name} runs {self._server_version}")
        await self._ok("/pause_generation", {"mode": "abort" if mode == "abort" else "in_place"})

    async def resume(self) -> None:
        await self._ok("/continue_generation", {})

    async def abort(self, request_id: str) -> None:
        """End ``request_id`` (all its samples) on the server; unknown or finished ids are a no-op."""
        if request_id in self._in_flight:
            self._aborted.add(request_id)  # its aborted samples are the caller's wish: not sent again
        for rid in self._server_rids(request_id, self._in_flight.get(request_id, 1)):
            await self._ok("/abort_request", {"rid": rid, "abort_all": False})

    async def update_weights(self, named_tensors: Iterable[Any] | dict[str, Any], version: int) -> None:
        """Push full HF-named tensors from this process (rank 0) and serve them as ``version``."""
        if self._sender is None:
            self._sender = SGLangWeightSender([self], self.config.sync)
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        await self._sender.push(items, version)
        self._version = int(version)

    # ---- extras -----------------------------------------------------------------------------

    async def refresh_version(self) -> int:
        """Read the server's ``weight_version`` (``/get_model_info``) into ``version`` (0.5+)."""
        if await self.server_version() < (0, 5, 0):
            return self._version  # 0.4.x keeps no weight version: ours is the last push
        info = await self._ok("/get_model_info", method="GET")
        self._version = self._as_version(info.get("weight_version"))
        return self._version

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """The first ``truncate_size`` rows of a weight, as nested lists (SGLang's check of an update)."""
        return await self._ok("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def flush_cache(self) -> bool:
        status, _ = await self.request("POST", "/flush_cache")
        return status == 200

    async def close(self) -> None:
        """Leave the weight-update group and close the HTTP session."""
        try:
            if self._sender is not None:
                await self._sender.close()
        finally:
            self._sender = None
            if self._session is not None and not self._session.closed:
                await self._session.close()
