"""Armed receives (``Resharder.arm``) in layouts and sequences the pipeline's happy path does not
take, over a real gloo group between two real processes:

* a trainer rank that shares its process with an engine rank pushes through
  ``receive(sources=...)``; an engine rank of another process, armed, must hear that the version
  is being sent (else both wait out the timeout);
* an engine that re-joins the group (``DestSide.join``: ``connect`` again) while armed must be
  able to take the next version (the withdrawn receive's staging must not be left open).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import tiny
from meshrl.mesh.distributed import free_ports
from processes import run_processes

TIMEOUT_S = 10.0


def _engine_config():
    from meshrl.engines import TorchEngineConfig

    return TorchEngineConfig(max_batch_size=2, max_seq_len=32)


def _config():
    return tiny.qwen2(vocab_size=40, layers=1, heads=2, positions=32)


def _model(seed: int):
    return tiny.hf_model(_config(), seed=seed)


def _check(engine, state: dict[str, torch.Tensor], version: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    assert engine.version == version and not engine.is_updating
    for pl in engine.model.layout.params.values():
        for hf_name, src, dst in pl.local_slices(tp_rank, tp_size):
            assert torch.equal(engine.model.params[pl.name][dst], state[hf_name][src]), f"{pl.name} <- {hf_name}"


def _colocated_sender(proc: int, ports: list[int]) -> None:
    """Process 0: trainer rank 0 and engine rank 0 (tp 0/2); process 1: engine rank 1 (tp 1/2), armed."""
    import torch.distributed as dist

    from meshrl.engines import TorchEngine
    from meshrl.engines.tp import TensorParallel
    from meshrl.mesh.distributed import join_process_group
    from meshrl.reshard import GroupRanks, ReshardConfig, Resharder, dest_layout, source_layout

    v1 = _model(1).state_dict()
    tp_group = join_process_group("arm-tp", proc, 2, "127.0.0.1", ports[0], timeout=TIMEOUT_S)
    engine = TorchEngine.from_hf_model(_model(0).state_dict(), _config(), _engine_config(),
                                       tp=TensorParallel(rank=proc, size=2, group=tp_group))
    res = Resharder.join(source_layout(v1), dest_layout(engine.model.layout, 2, 1),
                         GroupRanks(src=(0,), dst=(0, 1), world_size=2), proc, "127.0.0.1", ports[1],
                         ReshardConfig(timeout_s=TIMEOUT_S, group_name="arm-colocated"))

    async def push() -> None:
        if proc == 0:
            await res.receive(engine, 1, sources=v1)
        else:
            await res.arm(engine, 1, timeout_s=TIMEOUT_S)
            await res.receive(engine, 1)

    start = time.monotonic()
    asyncio.run(push())
    assert time.monotonic() - start < TIMEOUT_S / 2, "the armed engine rank waited for its timeout"
    _check(engine, v1, 1, proc, 2)
    res.close()
    dist.destroy_process_group(tp_group)


def _rejoin_while_armed(proc: int, ports: list[int]) -> None:
    """Process 0: the trainer (SourceSide); process 1: an engine (DestSide) armed for v1 when both re-join."""
    from meshrl.engines import TorchEngine
    from meshrl.engines.layout import EngineLayout, ModelSpec
    from meshrl.reshard import GroupRanks, ReshardConfig, dest_layout, source_layout
    from meshrl.reshard.meshes import DestSide, SourceSide

    model = _model(1)
    ranks = GroupRanks.disjoint(1, 1)
    configs = [ReshardConfig(timeout_s=TIMEOUT_S, group_name=f"arm-rejoin-{i}") for i in range(2)]
    source = source_layout(model.named_parameters())
    dest = dest_layout(EngineLayout(ModelSpec.from_hf_config(_config())))  # the engine's, as connect learns it
    if proc == 0:
        trainer = SourceSide(model.named_parameters)
        for port, cfg in zip(ports[2:], configs):
            trainer.join(dest, ranks, 0, "127.0.0.1", port, cfg)
        trainer.send(1)
        trainer.close()
        return
    engine = TorchEngine.from_hf_model(_model(0).state_dict(), _config(), _engine_config())
    side = DestSide(engine)

    async def main() -> None:
        await side.join(source, dest, ranks, 0, "127.0.0.1", ports[2], configs[0])
        await side.arm(1, TIMEOUT_S)
        await side.join(source, dest, ranks, 0, "127.0.0.1", ports[3], configs[1])  # connect again
        assert engine.version == 0 and not engine.is_updating  # the withdrawn receive left nothing staged
        await side.receive(1)

    asyncio.run(main())
    _check(engine, model.state_dict(), 1)
    side.close()


def _main(proc: int, ports: list[int]) -> None:
    torch.set_num_threads(1)
    _colocated_sender(proc, ports)
    _rejoin_while_armed(proc, ports)


@pytest.mark.slow
def test_armed_receives_colocated_sender_and_rejoin():
    ports = free_ports(4)
    run_processes(_main, (ports,), 2, timeout_s=120, what="the armed-receive processes")
