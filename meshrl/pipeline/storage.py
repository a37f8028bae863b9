"""Storage on a cluster: the directories a run's actors share with the driver, checked at start.

The trainer's ranks write checkpoints and ``final/`` under ``run.output_dir`` while the driver
writes ``metrics.jsonl`` and ``run_state.msgpack`` beside them and later reads all of it back to
resume; every role loads the model from the model directory. On one machine that is one disk. On
a cluster each node has its own, unless the directories sit on storage every node mounts at the
same path, and a run that wrote its checkpoint shards to the local disks of three nodes could never
resume. So before the first step the driver writes a probe file into the output directory; every
process that writes there reads it back and writes one of its own, which the driver then reads;
and every process that loads the model lists the model directory as the driver does. A node that
sees something else fails the run at start, naming the node, the role and the directory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

from meshrl.config import ConfigError

__all__ = ["PROBE_DIR", "check_storage", "directory_listing", "judge", "storage_report"]

PROBE_DIR = ".meshrl-probe"
"""Folder under ``run.output_dir`` the probe files go to (removed after the check)."""


def directory_listing(path: str) -> dict[str, int]:
    """The files directly in ``path`` and their sizes (what identifies a model directory)."""
    with os.scandir(path) as entries:
        return {e.name: e.stat().st_size for e in entries if e.is_file() and not e.name.startswith(".")}


def _node() -> str:
    """This process's node as the placement line names it (address/node id), outside Ray its address."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        from meshrl.groups import routable_ip

        return f"{routable_ip()}/------"
    return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:6]}"


def storage_report(out_dir: str | None, token: str, model_dir: str | None) -> dict[str, Any]:
    """Run in an actor: what it sees of the driver's probe in ``out_dir`` (and the probe it wrote
    back), and its listing of ``model_dir``."""
    report: dict[str, Any] = {"node": _node()}
    if out_dir is not None:
        probe = Path(out_dir) / PROBE_DIR
        try:
            report["saw"] = (probe / token).read_text() == token
        except OSError as exc:
            report["saw"], report["error"] = False, f"{type(exc).__name__}: {exc}"
        mine = f"{token}.{report['node'].replace('/', '-')}.{os.getpid()}"
        try:
            probe.mkdir(parents=True, exist_ok=True)
            (probe / mine).write_text(token)
            report["wrote"] = mine
        except OSError as exc:
            report["write_error"] = f"{type(exc).__name__}: {exc}"
    if model_dir is not None:
        try:
            report["model"] = directory_listing(model_dir)
        except OSError as exc:
            report["model"], report["model_error"] = None, f"{type(exc).__name__}: {exc}"
    return report


_SHARE = ("put it on storage every node mounts at the same path (NFS, a shared disk), or run the roles on "
          "the driver's node (cluster.<role>.resources)")


def judge(out_dir: Path, token: str, model_dir: str, reports: list[tuple[str, int, dict[str, Any]]]) -> None:
    """Raise ``ConfigError`` naming the first role rank whose node does not share the directories
    with the driver: its node saw no probe, could not write one, or wrote one the driver cannot
    read; or its listing of the model directory differs from the driver's."""
    expected = directory_listing(model_dir)
    for role, rank, r in reports:
        where = f"{role} rank {rank} on node {r['node']}"
        if "saw" in r:
            if not r["saw"]:
                why = r.get("error", "it holds other contents")
                raise ConfigError(f"`run.output_dir`: {out_dir} is not the driver's directory on {where}: it does "
                                  f"not see the probe file the driver wrote there ({why}); {_SHARE}")
            if "write_error" in r:
                raise ConfigError(f"`run.output_dir`: {where} cannot write to {out_dir} ({r['write_error']}): "
                                  "its checkpoints would be lost; make it writable there")
            back = out_dir / PROBE_DIR / r["wrote"]
            if not back.is_file() or back.read_text() != token:
                raise ConfigError(f"`run.output_dir`: the driver does not see the probe file {where} wrote to "
                                  f"{out_dir}: its checkpoints would land on that node alone; {_SHARE}")
        if "model" in r and r["model"] != expected:
            if r["model"] is None:
                why = r["model_error"]
            else:
                missing = sorted(set(expected) - set(r["model"]))
                other = sorted(k for k in expected if k in r["model"] and r["model"][k] != expected[k])
                why = (f"missing {missing[:3]}" if missing else f"{other[:3]} differ in size" if other
                       else f"extra files {sorted(set(r['model']) - set(expected))[:3]}")
            raise ConfigError(f"`model.path`: the model directory {model_dir} is not the driver's on {where} "
                              f"({why}); {_SHARE}, or copy it to that path on every node")


async def check_storage(out_dir: Path, model_dir: str, meshes: list[tuple[str, Any, bool]], timeout_s: float) -> int:
    """Probe ``out_dir`` from the meshes that write there and ``model_dir`` from all of them
    (``meshes``: role name, mesh, whether it writes); raise ``ConfigError`` if a node sees other
    directories than the driver. Returns the number of distinct nodes checked."""
    token = uuid.uuid4().hex
    probe = out_dir / PROBE_DIR
    probe.mkdir(parents=True, exist_ok=True)
    (probe / token).write_text(token)
    try:
        calls = [mesh._run_all(storage_report, str(out_dir) if writes else None, token, model_dir,
                               what=f"the storage check of {role}").within(timeout_s)
                 for role, mesh, writes in meshes]
        answers = await asyncio.gather(*calls)
        reports = [(role, rank, r) for (role, _, _), a in zip(meshes, answers) for rank, r in enumerate(a.values())]
        await asyncio.to_thread(judge, out_dir, token, model_dir, reports)
        return len({r["node"] for _, _, r in reports})
    finally:
        shutil.rmtree(probe, ignore_errors=True)


async def check_run_storage(roles: Any, out_dir: Path, model_dir: str, launched: bool, timeout_s: float,
                            echo: Callable[[str], None] = print) -> None:
    """``check_storage`` for a pipeline's roles: every node that writes under run.output_dir (the
    trainer's; the rollout workers' when they ``launched`` SGLang servers, whose logs go there) sees
    the driver's directory, and every node that loads the model sees the driver's model directory."""
    meshes = [("trainer", roles.trainer, True)]
    if roles.engines is not roles.trainer:
        meshes.append(("rollout", roles.engines, launched))
    meshes += [(name, mesh, False) for name, mesh in (("reward", roles.rewards), ("reference", roles.reference))
               if mesh is not None]
    nodes = await check_storage(out_dir, model_dir, meshes, timeout_s)
    if nodes > 1:
        echo(f"storage: {nodes} nodes see the driver's run.output_dir ({out_dir}) and model directory")
