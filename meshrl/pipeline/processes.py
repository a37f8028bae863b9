"""The processes of a run's roles: started where ``cluster.<role>`` says, stopped when an attempt
ends, or kept for the resumed one (``run.warm_resume``).

A resume used to stop every role and start them all again: on the 2-core laptop seconds of imports
per process, on GPUs a model load (and CUDA graph capture) per engine. Now only what must start
afresh does:

```text
an attempt fails (RoleProcesses.end):
  its meshes are parked instead of stopped, except
    the queue            its snapshot restores only into a fresh queue (two runs' samples never mix)
    the dead role        (death(failure))
    rollout workers      with tensor-parallel TorchEngines (their TP group is set up once per start)
  and all of them when run.auto_resume is off or the failure is no role's death
run.auto_resume resumes it:
  no checkpoint to resume from: the resume is a fresh start, and every parked mesh is stopped
  RoleProcesses.probe   before the roles start: a mesh whose every process answers a heartbeat
                        within PROBE_S is kept (rollout workers: and their SGLang servers answer
                        too), the others are stopped
  RoleProcesses.spawn   takes the kept mesh instead of starting the role
  then as on every resume: the trainer (or a colocated hybrid, trainer and engine in one process)
  loads the checkpoint (load_checkpoint restores all that save_checkpoint wrote: weights,
  optimiser, schedule, RNG, counters), every engine joins the new
  transfer group and is pushed the checkpoint's weights (at step 0 too: a kept engine may serve later
  ones); kept SGLang servers are joined by the trainer after it destroys the group they may still
  hold of a dead one (0.5.10+), and pushed the checkpoint's weights the same way; reward and reference
  workers hold none of the run's state
the run ends, or is not resumed: RoleProcesses.stop_parked
```

Rollout workers with SGLang are asked to stop their servers (``close_engine``) before they are
stopped, whenever that is: a server is the worker's child process, and a killed worker would leave it.

Each attempt's new actors are named role/rank in a Ray namespace of its own (the dead attempt's
names may linger); a kept process keeps its name in the attempt that started it. Work a failed
attempt left running in a kept process (a generate, a train step) finishes and is dropped: its
caller is gone, and the checkpoint's state replaces whatever it changed.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any, Callable

from meshrl import faults
from meshrl.mesh import ActorFailure, ActorMesh, ProcMesh, spawn_procs
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.revival import death
from meshrl.pipeline.startup import WORKER_ENV

__all__ = ["PROBE_S", "RoleProcesses"]

PROBE_S = 10.0
"""How long a parked mesh's processes have to answer the heartbeat that keeps them."""

KEEPABLE = ("trainer", "hybrid", "rollout", "reward", "reference")
"""The roles whose processes may serve a resumed attempt (module docstring)."""


