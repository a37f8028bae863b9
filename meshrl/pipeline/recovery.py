"""Surviving the loss of a role's process (issue 28): what the controller does about a death.

```text
death(exc)          the role's death behind a failure (ActorFailure, SamplesLost), or None: a bug
Recovery.resumes    run.auto_resume: may this failure be resumed from the newest checkpoint?
Recovery.failed     one resume begins: its record, said in a line
Recovery.recovered  the resumed run is back: the recovery seconds, a marker on the dead role's lane
Recovery.restarted  Ray re-created a worker in place (run.max_worker_restarts); a rollout worker
                    serves again once loaded with the current weights (meshrl.pipeline.revival)
Recovery.revived    that rollout worker is back: its record and the recovery seconds
Recovery.reported   the run is over: the restarts that happened are reported before its log closes
Recovery.watch      the heartbeat: a process that answers none within run.heartbeat_timeout_s is
                    hung; it is killed, and its death takes one of the ways above
```

A hung process (stopped, stuck in a call that holds the GIL, on a node cut off) answers no
heartbeat: ``ActorMesh.heartbeat`` pings every actor from a concurrency group of its own, so a
long train step or generate still answers. The kill is Ray's (``ActorMesh.kill``), as if the
process died: a reward or reference worker with restarts left comes back in place, any other role
fails its callers with ``ActorFailure`` and the run resumes (``run.auto_resume``) or stops naming
the role.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

from meshrl.mesh import ActorFailure, RestartEvent, supervision
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.revival import Revivals, death
from meshrl.pipeline.rollout_loop import Roles

__all__ = ["Recovery", "death"]

RESTART_REPORT_S = 3.0
"""How long a finished run waits for supervision to report a restart that happened (its probe of the
new process answers up to a second after it is back), so the log holds its ``worker_restart``."""


class Recovery:
    """The run's resumes and in-place restarts, recorded and said (module docstring)."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.restarts: list[dict[str, Any]] = []
        """run.auto_resume: one entry per resume (the dead role, its cause, the recovery seconds)."""
        self.log: RunLog | None = None
        """The running attempt's log (None between attempts: a late event is only said)."""
        self.step: Callable[[], int] = lambda: 0
        self.revivals: Revivals | None = None
        """The running attempt's rollout workers, told of a restart (None between attempts)."""

    def resumes(self, cfg: PipelineConfig, exc: BaseException, *, stop_requested: bool) -> bool:
        """run.auto_resume: a role's process died, the restart budget is not spent, nobody asked to stop."""
        run = cfg.run
        if not run.auto_resume or stop_requested or death(exc) is None:
            return False
        if len(self.restarts) >= run.max_restarts:
            first = f"; the first failure was: {self.restarts[0]['cause']}" if self.restarts else ""
            exc.add_note(f"run.auto_resume: the run was resumed {len(self.restarts)} times (run.max_restarts="
                         f"{run.max_restarts}) and failed again{first}")
            return False
        return True

    def failed(self, cfg: PipelineConfig, exc: BaseException, step: int) -> None:
        """A resume begins: the dead role (``exc``'s death) and when, said in a line."""
        dead = death(exc) or exc
        role, rank, cause = ((dead.mesh, dead.rank, dead.cause) if isinstance(dead, ActorFailure)
                             else ("samples", -1, str(dead).splitlines()[0]))  # SamplesLost: their producer died
        self.restarts.append({"restart": len(self.restarts) + 1, "role": role, "rank": rank, "cause": cause,
                              "failed_at_step": step, "failed_at": time.time()})
        self.echo(f"recovering: {str(dead).splitlines()[0][:300]}; resuming from the newest checkpoint (restart "
                  f"{len(self.restarts)} of run.max_restarts={cfg.run.max_restarts})")

    def recovered(self, log: RunLog, step: int, *, kept: Sequence[str] = ()) -> None:
        """The resumed run is back at ``step``: its record (cause, steps lost, recovery seconds) and
        a marker on the dead role's lane of the timeline. Once per resume. ``kept``: the roles whose
        processes the failed attempt left to this one (run.warm_resume)."""
        if not self.restarts or "recovery_s" in self.restarts[-1]:
            return
        r = self.restarts[-1]
        r["recovery_s"] = round(time.time() - r["failed_at"], 3)
        r["resumed_at_step"] = step
        r["kept"] = list(kept)
        log.record("restart", **r)
        log.span(r["role"], "restart", 0.0, log.now(), restart=r["restart"])
        who = "samples the queue held were lost" if r["role"] == "samples" else f"{r['role']}/{r['rank']} died"
        self.echo(f"recovered in {r['recovery_s']:.1f}s: {who} at step {r['failed_at_step']}, the run goes on from step {step}"
                  + (f" ({', '.join(kept)} kept)" if kept else ""))

    def restarted(self, cfg: PipelineConfig, event: RestartEvent) -> None:
        """Ray re-created a worker (run.max_worker_restarts): a reward or reference worker's calls
        that failed are sent again by the rollout loops; a rollout worker takes requests again once
        the train loop has loaded it (``Revivals``). Said and recorded here."""
        if event.mesh == "rollout" and self.revivals is not None:
            self.revivals.restarted(event.rank, event.restarts)  # it serves the checkpoint's weights until loaded
        self.echo(f"restarted {event.mesh}/{event.rank} (restart {event.restarts} of run.max_worker_restarts="
                  f"{cfg.run.max_worker_restarts}): {event.cause[:200]}")
        if (log := self.log) is not None:
            log.record("worker_restart", role=event.mesh, rank=event.rank, restarts=event.restarts,
                       cause=event.cause[:500], step=self.step())
            log.span(event.mesh, "restart", log.now(), log.now(), worker=event.rank)

    async def reported(self, cfg: PipelineConfig) -> None:
        """Wait (at most ``RESTART_REPORT_S``) until supervision has reported every in-place restart
        under way, so a run that ends within a second of one still records it (``restarted``)."""
        if not cfg.run.max_worker_restarts:
            return
        restarting = await asyncio.to_thread(supervision.settle, RESTART_REPORT_S)
        await asyncio.sleep(0)  # (the reports are delivered onto this loop)
        if restarting:
            self.echo(f"the run ends while {', '.join(restarting)} restart(s): not waited for longer than "
                      f"{RESTART_REPORT_S:g}s")

    def revived(self, *, rank: int, version: int, step: int, recovery_s: float) -> None:
        """A restarted rollout worker serves ``version`` again, ``recovery_s`` after its death."""
        self.echo(f"rollout/{rank} is back in {recovery_s:.1f}s, serving v{version}; its requests in flight are re-issued")
        if (log := self.log) is not None:
            log.record("worker_revived", role="rollout", rank=rank, version=version, step=step, recovery_s=recovery_s)
            log.span("rollout", "revived", max(0.0, log.now() - recovery_s), log.now(), worker=rank)  # its time away

    async def watch(self, cfg: PipelineConfig, roles: Roles, log: RunLog) -> None:
        """The heartbeat of every role's processes, until cancelled (module docstring)."""
        timeout = cfg.run.heartbeat_timeout_s
        if timeout <= 0:
            return
        meshes = {**({"queue": roles.queue} if roles.queue is not roles.rollouts else {}), "rollout": roles.engines,
                  **({"reward": roles.rewards} if roles.rewards is not None else {}),
                  **({"trainer": roles.trainer} if roles.trainer is not roles.engines else {}),
                  **({"reference": roles.reference} if roles.reference is not None else {})}
        killed: set[tuple[str, int]] = set()  # not taken for hung again until it answers: its restart takes a while
        while True:
            started = time.monotonic()
            beats = await asyncio.gather(*(m.heartbeat(timeout) for m in meshes.values()))
            for (role, mesh), states in zip(meshes.items(), beats):
                for rank, state in states.items():
                    if state == "alive":
                        killed.discard((role, rank))
                    elif state == "hung" and (role, rank) not in killed:
                        self.echo(f"{role}/{rank} answered no heartbeat within run.heartbeat_timeout_s={timeout:g}s: "
                                  "taken for hung and killed, so that it is restarted or the run resumed")
                        log.record("hung", role=role, rank=rank, step=self.step(), timeout_s=timeout)
                        log.span(role, "hung", log.now(), log.now(), worker=rank)
                        mesh.kill(rank)
                        killed.add((role, rank))
            await asyncio.sleep(max(0.0, timeout / 4 - (time.monotonic() - started)))
