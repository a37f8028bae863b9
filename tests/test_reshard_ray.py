"""Reshard between real Ray actor meshes: a dp=2 FSDP2 trainer mesh (a test actor with the three
endpoints the Trainer role needs) pushes two versions into two RolloutWorker replicas through
``meshrl.reshard.meshes``; each replica must then generate what a fresh engine with the new
weights generates, and report the new version."""

from __future__ import annotations

import asyncio
import sys

import pytest
import ray.cloudpickle
import torch

from meshrl.actors.rollout import RolloutWorker
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.mesh import Actor, current_rank, endpoint, spawn_procs
from meshrl.reshard import DestLayout, GroupRanks, PushStats, ReshardConfig, SourceLayout
from meshrl.reshard.meshes import connect, push
from tiny import hf_model, qwen2

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules["tiny"])  # the trainer actors build models with it
pytestmark = pytest.mark.slow  # four torch-importing actors on two shared cores

ENGINE = TorchEngineConfig(max_batch_size=4, max_seq_len=32)
REQS = [GenerateRequest(input_ids=[3, 14, 15, 9], sampling=SamplingParams(max_new_tokens=6, temperature=0)),
        GenerateRequest(input_ids=[2, 7], sampling=SamplingParams(max_new_tokens=5, temperature=1.0, seed=11))]


def model(seed: int):
    return hf_model(qwen2(vocab_size=48, hidden_size=48, intermediate_size=64, positions=64), seed=seed, sharp=4.0)


class FsdpTrainer(Actor):
    """Stands in for the Trainer role: FSDP2 over dp, plus the reshard endpoints it must expose."""

    def __init__(self, seed: int) -> None:
        from torch.distributed.fsdp import fully_shard

        from meshrl.mesh import init_torch_distributed
        from meshrl.reshard.meshes import SourceSide

        torch.set_num_threads(1)
        mesh = init_torch_distributed(timeout=60)["dp"]
        self.model = model(seed)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.reshard = SourceSide(self.model.named_parameters)

    @endpoint
    def reshard_layout(self) -> SourceLayout:
        return self.reshard.layout()

    @endpoint
    def reshard_join(self, dest: DestLayout, ranks: GroupRanks, addr: str, port: int, config: ReshardConfig) -> None:
        self.reshard.join(dest, ranks, current_rank().rank, addr, port, config)

    @endpoint
    def reshard_send(self, version: int) -> PushStats:
        return self.reshard.send(version)

    @endpoint
    def train(self, seed: int) -> None:
        """Stands in for optimisation: load another model into the shards."""
        full = dict(model(seed).named_parameters())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                box = self.reshard.layout().index()[name].owned[current_rank().rank]
                p.to_local().copy_(full[name][tuple(slice(a, b) for a, b in box)])


def test_fsdp_trainer_mesh_to_rollout_replicas(ray_cluster, tmp_path):
    model(0).save_pretrained(tmp_path)
    trainer_procs = spawn_procs({"dp": 2}, cpus_per_proc=0.1, name="rs-trainer")
    rollout_procs = spawn_procs({"replica": 2}, cpus_per_proc=0.1, name="rs-rollout")
    try:
        trainer = trainer_procs.spawn("trainer", FsdpTrainer, 1)
        rollouts = rollout_procs.spawn("rollout", RolloutWorker, str(tmp_path), ENGINE)

        async def main():
            ranks = await connect(trainer, rollouts, ReshardConfig(bucket_bytes=16 * 1024, timeout_s=60))
            assert ranks == GroupRanks(src=(0, 1), dst=(2, 3), world_size=4)
            out = []
            for version, seed in ((1, 1), (2, 2)):
                if version == 2:
                    await trainer.train.call(seed).within(60)
                stats = await push(trainer, rollouts, version, timeout_s=60)
                assert stats.version == version and stats.bytes > 0
                assert list((await rollouts.version.call().within(30)).values()) == [version, version]
                out.append(list((await rollouts.generate.call(REQS).within(60)).values()))
            return out

        got = asyncio.run(main())
    finally:
        rollout_procs.stop()
        trainer_procs.stop()
    for (version, seed), per_replica in zip(((1, 1), (2, 2)), got):
        ref = asyncio.run(TorchEngine.from_hf_model(model(seed), config=ENGINE).generate(REQS))
        for results in per_replica:
            for r, g in zip(ref, results):
                c, d = r.completions[0], g.completions[0]
                assert d.output_ids == c.output_ids and d.versions == [version] * len(d.output_ids)
                assert torch.allclose(torch.tensor(d.logprobs), torch.tensor(c.logprobs), atol=1e-5)