class RoleProcesses:
    """The meshes of the running attempt, and those a failed one left (module docstring)."""

    def __init__(self, out_dir: Path, cfg: PipelineConfig) -> None:
        self._run = "".join(c if c.isalnum() or c in "-_." else "_" for c in out_dir.name)[:40] or "run"
        self._parked: dict[str, tuple[ProcMesh, ActorMesh]] = {}
        self._servers = cfg.rollout.engine.backend == "sglang"
        """The rollout workers run SGLang servers."""
        self._server_s = cfg.rollout.engine.sglang.stop_timeout_s + 30
        """How long a rollout worker may take to stop its SGLang server, or to show it answers."""
        self.new_attempt()

    def new_attempt(self) -> None:
        # the run's actors live in a Ray namespace of their own, named after the run (its output
        # directory): a second Pipeline in this program (or another program on the same cluster) has
        # meshes called "queue", "trainer", ... as well, and `ray list actors` tells the runs apart
        self.namespace = f"meshrl-{self._run}-{uuid.uuid4().hex[:6]}"
        self.meshes: dict[str, tuple[ProcMesh, ActorMesh]] = {}
        """The running attempt's: role name -> (its proc mesh, the actor mesh on it)."""
        self.taken: list[str] = []
        """The roles the running attempt took from the failed one, in the order it started them."""

    def spawn(self, cfg: PipelineConfig, name: str, cls: type, *args: Any, procs: int = 1,
              dims: dict[str, int] | None = None, gpus_per_proc: float = 0, **kwargs: Any) -> ActorMesh:
        """Reserve the role's processes where ``cluster.<role>`` says and start ``cls`` on them, or
        take the mesh a failed attempt left (``probe`` first)."""
        if (kept := self._parked.pop(name, None)) is not None:
            self.taken.append(name)
            self.meshes[name] = kept
            return kept[1]
        where = cfg.cluster.role(name)
        dims = dims or {"procs": procs}
        # rollout: each TP group on one node, replicas wherever they fit; others: all on one node
        pack: bool | str = where.pack and ("tp" if "tp" in dims else name != "rollout")
        mesh = spawn_procs(dims, gpus_per_proc=gpus_per_proc, resources=where.resources, labels=where.labels,
                           pack=pack, env={**WORKER_ENV, **faults.env()}, name=name, namespace=self.namespace,
                           timeout=cfg.cluster.placement_timeout_s)
        self.meshes[name] = (mesh, mesh.spawn(name, cls, *args, **kwargs))
        return self.meshes[name][1]

    @property
    def engines_kept(self) -> bool:
        """The running attempt's engines are a failed one's (rollout workers, or colocated hybrids)."""
        return bool({"rollout", "hybrid"} & set(self.taken))

    def placement_line(self) -> str:
        """Where each role's processes were reserved: one node address per rank, in rank order; and
        the Ray namespace of the run's actors (named role/rank in it)."""
        kept = f"; kept from the failed attempt (run.warm_resume), in its namespace: {', '.join(self.taken)}"
        return ("placed (node per rank): " + " | ".join(f"{m.name} {' '.join(m.nodes())}" for m, _ in self.meshes.values())
                + f"\nactors: role/rank in Ray namespace {self.namespace}" + (kept if self.taken else ""))

    @staticmethod
    def keepable(cfg: PipelineConfig, failure: BaseException | None) -> set[str]:
        """The roles whose meshes ``failure`` (the attempt's end, None: it did not fail) leaves for a resume."""
        dead = death(failure) if failure is not None else None
        if not (cfg.run.auto_resume and cfg.run.warm_resume) or dead is None:
            return set()
        keep = set(KEEPABLE) - {dead.mesh if isinstance(dead, ActorFailure) else ""}
        if cfg.rollout.engine.backend == "torch" and cfg.rollout.tp_size > 1:
            keep.discard("rollout")
        return keep

    async def end(self, cfg: PipelineConfig, failure: BaseException | None) -> None:
        """The attempt is over: park the meshes a resume may use again (``keepable``), stop the others."""
        await self.stop_parked()
        meshes, self.meshes = self.meshes, {}
        keep = self.keepable(cfg, failure)
        self._parked = {name: mesh for name, mesh in meshes.items() if name in keep}
        await self._stop({name: mesh for name, mesh in meshes.items() if name not in keep})

    async def probe(self, echo: Callable[[str], None]) -> None:
        """Keep the parked meshes whose every process answers a heartbeat (and whose SGLang servers
        answer a request); stop the rest."""
        for name, (_, actors) in list(self._parked.items()):
            states = await actors.heartbeat(PROBE_S)
            why = ", ".join(f"{name}/{r} {s}" for r, s in states.items() if s != "alive")
            if not why and name == "rollout":
                try:
                    await actors.check_engine.call(True).within(self._server_s)
                except Exception as exc:
                    why = f"its server: {str(exc).splitlines()[0][:200]}"
            if why:
                echo(f"warm resume: {name} is started again ({why})")
                await self._stop({name: self._parked.pop(name)})

    async def stop_parked(self) -> None:
        """Stop every mesh still parked."""
        parked, self._parked = self._parked, {}
        await self._stop(parked)

    async def _stop(self, meshes: dict[str, tuple[ProcMesh, ActorMesh]]) -> None:
        """Stop ``meshes``; SGLang rollout workers stop their servers first (a killed worker would leave
        them running). The stops happen even if this is cancelled meanwhile."""
        try:
            if self._servers and "rollout" in meshes:
                with contextlib.suppress(Exception):
                    await meshes["rollout"][1].close_engine.call().within(self._server_s)
        finally:
            for procs, _ in meshes.values():
                try:
                    procs.stop()
                except Exception:  # already dead, or Ray shut down: nothing left to stop
                    pass
