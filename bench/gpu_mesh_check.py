"""GPU acceptance check for ``meshrl.mesh`` on one host with 2 GPUs (``nvidia-h200-x2``).

Run from the project root on the GPU machine (after ``source .whlb/install-on-gpu.sh``):

    python bench/gpu_mesh_check.py [--gib 1.0]

``--cpu`` runs the same flow on CPU processes with gloo (a dry run of the script's plumbing on a
machine without GPUs; the GPU-specific checks then only say what they saw).

Checks, each printed as a table row, exit status 1 if any fails:

1. ``spawn_procs(per_host={"gpus": 2})`` puts one actor on each GPU: every actor sees exactly one
   device, and the two devices' UUIDs differ.
2. ``init_torch_distributed_on(mesh)`` builds an NCCL group and a ``DeviceMesh(("gpus",))``; an
   all-reduce of ``rank + 1`` gives 3 on both ranks; then the all-reduce bus bandwidth of a
   ``--gib`` tensor (bf16), for reference against the NVLink figure in ``shared/gpu/README.md``.
3. Two separate 1-GPU meshes (a "trainer" and an "engine") join one extra NCCL group with
   ``join_process_group`` (SGLang's construction) and broadcast a ``--gib`` tensor from rank 0;
   the receiver checks a checksum; the bandwidth is printed.

Simplification on purpose: one host, two GPUs; no multi-node placement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

NCCL_ENV = {
    # shared/gpu/README.md: NVLink multicast must stay off in every process, Ray workers included.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_CUMEM_ENABLE": "0",
    "OMP_NUM_THREADS": "1",
}
os.environ.update(NCCL_ENV)

import ray  # noqa: E402

from meshrl.mesh import (  # noqa: E402
    Actor,
    actor_address,
    current_device_mesh,
    current_rank,
    endpoint,
    init_torch_distributed_on,
    join_process_group,
    spawn_procs,
)


class GpuProbe(Actor):
    def __init__(self, device: str):
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.device = device

    @endpoint
    def identity(self) -> dict:
        torch = self.torch
        cuda = self.device == "cuda"
        props = torch.cuda.get_device_properties(0) if cuda else None
        return {
            "rank": current_rank().rank,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "device_count": torch.cuda.device_count() if cuda else 1,
            "name": props.name if cuda else "cpu",
            "uuid": str(getattr(props, "uuid", "?")) if cuda else f"cpu-{os.getpid()}",
        }

    @endpoint
    def all_reduce(self, gib: float, iters: int = 10) -> dict:
        torch = self.torch
        import torch.distributed as dist

        rank = current_rank().rank
        dm = current_device_mesh()
        small = torch.full((4,), float(rank + 1), device=self.device)
        dist.all_reduce(small)
        self._sync()
        numel = int(gib * 2**30) // 2
        big = torch.ones(numel, dtype=torch.bfloat16, device=self.device)
        dist.all_reduce(big)  # warm-up: NCCL communicator and buffers
        self._sync()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(big)
        self._sync()
        seconds = (time.perf_counter() - start) / iters
        world = dist.get_world_size()
        algbw = numel * 2 / seconds / 1e9
        return {
            "rank": rank,
            "sum": small[0].item(),
            "dims": dm.mesh_dim_names,
            "device": torch.cuda.current_device() if self.device == "cuda" else "cpu",
            "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
            "ms": seconds * 1e3,
            "busbw_GBps": algbw * 2 * (world - 1) / world,
        }

    @endpoint
    def join_and_broadcast(self, rank: int, world: int, addr: str, port: int, gib: float) -> dict:
        torch = self.torch
        import torch.distributed as dist

        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.set_device(0)
        backend = "nccl" if cuda else "gloo"
        pg = join_process_group("weight_update_group", rank, world, addr, port, backend=backend, timeout=300)
        numel = int(gib * 2**30) // 2
        if rank == 0:
            t = torch.arange(numel, device=self.device, dtype=torch.float32).to(torch.bfloat16)
        else:
            t = torch.empty(numel, device=self.device, dtype=torch.bfloat16)
        dist.broadcast(t, src=0, group=pg)  # warm-up: the communicator is created lazily
        self._sync()
        start = time.perf_counter()
        dist.broadcast(t, src=0, group=pg)
        self._sync()
        seconds = time.perf_counter() - start
        expected = torch.arange(numel, device=self.device, dtype=torch.float32).to(torch.bfloat16)
        ok = bool(torch.equal(t, expected))
        dist.destroy_process_group(pg)
        return {"rank": rank, "ok": ok, "ms": seconds * 1e3, "GBps": numel * 2 / seconds / 1e9}

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="tensor size for the bandwidth rows")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU processes with gloo")
    args = parser.parse_args()
    device, backend = ("cpu", "gloo") if args.cpu else ("cuda", "nccl")
    dim, cpus = ("procs", 0.1) if args.cpu else ("gpus", 1.0)
    ray.init(runtime_env={"env_vars": NCCL_ENV})
    rows: list[tuple[str, bool, str]] = []

    procs = spawn_procs({dim: 2}, cpus_per_proc=cpus, name="gpu-check")
    try:
        mesh = procs.spawn("gpu-check", GpuProbe, device)
        ids = mesh.identity.call().get(timeout=600).values()
        one_each = all(i["device_count"] == 1 for i in ids) and len({i["uuid"] for i in ids}) == 2
        rows.append(("one actor per GPU", one_each, "; ".join(
            f"rank {i['rank']}: CVD={i['CUDA_VISIBLE_DEVICES']} ray={i['ray_gpu_ids']} {i['name']} {i['uuid'][:13]}"
            for i in ids)))
        info = init_torch_distributed_on(mesh, timeout=300).get(timeout=600).values()
        rows.append(("init_torch_distributed", {i["backend"] for i in info} == {backend}, str(info)))
        ar = mesh.all_reduce.call(args.gib).get(timeout=600).values()
        rows.append((f"{backend} all-reduce of rank+1", all(a["sum"] == 3.0 for a in ar),
                     "; ".join(f"rank {a['rank']}: sum={a['sum']} dims={a['dims']} dev={a['device']} "
                               f"LOCAL_RANK={a['LOCAL_RANK']}" for a in ar)))
        rows.append((f"all-reduce {args.gib} GiB bf16", True,
                     "; ".join(f"rank {a['rank']}: {a['ms']:.1f} ms, busbw {a['busbw_GBps']:.0f} GB/s" for a in ar)))
    finally:
        procs.stop()

    trainer_procs = spawn_procs({dim: 1}, cpus_per_proc=cpus, name="gpu-trainer")
    engine_procs = spawn_procs({dim: 1}, cpus_per_proc=cpus, name="gpu-engine")
    try:
        trainer = trainer_procs.spawn("gpu-trainer", GpuProbe, device)
        engine = engine_procs.spawn("gpu-engine", GpuProbe, device)
        addr, port = actor_address(trainer).get(timeout=600)
        sent = trainer.join_and_broadcast.call_one(0, 2, addr, port, args.gib)
        got = engine.join_and_broadcast.call_one(1, 2, addr, port, args.gib)
        s, g = sent.get(timeout=600), got.get(timeout=600)
        rows.append(("join_process_group + broadcast", s["ok"] and g["ok"],
                     f"{args.gib} GiB in {g['ms']:.1f} ms = {g['GBps']:.0f} GB/s (receiver)"))
    finally:
        trainer_procs.stop()
        engine_procs.stop()

    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':{width}s}  result  details")
    for name, ok, details in rows:
        print(f"{name:{width}s}  {'PASS' if ok else 'FAIL':6s}  {details}")
    ray.shutdown()
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
