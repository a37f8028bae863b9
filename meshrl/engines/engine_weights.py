"""TorchEngine's weight updates: staged versions that flip whole between two decode steps.

A mixin of ``TorchEngine`` (its state lives there: ``model``, ``_stage``, ``_version``, ``_batch``,
and the leader-driven TP fields of ``schedule.py``): SGLang's begin / load / end shape, the
in-place writers of the colocated mode, version labels, and checkpoint loads from disk. Under a
leader-driven TP engine each rank stages its own shard; a follower's ``end_weight_update`` goes
live at rank 0's flip to that version and returns then.
"""

from __future__ import annotations

import asyncio
import numbers
from typing import Any, Callable, Iterable

import torch

from meshrl.engines.weights import StagedWeights, stage_checkpoint


def _version_number(version: Any) -> int:
    """A policy version as a Python int; anything else (None, "v1", 1.5, True) is refused by name."""
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise ValueError(f"a policy version must be an integer, got {version!r}")
    return int(version)


class WeightUpdates:
    """The weight-update half of ``TorchEngine``'s interface."""

    async def begin_weight_update(self) -> None:
        """Start staging a new version; generation continues on the current weights meanwhile.

        Refused while another update is staging (two writers, or a retry that did not call
        ``abort_weight_update``): starting over would drop what was staged and publish a version
        that is only partly written."""
        if self._stage is not None:
            raise RuntimeError("begin_weight_update: a weight update is already staging; end it (end_weight_update) "
                               "or drop it (abort_weight_update) first")
        while self._sealed is not None:  # a follower: the version before waits for rank 0's flip to it
            await self._await_flip(f"begin_weight_update on TP rank {self.tp.rank}: version {self._sealed[1]} is still "
                                   f"staged after {self.tp.flip_timeout_s:g} s, waiting for rank 0's flip to it")
        self._stage = StagedWeights(self.model)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stage full, HF-named tensors (any subset, over several calls); invisible until the end."""
        if self._stage is None:
            raise RuntimeError("load_weights outside a weight update: call begin_weight_update first")
        self._stage.add(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)

    async def end_weight_update(self, version: int) -> None:
        """Make everything staged visible at once, between two steps, as policy ``version`` (on a
        leader-driven TP follower: at rank 0's flip to it, which this waits for)."""
        if self._stage is None:
            raise RuntimeError("end_weight_update without begin_weight_update")
        version = _version_number(version)  # before anything is applied: a bad one leaves the stage open
        stage, self._stage = self._stage, None
        if self.tp.is_follower:  # goes live when rank 0's flip to `version` reaches this rank (_flip_sealed)
            self._sealed = (stage, version)
            self._sealed_event.set()
            while self._version != version:  # returns once live, as on rank 0 (callers check the version)
                await self._await_flip(f"end_weight_update on TP rank {self.tp.rank}: rank 0 did not flip to version "
                                       f"{version} within {self.tp.flip_timeout_s:g} s (it stays staged here)")
                if self._sealed is None and self._version != version:
                    raise RuntimeError(f"end_weight_update on TP rank {self.tp.rank}: version {version} was dropped "
                                       "(abort_weight_update) before rank 0 flipped to it")
            return
        stage.apply()
        self._set_version(version)
        self._record(["flip", version])

    def staged_params(self) -> dict[str, torch.Tensor]:
        """Inside an update: staging copies of the local parameters (engine names) for writers that speak
        the engine layout (``meshrl.reshard``), applied whole by ``end_weight_update``; fill every element."""
        if self._stage is None:
            raise RuntimeError("staged_params outside a weight update: call begin_weight_update first")
        return self._stage.buffers()

    def live_params(self) -> dict[str, torch.Tensor]:
        """The parameters the steps read (engine names), for writers that fill them in place while the
        engine is paused (``ReshardConfig.apply = "in_place"``); the caller sets the version after."""
        self._no_in_place("live_params")
        if self._stage is not None:
            raise RuntimeError("live_params during a staged weight update: end or abort it first")
        return self.model.params

    async def abort_weight_update(self) -> None:
        """Drop whatever was staged (and a follower's ended stage); the engine keeps serving its version."""
        self._stage = self._sealed = None
        self._flipped_event.set()

    def write_params(self, write: Callable[[dict[str, torch.Tensor]], None], version: int) -> None:
        """``write(live params)``, then serve them as ``version``: synchronous, so between two steps, with
        no staging copy (colocated pushes whose sources all sit in this process)."""
        self._no_in_place("write_params")
        if self._stage is not None:
            raise RuntimeError("write_params during a staged weight update: end or abort it first")
        version = _version_number(version)
        with torch.no_grad():
            write(self.model.params)
        self._set_version(version)

    def set_version(self, version: int) -> None:
        """Label the current weights as policy ``version`` (SGLang's ``/update_weight_version``)."""
        self._leader_only("set_version")
        self._set_version(version)
        self._record(["version", self._version])

    def _set_version(self, version: int) -> None:
        self._version = _version_number(version)
        self._batch.mark_version(self._version)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """``begin_weight_update`` + ``load_weights`` + ``end_weight_update`` in one call; on a bad tensor
        nothing is applied and the engine stays on its version."""
        version = _version_number(version)
        await self.begin_weight_update()
        try:
            await self.load_weights(named_tensors)
        except BaseException:
            await self.abort_weight_update()
            raise
        await self.end_weight_update(version)

    async def update_weights_from_disk(self, path: str, version: int | None = None) -> int:
        """Load a checkpoint directory's safetensors (any subset of the model's tensors) as ``version``
        (default: the current one), between two steps; returns the tensors loaded. Nothing is applied
        when a name or shape does not fit. Under a TP leader each follower reads its own shard of the
        same files at the same step boundary (they must see ``path`` too)."""
        self._leader_only("update_weights_from_disk")
        version = self._version if version is None else _version_number(version)
        if self._stage is not None:
            raise RuntimeError("update_weights_from_disk during a staged weight update: end or abort it first")
        stage = stage_checkpoint(self.model, path)  # a bad checkpoint fails here, before any rank hears of it
        if self._channel is not None:  # every rank stages its shard now; all apply, or none does
            self._record(["load", path, version])
            self._publish(step=False)
            if not self._channel.agree(True):
                raise RuntimeError(f"a TP follower could not read its shard of {path!r} (its log says why); no rank "
                                   f"changed weights, the engine stays on version {self._version}")
        n = stage.apply()
        self._set_version(version)
        return n

    def get_weights_by_name(self, hf_name: str) -> torch.Tensor:
        """The current value of one HF-named weight, unfused (unsharded engines only)."""
        return self.model.get_hf(hf_name)

    async def _await_flip(self, timeout_message: str) -> None:
        """Follower: until its sealed stage goes live (or is dropped); ``TimeoutError`` after ``flip_timeout_s``."""
        self._flipped_event.clear()
        try:
            await asyncio.wait_for(self._flipped_event.wait(), self.tp.flip_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(timeout_message) from None
