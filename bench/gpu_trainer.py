"""The FSDP2 trainer (``PolicyTrainer``) at dp = N over NCCL: step time, tokens/s, peak memory.

Run on ``nvidia-h200-x2`` (needs torch, transformers, msgspec and ray for meshrl's imports):

    python bench/gpu_trainer.py                       # Qwen2.5-0.5B shape, dp=2, GRPO, 5 steps
    python bench/gpu_trainer.py --algo ppo            # + a critic (value model of the same shape)
    python bench/gpu_trainer.py --activation-checkpointing --samples 256
    python bench/gpu_trainer.py --lora-rank 16        # LoRA adapters on every projection (trainer.lora)
    python bench/gpu_trainer.py --tiny --cpu          # a 2-layer model, gloo on CPU: checks the script

One process per rank (``torch.multiprocessing``, no Ray), each running the library's own
``PolicyTrainer``: FSDP2 ``fully_shard`` per decoder layer, bf16 parameters with fp32 gradient
reduction, AdamW, micro-batches by ``--tokens-per-microbatch``. The model is a Qwen2.5-shaped
config with random weights, written once by rank 0 (safetensors, so every rank loads it the way
the trainer loads a real checkpoint); the batch is random tokens with random rewards
(``--prompt-len`` + ``--response-len`` tokens per sample, ``--samples`` samples per step, in
GRPO groups of 8). After ``--warmup`` steps, ``--steps`` steps are timed; then one sharded
checkpoint save (DCP) and one HF export (gathered on rank 0) are timed too.

Printed: a table per rank (median step time, trained tokens/s over all ranks, peak memory, and the
time to list the weights a push sends: with LoRA that is the shard-by-shard merge), and the losses
of every step (finite, identical on every rank). With ``--lora-rank`` also the largest difference
between that merge, gathered, and the merge of the gathered state dict (the HF export's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from random_models import make_batch, write_model  # noqa: E402



def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (one GPU each)")
    p.add_argument("--steps", type=int, default=5, help="timed train steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed train steps first")
    p.add_argument("--samples", type=int, default=128, help="samples per train step (all ranks)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--tokens-per-microbatch", type=int, default=16384, help="padded tokens per forward, per rank")
    p.add_argument("--algo", choices=["grpo", "ppo"], default="grpo", help="ppo adds a critic")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="trainer.compile: torch.compile the decoder layers and the head math")
    p.add_argument("--lora-rank", type=int, default=0, help="trainer.lora.rank (0: full fine-tuning)")
    p.add_argument("--no-mixed-precision", action="store_true", help="fp32 compute on GPU")
    p.add_argument("--share-prompts", choices=["auto", "true", "false"], default="auto",
                   help="trainer.share_prompts (auto: the default, off on CUDA; false: every row runs its "
                        "group's prompt again)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and a small batch")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the GPU's bf16 dense peak for MFU (default: the H200's measured-class %(default)s)")
    p.add_argument("--no-save", action="store_true", help="skip the timed DCP checkpoint and HF export")
    p.add_argument("--profile", help="profile one more step; write rank 0's op table (by device time) here")
    args = p.parse_args(argv)
    if args.tiny:
        args.samples, args.prompt_len, args.response_len = min(args.samples, 16), min(args.prompt_len, 8), min(args.response_len, 8)
    return args




def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: process peak RSS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_main(rank: int, args: argparse.Namespace, port: int, work: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshrl.actors import AlgoConfig, TrainerConfig
    from meshrl.actors.data_parallel import DataParallel
    from meshrl.actors.lora import LoRAConfig
    from meshrl.actors.policy_trainer import PolicyTrainer
    from meshrl.actors.trainer_checkpoint import save_trainer_state

    torch.set_num_threads(1 if args.cpu else 4)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.dp, timeout=datetime.timedelta(seconds=600), device_id=None if args.cpu else device)
    try:
        model_dir = Path(work) / "model"
        if rank == 0:
            write_model(model_dir, "tiny" if args.tiny else "0.5b")
        dist.barrier()
        dp = DataParallel(init_device_mesh(device.type, (args.dp,), mesh_dim_names=("dp",)), device)
        cfg = TrainerConfig(samples_per_step=args.samples, tokens_per_microbatch=args.tokens_per_microbatch, lr=1e-6,
                            dp=args.dp, device=device.type, mixed_precision=not args.no_mixed_precision,
                            activation_checkpointing=args.activation_checkpointing, max_skipped_steps=0, compile=args.compile,
                            share_prompts={"auto": None, "true": True, "false": False}[args.share_prompts],
                            lora=LoRAConfig(rank=args.lora_rank))
        algo = AlgoConfig(advantage="gae") if args.algo == "ppo" else AlgoConfig(advantage="grpo", samples_per_prompt=8)
        t0 = time.perf_counter()
        trainer = PolicyTrainer(str(model_dir), cfg, algo, dp=dp, temperature=1.0, max_new_tokens=args.response_len,
                                total_steps=args.warmup + args.steps)
        setup_s = time.perf_counter() - t0
        vocab = trainer.policy.config.vocab_size
        times, losses, tokens = [], [], 0.0
        for step in range(args.warmup + args.steps):
            batch = make_batch(step, args, vocab)
            _sync(device)
            t0 = time.perf_counter()
            m = trainer.train_step(batch, step)
            _sync(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                tokens = m["trained_tokens"] + args.samples * args.prompt_len  # forward tokens, all ranks
            losses.append(m["loss"])
        if args.profile and rank == 0:
            profile_step(trainer, make_batch(args.warmup + args.steps, args, vocab), args.warmup + args.steps, device, args.profile)
        elif args.profile:
            trainer.train_step(make_batch(args.warmup + args.steps, args, vocab), args.warmup + args.steps)
        _sync(device)
        t0 = time.perf_counter()
        exported = list(trainer.export_parameters())  # what a distributed push reads (LoRA: merged here)
        _sync(device)
        merge_s = time.perf_counter() - t0
        merge_diff = None
        if args.lora_rank:
            full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in exported}
            gathered = trainer.policy_state()
            if rank == 0:
                merge_diff = max((full[n].float().cpu() - gathered[n].float()).abs().max().item() for n in full)
        del exported
        ckpt_s = export_s = float("nan")
        if not args.no_save:
            t0 = time.perf_counter()
            save_trainer_state(trainer, Path(work) / "ckpt")
            dist.barrier()
            ckpt_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            trainer.save_hf(Path(work) / "hf")
            dist.barrier()
            export_s = time.perf_counter() - t0
        row = {"rank": rank, "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
               "setup_s": setup_s, "step_s_median": statistics.median(times), "step_s_all": times,
               "tokens_per_s": tokens / statistics.median(times), "peak_mem_gib": peak_memory_gib(device),
               "checkpoint_s": ckpt_s, "hf_export_s": export_s, "losses": losses, "push_list_s": merge_s,
               "merge_diff": merge_diff,
               "trained_params": sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)}
        rows: list = [None] * args.dp
        dist.all_gather_object(rows, row)
        if rank == 0:
            report(args, rows, sum(p.numel() for p in trainer.policy.parameters()))  # DTensor: global numel
    finally:
        dist.destroy_process_group()


def profile_step(trainer, batch, step: int, device: torch.device, path: str) -> None:
    """One train step under torch.profiler: the ops by total device (CPU) time, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        trainer.train_step(batch, step)
        _sync(device)
    table = prof.key_averages().table
    keys = ["self_cuda_time_total", "self_cpu_time_total"] if device.type == "cuda" else ["self_cpu_time_total"]
    Path(path).write_text("\n\n".join(f"sorted by {k}:\n" + table(sort_by=k, row_limit=45, max_name_column_width=60)
                                      for k in keys))


