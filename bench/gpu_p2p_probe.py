"""Diagnostic: NCCL send/recv GPU0 -> GPU1 between two processes, each seeing both GPUs ("shared")
or only its own ("isolated", as Ray actors do). Prints ms per 3 GB pass for broadcast, batched
isend/irecv of bf16 tensors, and the same with fp32 sources cast on the fly.

    python3 bench/gpu_p2p_probe.py            # both modes
"""

from __future__ import annotations

import os
import sys
import time


def rank_main(rank: int, port: int, mode: str, q) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank) if mode == "isolated" else "0,1"
    import datetime

    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0 if mode == "isolated" else rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    dist.all_reduce(torch.ones(1, device=dev))
    n, numel = 56, 28 * 2**20  # 56 tensors x 56 MB bf16 = 3.1 GB
    bf = [torch.ones(numel, dtype=torch.bfloat16, device=dev) for _ in range(n)]
    fp = [torch.ones(numel, dtype=torch.float32, device=dev) for _ in range(n)] if rank == 0 else None

    def timed(fn, iters=5):
        ts = []
        for _ in range(iters + 1):
            dist.all_reduce(torch.ones(1, device=dev))
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return sorted(ts[1:])[len(ts[1:]) // 2] * 1e3

    def bcast():
        for t in bf:
            dist.broadcast(t, src=0)

    def p2p(cast: bool):
        def run():
            for i in range(0, n, 10):
                if rank == 0:
                    bufs = [t.to(torch.bfloat16) for t in fp[i:i + 10]] if cast else bf[i:i + 10]
                    ops = [dist.P2POp(dist.isend, b, 1) for b in bufs]
                else:
                    ops = [dist.P2POp(dist.irecv, b, 0) for b in bf[i:i + 10]]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        return run

    out = {"broadcast": timed(bcast), "p2p bf16": timed(p2p(False)), "p2p fp32->bf16": timed(p2p(True))}
    q.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    for mode in ("shared", "isolated"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        ps = [ctx.Process(target=rank_main, args=(r, port, mode, q)) for r in range(2)]
        for p in ps:
            p.start()
        res = dict(q.get(timeout=300) for _ in ps)
        for p in ps:
            p.join(60)
        print(mode, {k: f"{max(res[0][k], res[1][k]):.1f} ms" for k in res[0]}, flush=True)


if __name__ == "__main__":
    sys.exit(main())
