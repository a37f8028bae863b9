"""An SGLang-compatible HTTP server over TorchEngine: ``python -m meshrl.engines.serve --model DIR``.

It speaks the request/response schemas of SGLang's ``/generate`` and control endpoints (see
``shared/SGLANG_PROTOCOL.md``), so agents, tools and meshrl's SGLang adapter can use it unchanged.
``make_app`` builds the aiohttp application (tests start it in-process on a free port) from the
endpoint modules, each of which builds on ``serve_http.py`` (request parsing, the one error format,
server-sent events, client disconnects) and on nothing of the others':

- ``sglang_api.py``: ``/generate`` (streamed or not), health, info, pause/continue/abort, flush,
  memory release and ``/get_weights_by_name``;
- ``serve_weights.py``: the distributed weight-update endpoints (``/init_weights_update_group``,
  ``/begin_weight_update``, ``/update_weights_from_distributed``, ...) and ``/update_weights_from_disk``;
- ``openai_api.py``: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``
  (token ids and behaviour log-probs in every answer, so meshrl can train on agent-driven rollouts).

More endpoints plug in through ``extra_routes`` or ``app.router`` with the engine at ``app[ENGINE]``.

``--tp N`` runs N processes, one TP rank each (``serve_cli.py``, ``schedule.py``): this one serves
HTTP and the others follow its schedule; the distributed weight-update endpoints and the memory
endpoints are then refused, and ``/update_weights_from_disk`` (each rank reads its shard) is how
weights change.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from aiohttp import web

from meshrl.engines import serve_cli
from meshrl.engines.openai_api import OpenAIServer, load_hf_tokenizer
from meshrl.engines.serve_http import READ_TIMEOUT_S, Handler, errors, read_bodies
from meshrl.engines.serve_weights import WeightSync
from meshrl.engines.sglang_api import SGLANG_COMPAT_VERSION, SGLangServer, load_tokenizer
from meshrl.engines.torch_engine import TorchEngine

__all__ = ["ENGINE", "SGLANG_COMPAT_VERSION", "load_hf_tokenizer", "load_tokenizer", "main", "make_app"]

ENGINE = web.AppKey("engine", TorchEngine)


def make_app(engine: TorchEngine, *, tokenizer: Any = None, server_args: dict[str, Any] | None = None,
             extra_routes: Iterable[tuple[str, str, Handler]] = (), compat_version: str = SGLANG_COMPAT_VERSION,
             hf_tokenizer: Any = "auto", model_name: str | None = None,
             read_timeout_s: float = READ_TIMEOUT_S) -> web.Application:
    """The aiohttp application serving ``engine``; ``extra_routes`` are ``(method, path, handler)``.

    ``tokenizer``: the ``tokenizer.json`` tokenizer of ``/generate``'s text in/out (``load_tokenizer``;
    None: token ids only, as SGLang with ``skip_tokenizer_init``).
    ``compat_version``: the SGLang release whose surface to show (``version`` in server info, and
    the weight-update branches of ``serve_weights``); older ones let adapters test their branches.
    ``hf_tokenizer``: the transformers tokenizer of the OpenAI endpoints (``openai_api``: text,
    chat template); "auto" loads the checkpoint's, None serves them on token ids only.
    ``read_timeout_s``: how long a request's whole body may take to arrive; after it the client gets
    a 408 and its connection is closed (``serve_http.read_bodies``).
    """
    if hf_tokenizer == "auto":
        hf_tokenizer = load_hf_tokenizer(engine.model_path)
    name = model_name or (os.path.basename(os.path.normpath(engine.model_path)) if engine.model_path else "meshrl")
    openai = OpenAIServer(engine, hf_tokenizer, model_name=name)
    sglang = SGLangServer(engine, tokenizer, dict(server_args or {}), compat_version)
    weights = WeightSync(engine, compat_version)
    app = web.Application(client_max_size=64 * 1024**2, middlewares=[errors, read_bodies(read_timeout_s)])
    app[ENGINE] = engine
    for method, path, handler in [*sglang.routes(), *weights.routes(), *openai.routes(), *extra_routes]:
        app.router.add_route(method, path, handler)

    async def start_engine(app: web.Application) -> None:
        await engine.start()  # a TP leader's heartbeats start now, not at the first request

    async def stop_engine(app: web.Application) -> None:
        await engine.shutdown()  # (and a TP leader's followers)

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.on_shutdown.append(weights.close)
    return app


def main(argv: list[str] | None = None) -> None:
    """``python -m meshrl.engines.serve``: parse the command line and serve ``make_app``'s application
    (``serve_cli.py``, which gets ``make_app`` passed in rather than importing this module back)."""
    serve_cli.main(argv, make_app)


if __name__ == "__main__":
    main()
