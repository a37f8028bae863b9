"""GPU probe: what NCCL's ``Work.wait(timeout)`` costs a bucketed push into a busy GPU (issue 10).

Two processes, GPU0 sends, GPU1 receives: ``--buckets`` broadcasts of ``--bucket-mb`` each, the
sender packing (fp32 -> bf16 copy) and posting two buckets ahead as ``meshrl.reshard`` does, the
receiver posting all of them at once. Optionally GPU1 runs a decode-like load meanwhile (a thread
launching bf16 matmuls and syncing each "step"). Each push waits its buckets either with
``Work.wait(timeout=...)`` (NCCL polls in 10 ms sleeps) or with ``meshrl.reshard.transport.wait_work``
(fine polling); the modes alternate push by push. Prints the sender's median push time per case.

    python bench/nccl_wait_probe.py --pushes 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrl.reshard.transport import wait_work

MODES = ("wait_timeout", "wait_work")


def _wait(work, mode: str) -> None:
    if mode == "wait_timeout":
        if not work.wait(timeout=timedelta(seconds=60)):
            raise TimeoutError("bucket")
    elif not wait_work(work, time.monotonic() + 60, cuda=True):
        raise TimeoutError("bucket")


def _load(stop: threading.Event, device: torch.device, step_ms: float) -> None:
    torch.cuda.set_device(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    torch.mm(a, b)
    torch.cuda.synchronize(device)
    per = max(time.perf_counter() - t0, 1e-4)
    n = max(1, int(step_ms / 1000 / per))
    while not stop.is_set():
        for _ in range(n):
            torch.mm(a, b)
        torch.cuda.synchronize(device)  # the engine's host sync each step


def _worker(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    ctl = dist.new_group(backend="gloo")
    numel = args.bucket_mb * 2**20 // 2
    if rank == 0:
        src = [torch.randn(numel, device=device) for _ in range(args.buckets)]
    else:
        dst = [torch.empty(numel, device=device, dtype=torch.bfloat16) for _ in range(args.buckets)]
    results: dict[str, list[float]] = {}
    for load in (False, True):
        stop = threading.Event()
        loader = None
        if rank == 1 and load:
            loader = threading.Thread(target=_load, args=(stop, device, args.step_ms), daemon=True)
            loader.start()
            time.sleep(0.5)
        for i in range(2 * args.pushes + 2):
            mode = MODES[i % 2]
            dist.barrier(group=ctl)
            t0 = time.perf_counter()
            if rank == 0:
                flight = []
                for k in range(args.buckets):
                    buf = src[k].to(torch.bfloat16)  # packing
                    flight.append((dist.broadcast(buf, src=0, async_op=True), buf))
                    if len(flight) >= 2:
                        _wait(flight.pop(0)[0], mode)
                for work, _ in flight:
                    _wait(work, mode)
            else:
                works = [dist.broadcast(d, src=0, async_op=True) for d in dst]
                for work in works:
                    _wait(work, mode)
            torch.cuda.current_stream(device).synchronize()
            if i >= 2:  # the first two are warm-up
                results.setdefault(f"{'busy' if load else 'idle'} receiver, {mode}", []).append(
                    time.perf_counter() - t0)
        stop.set()
        if loader is not None:
            loader.join()
    if rank == 0:
        out.update({k: statistics.median(v) * 1000 for k, v in results.items()})
    dist.barrier(group=ctl)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, default=13)
    ap.add_argument("--bucket-mb", type=int, default=240)
    ap.add_argument("--pushes", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=2.0, help="the load's GPU time between host syncs")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("nccl_wait_probe: needs two GPUs")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(args, 29000 + os.getpid() % 1000, out), nprocs=2)
        print(f"{args.buckets} buckets x {args.bucket_mb} MB, sender depth 2, receiver posts all; "
              f"median of {args.pushes} pushes (sender ms)")
        print("| case | push ms |\n|---|---|")
        for k, v in sorted(out.items()):
            print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
