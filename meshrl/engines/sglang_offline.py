"""The HTTP surface of an in-process ``sglang.Engine``, for ``SGLangEngine(engine=...)``.

SGLang's offline ``Engine`` wraps its ``TokenizerManager``: every synchronous method builds an
``io_struct`` request and runs ``loop.run_until_complete(tokenizer_manager.<method>(obj, None))``
on the engine's own loop, so it fails when called from a coroutine on that loop. This backend
awaits the same ``tokenizer_manager`` coroutines directly instead, with the same request objects
the HTTP server builds from its JSON bodies (``managers/io_struct.py``), and answers like the
server: ``(status, {"success", "message"})``. Coroutines must run on the engine's loop
(``engine.loop.run_until_complete(...)``).

Written from SGLang 0.5.23's source (``entrypoints/engine.py``, ``managers/io_struct.py``); sglang
cannot be installed where meshrl's CI runs, so this module is not exercised there: the same
protocol code runs against the TorchEngine server over HTTP instead.
"""

from __future__ import annotations

import inspect
from typing import Any

# path -> (TokenizerManager coroutine, io_struct request class)
_CALLS = {
    "/init_weights_update_group": ("init_weights_update_group", "InitWeightsUpdateGroupReqInput"),
    "/destroy_weights_update_group": ("destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput"),
    "/update_weights_from_distributed": ("update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput"),
    "/begin_weight_update": ("begin_weight_update", "BeginWeightUpdateReqInput"),
    "/end_weight_update": ("end_weight_update", "EndWeightUpdateReqInput"),
    "/get_weights_by_name": ("get_weights_by_name", "GetWeightsByNameReqInput"),
    "/update_weight_version": ("update_weight_version", "UpdateWeightVersionReqInput"),
    "/pause_generation": ("pause_generation", "PauseGenerationReqInput"),
    "/continue_generation": ("continue_generation", "ContinueGenerationReqInput"),
}


def _as_reply(result: Any) -> tuple[int, Any]:
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        return 200, {"success": result[0], "message": str(result[1])}
    if hasattr(result, "success"):
        return 200, {"success": bool(result.success), "message": str(getattr(result, "message", ""))}
    return 200, result if result is not None else {"success": True, "message": ""}


class OfflineBackend:
    """``request(method, path, body)`` over ``sglang.Engine``'s tokenizer manager."""

    def __init__(self, engine: Any):
        from sglang.srt.managers import io_struct

        self.engine, self.tm, self.io = engine, engine.tokenizer_manager, io_struct

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        import sglang

        body = dict(body or {})
        if path in ("/get_server_info", "/server_info"):
            args = self.tm.server_args
            return 200, {"version": sglang.__version__, "tp_size": args.tp_size, "dp_size": args.dp_size}
        if path in ("/get_model_info", "/model_info"):
            return 200, self.engine.get_model_info() if hasattr(self.engine, "get_model_info") else {}
        if path == "/generate":
            try:
                return 200, await self.engine.async_generate(**body)
            except Exception as exc:  # an aborted single-prompt request raises what the server sends as 499
                status = getattr(exc, "status_code", None)
                if not isinstance(status, int):
                    raise
                return status, {"error": {"message": str(getattr(exc, "detail", exc))}}
        if path == "/flush_cache":
            out = await self.tm.flush_cache()
            return (200 if getattr(out, "success", True) else 400), {"success": getattr(out, "success", True)}
        if path == "/abort_request":
            self.tm.abort_request(rid=body.get("rid", ""), abort_all=bool(body.get("abort_all", False)))
            return 200, {"success": True, "message": ""}
        if path not in _CALLS:
            return 404, {"success": False, "message": f"{path} is not mapped for an in-process sglang.Engine"}
        method_name, struct = _CALLS[path]
        fn, cls = getattr(self.tm, method_name, None), getattr(self.io, struct, None)
        if fn is None or cls is None:
            return 404, {"success": False, "message": f"this sglang has no {method_name} / {struct} ({path})"}
        obj = cls(**body)
        takes_request = len(inspect.signature(fn).parameters) >= 2
        return _as_reply(await (fn(obj, None) if takes_request else fn(obj)))
