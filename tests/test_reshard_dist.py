"""Reshard over real gloo groups between real processes: an FSDP2 trainer (dp = 1, 2, 3 uneven)
pushes two versions into TorchEngines (tp = 1, 2); every engine tensor must equal its slice of
the trainer's full tensor bit for bit, and a push that times out leaves the engine on its version.

One spawn of three processes runs every case in turn (starting torch-importing processes is the
expensive part on two shared cores). Trainer rank i lives in process i; engine ranks fill the
processes after the trainers', wrapping around, so in the dp=2/tp=2, dp=3 cases some processes
hold a trainer rank and an engine rank at once (same-process copies next to p2p messages).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path

import msgspec
import pytest
import torch

import tiny
from meshrl.mesh.distributed import free_ports
from processes import run_processes

# (dp, tp, engine dtype, tied embeddings)
CASES = [(1, 1, "float32", True), (1, 2, "float32", False), (2, 1, "float32", True), (2, 2, "bfloat16", False),
         (3, 1, "float32", False), (3, 2, "float32", True)]
NPROCS = 3
TIMEOUT_S = 60.0


def _config(tied: bool):
    # hidden 64 and vocab 64 split 22/22/20 over dp=3; k/v rows 32 split 11/11/10
    return tiny.qwen2(vocab_size=64, hidden_size=64, intermediate_size=96, positions=64, tied=tied)


def _trainer_model(cfg, version: int):
    """What the trainer holds at ``version`` (every process can rebuild it: same seed)."""
    return tiny.hf_model(cfg, seed=100 + version)


def _init_default(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _layouts(cfg, dp: int, tp: int, dtype: str, named_params=None):
    from meshrl.engines.layout import EngineLayout, ModelSpec
    from meshrl.reshard import dest_layout, source_layout
    from meshrl.reshard.layout import source_tensor, SourceLayout

    dest = dest_layout(EngineLayout(ModelSpec.from_hf_config(cfg)), tp, 1, dtype)
    if named_params is not None:
        return source_layout(named_params), dest
    # Engines learn the trainer's layout from the controller; here they rebuild it from the config.
    full = _trainer_model(cfg, 0)
    return SourceLayout(num_ranks=dp, tensors=tuple(source_tensor(n, p.shape, "float32", (dp,), (0,))
                                                    for n, p in full.named_parameters())), dest


def _placement(dp: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Process of each trainer rank and of each engine rank: engines fill the processes after the
    trainers', wrapping around, so some processes hold a trainer rank and an engine rank at once."""
    return tuple(range(dp)), tuple((dp + j) % NPROCS for j in range(tp))


