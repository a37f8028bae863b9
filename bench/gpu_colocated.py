"""Colocated mode on one GPU: switch times and peak memory of the trainer and TorchEngine taking turns.

Run on ``nvidia-h200`` (after ``source .whlb/install-on-gpu.sh``: meshrl's imports need ray and
msgspec installed, but no Ray cluster or actor is started here):

    python3 bench/gpu_colocated.py                      # Qwen2.5-1.5B shape
    python3 bench/gpu_colocated.py --model 7b           # Qwen2.5-7B shape (reported as not fitting if it OOMs)
    python3 bench/gpu_colocated.py --tiny               # a 2-layer model on CPU: checks the script

One process, no Ray: the library's own pieces, as ``meshrl.actors.hybrid.HybridWorker`` runs them —
``PolicyTrainer`` (FSDP2 at dp = 1, bf16 compute, fp32 master weights and AdamW) and ``TorchEngine``
(bf16, CUDA graphs) driven by ``meshrl.actors.hybrid.Colocated``. Random-weight Qwen2.5-shaped
models written from a transformers config (no downloads). Three measurements, each in a fresh
allocator state:

1. train alone: the trainer only, ``--steps`` steps of ``--samples`` samples x (prompt + response)
   random tokens; its peak allocated memory;
2. rollout alone: the engine only, generating ``--samples`` sequences of ``--response-len`` tokens;
   its peak; and the floor: ``torch._foreach_copy_`` of the engine's bf16 parameters from a bf16
   copy of themselves (the same-GPU copy time of the parameters);
3. colocated (with and without ``release_weights``): trainer and engine in one process; ``--cycles``
   x [generate → switch to train → train step → switch to rollout with the weight hand-over]; the
   median and max of each switch, the hand-over copy alone (in rollout mode, no memory restore),
   the peak of every phase, and CUDA graph re-captures.

Printed: a table per model, with the issue's two ratios: switch train → rollout (incl. hand-over)
over the floor (≤ 2 wanted) and colocated peak over the larger of the two phases alone (≤ 1.1).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from random_models import SHAPES, make_batch, write_model  # noqa: E402

_GIB = 2**30


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1.5b", help="comma-separated shapes: 1.5b, 7b")
    p.add_argument("--samples", type=int, default=128, help="sequences per rollout = samples per train step")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="train steps of the train-alone phase")
    p.add_argument("--cycles", type=int, default=4, help="rollout/train cycles of the colocated phase")
    p.add_argument("--tokens-per-microbatch", type=int, default=8192)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--release-weights", choices=["both", "yes", "no"], default="both",
                   help="colocated runs with and/or without freeing the engine weights in the train phase")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, a small batch, on CPU")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.samples, args.prompt_len, args.response_len = "tiny", min(args.samples, 8), 8, 8
        args.steps, args.cycles = min(args.steps, 2), min(args.cycles, 3)
    return args






def requests(args: argparse.Namespace, vocab: int, seed: int):
    from meshrl.engines import GenerateRequest, SamplingParams

    rng = random.Random(seed)
    sp = SamplingParams(max_new_tokens=args.response_len, temperature=1.0, ignore_eos=True, seed=seed)
    return [GenerateRequest(input_ids=[rng.randrange(vocab) for _ in range(args.prompt_len)], sampling=sp)
            for _ in range(args.samples)]


class Bench:
    def __init__(self, args: argparse.Namespace, model_dir: Path, device: torch.device):
        from meshrl.actors import AlgoConfig, TrainerConfig
        from meshrl.engines import TorchEngineConfig

        self.args, self.model_dir, self.device = args, str(model_dir), device
        self.cuda = device.type == "cuda"
        self.vocab = SHAPES[args.model_shape]["vocab_size"]
        self.trainer_cfg = TrainerConfig(samples_per_step=args.samples, tokens_per_microbatch=args.tokens_per_microbatch,
                                         lr=1e-6, device=device.type, activation_checkpointing=args.activation_checkpointing,
                                         max_skipped_steps=0)
        self.algo = AlgoConfig(advantage="grpo", samples_per_prompt=8)
        self.engine_cfg = TorchEngineConfig(device=str(device), max_batch_size=args.samples,
                                            max_seq_len=args.prompt_len + args.response_len)
        self.loop = asyncio.new_event_loop()

    # -- helpers ------------------------------------------------------------------------------

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def fresh(self) -> None:
        """A clean allocator between measurements."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / _GIB if self.cuda else 0.0

    def trainer(self):
        from meshrl.actors.data_parallel import DataParallel
        from meshrl.actors.policy_trainer import PolicyTrainer

        if self.cuda:
            from torch.distributed.device_mesh import init_device_mesh

            dp = DataParallel(init_device_mesh("cuda", (1,), mesh_dim_names=("dp",)), self.device)
        else:
            dp = DataParallel(None, "cpu")
        return PolicyTrainer(self.model_dir, self.trainer_cfg, self.algo, dp=dp, temperature=1.0,
                             max_new_tokens=self.args.response_len, total_steps=100)

    def engine(self, contiguous_weights: bool = False):
        import msgspec

        from meshrl.engines import TorchEngine

        cfg = msgspec.structs.replace(self.engine_cfg, contiguous_weights=contiguous_weights)
        return TorchEngine.from_pretrained(self.model_dir, cfg)

    def generate(self, engine, seed: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        results = self.loop.run_until_complete(engine.generate(requests(self.args, self.vocab, seed)))
        self.sync()
        assert all(len(c.output_ids) == self.args.response_len for r in results for c in r.completions)
        return time.perf_counter() - t0

    def timed(self, fn, repeats: int = 10) -> list[float]:
        fn()
        out = []
        for _ in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return out

    # -- the three measurements ---------------------------------------------------------------

    def train_alone(self) -> dict:
        self.fresh()
        trainer = self.trainer()
        times = []
        for step in range(self.args.steps):
            self.sync()
            t0 = time.perf_counter()
            m = trainer.train_step(make_batch(step, self.args, self.vocab), step)
            self.sync()
            times.append(time.perf_counter() - t0)
            assert m["loss"] == m["loss"], "NaN loss"
        out = {"peak_gib": self.peak_gib(), "step_s": statistics.median(times)}
        del trainer
        self.fresh()
        return out

    def rollout_alone(self) -> dict:
        self.fresh()
        engine = self.engine()
        seconds = [self.generate(engine, seed) for seed in range(2)]
        out = {"peak_gib": self.peak_gib(), "generate_s": seconds[-1],
               "weights_gib": sum(p.numel() * p.element_size() for p in engine.model.params.values()) / _GIB,
               "kv_gib": engine.cache.nbytes / _GIB}
        # the floor: the parameters copied on the same GPU, bf16 to bf16, one foreach launch
        dst = list(engine.model.params.values())
        src = [p.clone() for p in dst]
        out["floor_s"] = statistics.median(self.timed(lambda: torch._foreach_copy_(dst, src)))  # noqa: F821 (deleted after)
        self.loop.run_until_complete(engine.shutdown())
        del src, dst, engine
        self.fresh()
        return out

    def colocated(self, release_weights: bool) -> dict:
        from meshrl.actors.hybrid import Colocated, init_optimizer_state

        self.fresh()
        trainer = self.trainer()
        init_optimizer_state(trainer.optimizer)  # before the engine: persistent trainer memory first
        self.sync()
        trainer_resident = torch.cuda.memory_allocated(self.device) / _GIB if self.cuda else 0.0
        engine = self.engine(contiguous_weights=release_weights)
        colo = Colocated(trainer, engine, release_weights=release_weights)
        to_train, to_rollout, peaks, rows = [], [], [], []
        for cycle in range(self.args.cycles + 1):
            self.generate(engine, 100 + cycle)
            to_train.append(colo.to_train())
            if cycle == self.args.cycles:  # the last rollout phase's peak is reported with the switch
                rows.append(colo.finish_train({}))
                break
            m = trainer.train_step(make_batch(cycle, self.args, self.vocab), cycle)
            rows.append(colo.finish_train(m))
            stats = colo.to_rollout(cycle + 1)
            assert stats is not None and engine.version == cycle + 1
        for m in rows:
            if "colocated/switch_to_rollout_s" in m:
                to_rollout.append(m["colocated/switch_to_rollout_s"])
            peaks += [m.get("colocated/train_peak_gib", 0.0), m.get("colocated/rollout_peak_gib", 0.0)]
        # the hand-over copy alone: in rollout mode it is the in-place push, no memory restore
        version = [self.args.cycles]

        def copy_only() -> None:
            version[0] += 1
            colo.to_rollout(version[0])  # noqa: F821 (deleted after)

        copy_s = statistics.median(self.timed(copy_only, 5))
        out = {"release_weights": release_weights, "switch_to_train_s": statistics.median(to_train[1:] or to_train),
               "switch_to_rollout_s": statistics.median(to_rollout), "switch_to_rollout_max_s": max(to_rollout),
               "handover_copy_s": copy_s, "peak_gib": max(peaks), "train_phase_peak_gib": max(peaks[0::2]),
               "rollout_phase_peak_gib": max(peaks[1::2]), "trainer_resident_gib": trainer_resident,
               "graph_recaptures": engine.graph_recaptures, "handover_bytes": colo.handover.nbytes}
        self.loop.run_until_complete(engine.shutdown())
        del colo, engine, trainer
        self.fresh()
        return out


def run_shape(args: argparse.Namespace, shape: str, device: torch.device, work: Path) -> dict:
    args.model_shape = shape
    model_dir = work / shape
    t0 = time.perf_counter()
    write_model(model_dir, shape)
    print(f"[{shape}] random model written in {time.perf_counter() - t0:.0f}s", flush=True)
    bench = Bench(args, model_dir, device)
    out: dict = {"model": shape}
    try:
        out["train"] = bench.train_alone()
        print(f"[{shape}] train alone: {out['train']}", flush=True)
    except torch.OutOfMemoryError as exc:
        out["error"] = f"train phase alone does not fit: {str(exc).splitlines()[0]}"
        print(f"[{shape}] {out['error']}", flush=True)
        bench.fresh()
        return out
    out["rollout"] = bench.rollout_alone()
    print(f"[{shape}] rollout alone: {out['rollout']}", flush=True)
    out["colocated"] = []
    for release in {"both": (False, True), "yes": (True,), "no": (False,)}[args.release_weights]:
        try:
            out["colocated"].append(bench.colocated(release))
            print(f"[{shape}] colocated: {out['colocated'][-1]}", flush=True)
        except torch.OutOfMemoryError as exc:
            out["colocated"].append({"release_weights": release, "error": str(exc).splitlines()[0]})
            print(f"[{shape}] colocated release_weights={release} does not fit: {str(exc).splitlines()[0]}", flush=True)
            bench.fresh()
    return out


def report(args: argparse.Namespace, results: list[dict], device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\nColocated trainer + TorchEngine on one {name}: {args.samples} samples x ({args.prompt_len} + "
          f"{args.response_len}) tokens per cycle, tokens_per_microbatch={args.tokens_per_microbatch}, "
          f"{args.cycles} cycles (medians; max in brackets)\n")
    print("| model | release weights | rollout→train ms | train→rollout ms (incl. hand-over) | hand-over copy ms | "
          "param copy floor ms | ratio (≤ 2) | peak GiB train alone | rollout alone | colocated | ratio (≤ 1.1) | "
          "re-captures |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['model']} | - | {r['error']} |")
            continue
        floor, alone = r["rollout"]["floor_s"], max(r["train"]["peak_gib"], r["rollout"]["peak_gib"])
        for c in r["colocated"]:
            if "error" in c:
                print(f"| {r['model']} | {c['release_weights']} | does not fit: {c['error']} |")
                continue
            ratio_mem = f"{c['peak_gib'] / alone:.3f}" if alone else "-"
            print(f"| {r['model']} | {c['release_weights']} | {c['switch_to_train_s'] * 1e3:.2f} | "
                  f"{c['switch_to_rollout_s'] * 1e3:.2f} [{c['switch_to_rollout_max_s'] * 1e3:.2f}] | "
                  f"{c['handover_copy_s'] * 1e3:.2f} | {floor * 1e3:.2f} | {c['switch_to_rollout_s'] / floor:.2f} | "
                  f"{r['train']['peak_gib']:.2f} | {r['rollout']['peak_gib']:.2f} | {c['peak_gib']:.2f} "
                  f"(train {c['train_phase_peak_gib']:.2f}, rollout {c['rollout_phase_peak_gib']:.2f}) | {ratio_mem} | "
                  f"{c['graph_recaptures']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device("cpu") if args.tiny or not torch.cuda.is_available() else torch.device("cuda", 0)
    if device.type == "cuda":
        import torch.distributed as dist

        torch.cuda.set_device(device)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # FSDP2 at dp = 1 (the trainer's CUDA layout: bf16 compute, fp32 master weights) needs a group of one
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=600), device_id=device)
    torch.set_num_threads(1 if device.type == "cpu" else 8)
    with tempfile.TemporaryDirectory(prefix="meshrl_colocated_") as work:
        results = [run_shape(args, shape, device, Path(work)) for shape in args.model.split(",")]
    report(args, results, device)


if __name__ == "__main__":
    main()
