"""The ledger of samples (``run.audit``): nothing accepted is lost, nothing is trained twice.

A sample is known by its prompt position and its index in its group: the prompt ledger hands out
group ids and prompt positions together (``PromptLedger.take``: group ``g`` is the prompt at
position ``g``), so ``(group_id, index)`` names it, and the queue keeps and hands out whole groups.
The controller writes one ``audit`` record per train step into metrics.jsonl::

    {"kind": "audit", "step": 7, "accepted": [[group_id, samples], ...], "trained": [[group_id, samples], ...]}

``accepted``: the groups whose samples the queue took (``put_ref`` answered) since the previous
record; ``trained``: the groups of this step's batch. The records are part of the run's lineage:
a checkpoint keeps the records up to its step and a resumed run replays them (work of steps past
the checkpoint was discarded with the trainer state they produced, and is done again), so the
metrics.jsonl of a finished run, with however many resumes, is the history of the weights it
exported.

``check`` reads that history: a group trained in two steps is a double count; a group accepted
but neither trained nor still in the queue at the end is lost.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["AuditLog", "check"]


class AuditLog:
    """The controller's side: accepted groups gathered between steps, one record per step."""

    def __init__(self, log: Any, enabled: bool) -> None:
        self.log, self.enabled = log, enabled
        self._accepted: list[list[int]] = []

    def accepted(self, groups: Iterable[tuple[int, int]]) -> None:
        """Groups the queue took (``(group_id, samples)``), a ``put_ref`` that answered."""
        if self.enabled:
            self._accepted += [[int(g), int(n)] for g, n in groups]

    def trained(self, step: int, groups: Iterable[tuple[int, int]]) -> None:
        """The record of train step ``step``, whose batch held ``groups``; ``groups=()`` at a
        checkpoint of step ``step``: the groups accepted until its queue snapshot, into its lineage."""
        if self.enabled:
            accepted, self._accepted = self._accepted, []
            trained = [[int(g), int(n)] for g, n in groups]
            if accepted or trained:
                self.log.record("audit", step=step, accepted=accepted, trained=trained)


def check(records: Iterable[dict[str, Any]], queued: dict[int, int]) -> dict[str, Any]:
    """The ledger's verdict over a run's records; ``queued``: ``{group_id: samples}`` the queue
    still held at the end (accepted, not trained yet).

    Returns ``trained_samples``, ``accepted_samples``, ``trained_twice`` (group ids trained in more
    than one step) and ``lost`` (group ids accepted and neither trained nor queued), sorted, and
    ``ok``. (A group the queue took in the moment between a checkpoint's last record and its queue
    snapshot is trained without an ``accepted`` entry: not an error.)"""
    accepted: dict[int, int] = {}
    trained: dict[int, int] = {}
    twice: set[int] = set()
    for rec in records:
        if rec.get("kind") != "audit":
            continue
        for g, n in rec["accepted"]:
            accepted[g] = accepted.get(g, 0) + n
        for g, n in rec["trained"]:
            if g in trained:
                twice.add(g)
            trained[g] = trained.get(g, 0) + n
    lost = sorted(g for g, n in accepted.items() if trained.get(g, 0) + queued.get(g, 0) < n)
    return {
        "trained_samples": sum(trained.values()), "accepted_samples": sum(accepted.values()),
        "trained_twice": sorted(twice), "lost": lost, "ok": not twice and not lost,
    }