def _run_case(proc: int, dp: int, tp: int, dtype: str, tied: bool, ports: list[int]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshrl.engines import TorchEngine, TorchEngineConfig
    from meshrl.engines.tp import TensorParallel
    from meshrl.mesh.distributed import join_process_group
    from meshrl.reshard import GroupRanks, ReshardConfig, Resharder, local_tensors

    src_procs, dst_procs = _placement(dp, tp)
    if proc not in src_procs + dst_procs:
        return
    cfg = _config(tied)
    source, dest = _layouts(cfg, dp, tp, dtype)
    model = engine = None
    if proc in src_procs:  # trainer rank `proc`: FSDP2 over the default group of the dp trainer processes
        _init_default(proc, dp, ports[0])
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        model = _trainer_model(cfg, 1)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        read, _ = _layouts(cfg, dp, tp, dtype, model.named_parameters())
        assert read == source, "the layout read from FSDP2's DTensors differs from Shard(0) over dp"
        if dp == 3:
            q = read.index()["model.layers.0.self_attn.q_proj.weight"]
            assert [b[0] for b in q.owned] == [(0, 22), (22, 44), (44, 64)]  # uneven chunks
    tpi, tp_group = TensorParallel(), None
    if proc in dst_procs:  # engine rank j; its TP group is a named group (the default one is the trainer's)
        j = dst_procs.index(proc)
        if tp > 1:
            tp_group = join_process_group(f"tp-{dp}-{tp}", j, tp, "127.0.0.1", ports[1], timeout=TIMEOUT_S)
            tpi = TensorParallel(rank=j, size=tp, group=tp_group)
        engine = TorchEngine.from_hf_model(_trainer_model(cfg, 0).state_dict(), cfg,
                                           TorchEngineConfig(dtype=dtype, max_batch_size=2, max_seq_len=32), tp=tpi)
    ranks = GroupRanks(src=src_procs, dst=dst_procs, world_size=len(set(src_procs + dst_procs)))
    res = Resharder.join(source, dest, ranks, proc, "127.0.0.1", ports[2],
                         ReshardConfig(bucket_bytes=24 * 1024, timeout_s=TIMEOUT_S, group_name=f"rs-{dp}-{tp}"))
    for version in (1, 2):
        if model is not None and version == 2:
            v2 = _trainer_model(cfg, 2)
            with torch.no_grad():  # "train": load version 2 into the sharded parameters
                for (name, p), q in zip(model.named_parameters(), v2.parameters()):
                    p.to_local().copy_(q[tuple(slice(a, b) for a, b in source.index()[name].owned[proc])])
        if engine is None:
            stats = res.send(local_tensors(model.named_parameters()), version)
            full = sum(p.numel() for p in model.parameters()) * (2 if dtype == "bfloat16" else 4)
            assert 0 < stats.bytes <= full * tp, (stats.bytes, full)  # this rank's shards, at most once per TP rank
            continue
        sources = None if model is None else local_tensors(model.named_parameters())
        # v1 staged (the default), v2 straight into the live weights while paused (apply=in_place)
        res.config = msgspec.structs.replace(res.config, apply="staged" if version == 1 else "in_place")
        if sources is None and version == 1:  # a pure engine rank: its receive posted before the trainer sends
            stats = asyncio.run(_armed_receive(res, engine, version))
            assert "recv_signal_wait_s" in stats.phases and stats.bytes > 0, stats
        else:
            asyncio.run(res.receive(engine, version, sources=sources))  # sends this process's shards as well
        assert engine.version == version and not engine.is_updating and not engine.is_paused
        full_v = {n: p.detach().to(getattr(torch, dtype)) for n, p in _trainer_model(cfg, version).state_dict().items()}
        for pl in engine.model.layout.params.values():
            local = engine.model.params[pl.name]
            for hf_name, src, dst in pl.local_slices(tpi.rank, tpi.size):
                assert torch.equal(local[dst], full_v[hf_name][src]), f"v{version} {pl.name} <- {hf_name}"
    res.close()
    if tp_group is not None:
        dist.destroy_process_group(tp_group)
    if model is not None:
        dist.destroy_process_group()


async def _armed_receive(res, engine, version: int):
    await res.arm(engine, version, timeout_s=TIMEOUT_S)
    assert engine.is_updating and engine.version == version - 1  # staged: still serving the old version
    return await res.receive(engine, version)


def _failed_push(proc: int, ports: list[int], done: Path) -> None:
    """Trainer process 0 joins but never sends: engine process 1 must time out and stay on v0.
    Process 0 stays (its end would close the group's pairs: an error, not a timeout) until process
    1 has seen every timeout and writes ``done``."""
    from meshrl.reshard import GroupRanks, ReshardConfig, Resharder

    cfg = _config(True)
    source, dest = _layouts(cfg, 1, 1, "float32")
    conf = ReshardConfig(timeout_s=2.0, group_name="rs-fail")
    res = Resharder.join(source, dest, GroupRanks.disjoint(1, 1), proc, "127.0.0.1", ports[0], conf)
    in_place = Resharder.join(source, dest, GroupRanks.disjoint(1, 1), proc, "127.0.0.1", ports[1],
                              msgspec.structs.replace(conf, apply="in_place", group_name="rs-fail-in-place"))
    if proc == 0:
        deadline = time.monotonic() + 60
        while not done.exists():  # waits for: process 1's last check (the engine gives up meanwhile, three times)
            assert time.monotonic() < deadline, "the engine process did not finish its failed-push checks within 60 s"
            time.sleep(0.05)
        return
    try:
        _failed_push_engine(res, in_place, cfg)
    finally:
        done.touch()


def _failed_push_engine(res, in_place, cfg) -> None:
    from meshrl.engines import TorchEngine, TorchEngineConfig
    from meshrl.reshard import ReshardError

    engine = TorchEngine.from_hf_model(_trainer_model(cfg, 0).state_dict(), cfg,
                                       TorchEngineConfig(max_batch_size=2, max_seq_len=32))
    before = {n: p.clone() for n, p in engine.model.params.items()}

    async def armed_but_never_sent():  # no collective starts: the group stays usable
        await res.arm(engine, 1, timeout_s=1.0)
        with pytest.raises(ReshardError, match=r"stays on v0") as info:
            await res.receive(engine, 1)
        assert "did not start sending v1" in str(info.value), info.value
        assert engine.version == 0 and not engine.is_updating
        await res.arm(engine, 1, timeout_s=60.0)  # withdrawn before the trainer sends: promptly, nothing applied
        start = time.monotonic()
        await res.disarm(engine)
        assert time.monotonic() - start < 2.0 and engine.version == 0 and not engine.is_updating

    asyncio.run(armed_but_never_sent())
    with pytest.raises(ReshardError, match=r"stays on v0") as info:
        asyncio.run(res.receive(engine, 1))
    assert "did not complete" in str(info.value.__cause__ or info.value), info.value
    assert engine.version == 0 and not engine.is_updating
    assert all(torch.equal(before[n], p) for n, p in engine.model.params.items())
    # Later generation uses the old weights: the engine still works.
    from meshrl.engines import GenerateRequest, SamplingParams

    out = asyncio.run(engine.generate([GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))]))
    assert out[0].completions[0].versions == [0, 0]
    # The timed-out collective left the group unusable (gloo closes the pair): the next push says so
    # at once, before an in-place receive pauses the engine (it used to wait, then blame a timeout).
    start = time.monotonic()
    with pytest.raises(ReshardError, match=r"rs-fail' broke in an earlier push .*restart the run"):
        asyncio.run(res.receive(engine, 2))
    assert time.monotonic() - start < 1.0 and not engine.is_paused and engine.version == 0
    # In place, a failed push may have written part of v1: the engine stays paused and says so.
    with pytest.raises(ReshardError, match=r"mix of v0 and v1, so the engine stays paused"):
        asyncio.run(in_place.receive(engine, 1))
    assert engine.is_paused and engine.version == 0


def _main(proc: int, all_ports: list[list[int]], out: str) -> None:
    torch.set_num_threads(1)
    # First-use costs (model code import, FSDP, engine) in parallel, not when each process first joins a case.
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    from meshrl.engines import TorchEngine  # noqa: F401

    _trainer_model(_config(True), 0)
    for (dp, tp, dtype, tied), ports in zip(CASES, all_ports):
        _run_case(proc, dp, tp, dtype, tied, ports)
    if proc < 2:
        _failed_push(proc, all_ports[-1], Path(out) / "failed_push_done")


@pytest.mark.slow
def test_fsdp2_to_tp_engines_bit_exact(tmp_path):
    flat = free_ports(3 * (len(CASES) + 1))
    ports = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    run_processes(_main, (ports, str(tmp_path)), NPROCS, timeout_s=150, what="reshard processes")
