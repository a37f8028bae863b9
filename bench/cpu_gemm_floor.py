"""How far eager PyTorch can take TorchEngine past HF ``generate`` on this CPU: the GEMM floor.

Run: ``OMP_NUM_THREADS=1 python bench/cpu_gemm_floor.py [case ...]`` (cases of
``bench_engine_cpu.py``; default ``example_ppo default example_grpo``). For each case it times HF
and the engine (CPU time, median of 7 calls) and, under torch.profiler, the CPU time of their dense
matmuls (``mm``/``addmm``/``addmm_``). Both run the same model, so the engine's matmuls are the
same arithmetic as HF's minus HF's padding and repeated prefills; ``HF time / engine matmul time``
is the speedup the engine would reach if everything else it does (attention, norms, RoPE, sampling,
scheduling) cost nothing: an upper bound for any float32 engine that keeps these matmuls.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench_engine_cpu import _Case  # noqa: E402

DENSE = ("aten::mm", "aten::addmm", "aten::addmm_")


def measure(fn, rounds: int = 7) -> tuple[float, float]:
    """(median CPU ms of ``fn``, its dense-matmul CPU ms per call under the profiler)."""
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn()
    dense = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in DENSE) / 3 / 1e3
    return sorted(times)[rounds // 2] * 1e3, dense


def main(cases: list[str]) -> None:
    torch.set_num_threads(1)
    print(f"{'case':12} {'HF ms':>8} {'(matmuls)':>10} {'engine ms':>10} {'(matmuls)':>10} {'speedup':>8} {'bound':>7}")
    for name in cases:
        c = _Case(name)
        for _ in range(2):  # warm-up
            c.run_hf()
            c.run_engine()
        (hf, hf_mm), (eng, eng_mm) = measure(c.run_hf), measure(c.run_engine)
        print(f"{name:12} {hf:8.1f} {hf_mm:10.1f} {eng:10.1f} {eng_mm:10.1f} {hf / eng:7.2f}x {hf / eng_mm:6.2f}x",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["example_ppo", "default", "example_grpo"])