def mfu(args: argparse.Namespace, row: dict, params: int) -> float:
    """Model FLOPs utilisation per GPU: 6 × parameters × tokens per step (forward + backward)
    over the step time and the peak (attention's own FLOPs are not counted)."""
    return 6 * params * row["tokens_per_s"] / args.dp / (args.peak_tflops * 1e12)


def report(args: argparse.Namespace, rows: list[dict], params: int) -> None:
    print(f"\nPolicyTrainer, dp={args.dp} ({'gloo/CPU' if args.cpu else 'NCCL'}), {'tiny' if args.tiny else 'Qwen2.5-0.5B'} "
          f"shape, algo={args.algo}, {args.samples} samples x ({args.prompt_len} + {args.response_len}) tokens per step, "
          f"tokens_per_microbatch={args.tokens_per_microbatch}, mixed precision={not args.no_mixed_precision and not args.cpu}, "
          f"activation checkpointing={args.activation_checkpointing}, LoRA rank {args.lora_rank or '-'}; policy "
          f"parameters {params:,}, trained {rows[0]['trained_params']:,}\n")
    mem = "peak GiB allocated" if not args.cpu else "peak RSS GiB"
    print(f"| rank | device | step s (median) | tokens/s (all ranks, prompt + response) | MFU (of {args.peak_tflops:.0f} TFLOP/s) "
          f"| {mem} | setup s | checkpoint s | HF export s | push list s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["mfu"] = mfu(args, r, params)
        print(f"| {r['rank']} | {r['device']} | {r['step_s_median']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
              f"{r['peak_mem_gib']:.2f} | {r['setup_s']:.1f} | {r['checkpoint_s']:.2f} | {r['hf_export_s']:.2f} | "
              f"{r['push_list_s']:.3f} |")
    if rows[0]["merge_diff"] is not None:
        print(f"\nLoRA: the shard-by-shard merge (what a push sends), gathered, vs the gathered state dict merged: "
              f"max |diff| {rows[0]['merge_diff']:.3g}")
    print("\nlosses per step:", ", ".join(f"{x:.6f}" for x in rows[0]["losses"]))
    agree = all(r["losses"] == rows[0]["losses"] for r in rows)
    finite = all(x == x and abs(x) != float("inf") for x in rows[0]["losses"])
    print(f"losses identical on every rank: {agree}; all finite: {finite}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": rows}, indent=1))
    if not (agree and finite):
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    args = parse(argv)
    if not args.cpu and torch.cuda.device_count() < args.dp:
        sys.exit(f"--dp {args.dp} needs {args.dp} GPUs, found {torch.cuda.device_count()} (use --cpu for gloo)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gpu_trainer_") as work:
        mp.start_processes(rank_main, args=(args, port, work), nprocs=args.dp, start_method="spawn", join=True)


if __name__ == "__main__":
    main()
