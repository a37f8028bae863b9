"""``transport=tensor``'s payload as SGLang reads it: ``ipc_payload`` pickles CUDA tensors as IPC
handles with the device named by UUID; another process, unpickling with SGLang's own
``MultiprocessingSerializer`` after its ``monkey_patch_torch_reductions`` (what its TP worker does
before ``update_weights_from_tensor``), must see our memory: the same values, on the same GPU.
Needs a GPU and an importable sglang (the H200 run: bench/RESULTS.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

READER = r"""
import sys, torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
monkey_patch_torch_reductions()
named = MultiprocessingSerializer.deserialize(sys.stdin.read().strip())
print(" ".join(f"{n}={t.float().sum().item():.6g}@{t.device}" for n, t in named), flush=True)
"""


def test_a_server_process_reads_our_cuda_tensors_through_the_payload():
    pytest.importorskip("sglang")
    from meshrl.reshard.sglang import ipc_payload

    a = torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4)
    b = torch.full((5,), 0.5, dtype=torch.float32, device="cuda")
    payload = ipc_payload([("a", a), ("b", b)])
    out = subprocess.run([sys.executable, "-c", READER], input=payload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [f"a={a.float().sum().item():.6g}@cuda:0", "b=2.5@cuda:0"]
