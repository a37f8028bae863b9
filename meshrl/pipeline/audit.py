"""The ledger of samples (``run.audit``): nothing accepted is lost, nothing is trained twice.

A sample is known by its prompt position and its index in its group: the prompt ledger hands out
group ids and prompt positions together (``PromptLedger.take``: group ``g`` is the prompt at
position ``g``), so ``(group_id, index)`` names it, and the queue keeps and hands out whole groups.

The queue is the one that accepts, so it keeps the book: ``SampleQueue(ledger=True)`` notes every
group a put gave it and every group it dropped (stale past ``max_staleness`` under
``stale_policy=drop``, or left incomplete by a cancel), in order. The train loop reads the new
entries after each step and writes one ``audit`` record into metrics.jsonl::

    {"kind": "audit", "step": 7, "accepted": [[group_id, samples], ...], "dropped": [...], "trained": [[group_id, samples], ...]}

A checkpoint reads them up to its snapshot's ``ledger_mark``, so its lineage holds exactly the
puts its snapshot holds, however the replies of puts and snapshot cross. The records are part of
the run's lineage: a checkpoint keeps the records up to its step and a resumed run replays them
(work of steps past the checkpoint was discarded with the trainer state they produced, and is done
again), so the metrics.jsonl of a finished run, with however many resumes, is the history of the
weights it exported.

``check`` reads that history: a group trained in two steps is a double count; a group accepted
but neither trained, dropped nor still in the queue at the end is lost.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable

from meshrl.pipeline.rollout_loop import bounded

__all__ = ["AuditLog", "check"]

logger = logging.getLogger("meshrl.pipeline")


class AuditLog:
    """The train loop's side: the queue's ledger read after every step and at every checkpoint."""

    def __init__(self, log: Any, queue: Any, enabled: bool, timeout_s: float) -> None:
        self.log, self.queue, self.enabled, self.timeout_s = log, queue, enabled, timeout_s
        self._position = 0  # the queue's ledger, read up to here

    async def record(self, step: int, trained: Iterable[tuple[int, int]], *, upto: int | None = None) -> None:
        """The record of train step ``step``, whose batch held ``trained`` (``(group_id, samples)``);
        ``trained=()`` and ``upto`` at a checkpoint of step ``step``: what the queue took and dropped
        until its snapshot (``ledger_mark``), into its lineage."""
        if not self.enabled:
            return
        # waits for: the queue actor (it answers at once)
        entries, self._position = await bounded(self.queue.ledger.call_one(self._position, upto), self.timeout_s,
                                                "the queue's ledger")
        accepted, dropped = collections.Counter(), collections.Counter()
        for g, n, was_dropped in entries:
            (dropped if was_dropped else accepted)[g] += n
        trained = [[int(g), int(n)] for g, n in trained]
        if accepted or dropped or trained:
            self.log.record("audit", step=step, accepted=[[g, n] for g, n in accepted.items()],
                            dropped=[[g, n] for g, n in dropped.items()], trained=trained)

    async def verdict(self, step: int, echo: Callable[[str], None]) -> dict[str, Any]:
        """At the run's end (every rollout loop done): the ledger's verdict on its history, said in a line."""
        await self.record(step, ())  # puts after the last step's record
        queued = await bounded(self.queue.held_groups.call_one(), self.timeout_s, "the queue's groups")
        verdict = check(self.log.records, queued)
        if verdict["ok"]:
            echo(f"audit: {verdict['trained_samples']} samples trained, each once; {verdict['accepted_samples']} "
                 f"accepted, none lost ({sum(queued.values())} still queued)")
        else:
            logger.error("audit: groups trained twice %s, accepted and lost %s, trained but never accepted %s",
                         verdict["trained_twice"][:20], verdict["lost"][:20], verdict["unaccounted"][:20])
        return verdict


def check(records: Iterable[dict[str, Any]], queued: dict[int, int]) -> dict[str, Any]:
    """The ledger's verdict over a run's records; ``queued``: ``{group_id: samples}`` the queue
    still held at the end (accepted, not trained yet; read after the last record).

    Returns ``trained_samples``, ``accepted_samples``, ``dropped_samples``, ``trained_twice``
    (group ids trained in more than one step), ``lost`` (group ids accepted and neither trained,
    dropped nor queued) and ``unaccounted`` (group ids trained, or queued, but never accepted),
    sorted, and ``ok``."""
    accepted: dict[int, int] = collections.Counter()
    dropped: dict[int, int] = collections.Counter()
    trained: dict[int, int] = collections.Counter()
    twice: set[int] = set()
    for rec in records:
        if rec.get("kind") != "audit":
            continue
        for g, n in rec["accepted"]:
            accepted[g] += n
        for g, n in rec.get("dropped", ()):
            dropped[g] += n
        for g, n in rec["trained"]:
            if g in trained:
                twice.add(g)
            trained[g] += n
    lost = sorted(g for g, n in accepted.items() if trained[g] + dropped[g] + queued.get(g, 0) < n)
    unaccounted = sorted(g for g in set(trained) | set(queued) if trained[g] + queued.get(g, 0) > accepted[g])
    return {
        "trained_samples": sum(trained.values()), "accepted_samples": sum(accepted.values()),
        "dropped_samples": sum(dropped.values()), "trained_twice": sorted(twice), "lost": lost,
        "unaccounted": unaccounted, "ok": not twice and not lost and not unaccounted,
    }
