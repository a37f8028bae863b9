"""The laptop figure: meshrl's main job against a synchronous single-process GRPO loop, side by side.

    python bench/laptop_grpo.py                       # 32 and 256 samples per step, about 2 minutes on 2 cores
    python bench/laptop_grpo.py --sizes 32 --steps 60 --out /tmp/laptop
    python bench/laptop_grpo.py --loop-bf16           # the loop also under bf16 autocast
    python bench/laptop_grpo.py --repeats 3           # each side 3 times, alternating: medians and the pairs' range

Both train the same model directory (a 2-layer, 128-wide Qwen2 with a 16-token vocabulary: the
four specials, the digits, ``+`` and ``=``; taught the answer format by a short supervised phase,
since a random policy never earns a reward) on the built-in ``a+b=`` task with GRPO, 8
completions of exactly 8 tokens per prompt (EOS may be among them: the answer ends at the first).
The loop is what a first RL script looks like: HF ``generate``, exact-match rewards,
group-normalised advantages, one optimiser step, repeat, in float32 as HF loads the model. The
main job is ``examples/async_ppo.py --model DIR algo=grpo`` with the same sizes and its defaults
(bf16 compute on a CPU with bf16 instructions: ``meshrl.cpu``). Each size runs the loop then the
main job, back to back (``--repeats``: that many times, alternating); the table gives samples per
second over the steps after the warm-up (the median of the repeats), their ratio, the range of the
ratios of the pairs run back to back, and each side's mean reward. Everything a run writes goes under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GROUP, NEW_TOKENS, TEMPERATURE, LR = 8, 8, 0.7, 1e-4  # as the main job: examples/async_ppo.yaml


def write_model(path: Path, sft_steps: int = 300, target_accuracy: float = 0.3) -> None:
    """A 2-layer, 128-wide Qwen2 on the 16-token tokenizer, taught the answer format by a short supervised
    phase (a random policy never earns a reward, so GRPO would never compute a gradient)."""
    from transformers import AutoModelForCausalLM

    from meshrl.embedded import build_char_tokenizer
    from meshrl.embedded.model import EmbeddedModelConfig, build_model_config
    from meshrl.embedded.warmstart import greedy_accuracy
    from meshrl.modeling import pack, response_logprobs
    from meshrl.tasks.arithmetic import AdditionTask

    tok = build_char_tokenizer(characters="0123456789+=")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_model_config(EmbeddedModelConfig(num_hidden_layers=2), tok))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    task, rng = AdditionTask(2), random.Random(0)
    train = list(task.split("train"))
    probe = rng.sample(train, 256)
    for step in range(sft_steps):
        batch = rng.sample(train, 128)
        packed = pack([tok.encode(p.prompt) for p in batch], [tok.encode(p.answer) + [tok.eos_token_id] for p in batch],
                      pad_id=tok.pad_token_id)
        logp = response_logprobs(model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits, packed)
        loss = -(logp * packed.response_mask).sum() / packed.response_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 20 == 0 and greedy_accuracy(model, tok, task, probe) >= target_accuracy:
            break
    print(f"model: {step + 1} supervised steps, greedy train accuracy {greedy_accuracy(model, tok, task, probe):.0%}")
    model.save_pretrained(path)
    tok.save_pretrained(path)


def sync_loop(model_dir: Path, samples: int, steps: int, warmup: int, *, bf16: bool = False) -> dict:
    """HF generate → reward → GRPO advantages → one AdamW step, in this process; samples/s after warm-up.
    ``bf16``: generation and the forward/backward under CPU bf16 autocast (fp32 weights and AdamW), as
    meshrl computes on a CPU with bf16 instructions (``meshrl.cpu``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshrl.tasks.arithmetic import AdditionTask

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # exactly NEW_TOKENS tokens, EOS among them (the answer ends at the first): the main job's
    # rollout.ignore_eos=true. (min_new_tokens would forbid EOS, and every reward would be 0.)
    model.generation_config.eos_token_id = None
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    problems, rng = list(AdditionTask(2).split("train")), random.Random(0)
    times, rewards = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        batch = rng.sample(problems, samples // GROUP)
        enc = tok([p.prompt for p in batch], return_tensors="pt", padding=True)
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            seqs = model.generate(**enc, do_sample=True, temperature=TEMPERATURE, top_k=0, max_new_tokens=NEW_TOKENS,
                                  num_return_sequences=GROUP, pad_token_id=tok.pad_token_id)
        prompt_len = enc["input_ids"].shape[1]
        completions = tok.batch_decode(seqs[:, prompt_len:], skip_special_tokens=False)
        reward = torch.tensor([float(c.split(tok.eos_token)[0].strip() == batch[i // GROUP].answer)
                               for i, c in enumerate(completions)]).view(-1, GROUP)
        adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).view(-1)
        model.train()
        mask = torch.cat([enc["attention_mask"].repeat_interleave(GROUP, 0), torch.ones_like(seqs[:, prompt_len:])], 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=seqs, attention_mask=mask).logits[:, prompt_len - 1 : -1].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1).gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        rewards.append(reward.mean().item())
    window = sum(times[warmup:])
    return {"samples_per_s": samples * steps / window, "step_s": window / steps,
            "reward_mean": sum(rewards[warmup:]) / steps}


def main_job(model_dir: Path, samples: int, steps: int, warmup: int, out: Path, extra: list[str], name: str = "") -> dict:
    """``examples/async_ppo.py --model DIR algo=grpo`` at these sizes; the run's own summary record."""
    name = name or f"main_job_{samples}"
    run_dir = out / name
    cmd = [sys.executable, str(ROOT / "examples" / "async_ppo.py"), "--model", str(model_dir), "algo=grpo",
           f"algo.samples_per_prompt={GROUP}", f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.ignore_eos=true",
           f"trainer.samples_per_step={samples}",
           f"rollout.prompts_per_request={min(16, samples // GROUP)}", f"run.total_steps={warmup + steps}", f"run.eval_every={warmup + steps}",
           f"run.output_dir={run_dir}", "run.overwrite=true", *extra]  # a rerun replaces the measurement
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    from meshrl.pipeline.timeline import run_summary

    summary = run_summary(run_dir, warmup_steps=warmup)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records if r["kind"] == "step"][warmup:]
    return {"samples_per_s": summary["samples_per_s"], "step_s": summary["window_s"] / summary["steps"],
            "reward_mean": sum(rewards) / max(1, len(rewards)), "command": " ".join(cmd[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 256], help="samples per step (multiples of 8)")
    parser.add_argument("--steps", type=int, default=0,
                        help="measured steps per run (default: 16,000 samples' worth, 100 at least: 5-15 s of each side)")
    parser.add_argument("--loop-bf16", action="store_true",
                        help="also time the loop under CPU bf16 autocast (how much of the ratio is precision)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/laptop_grpo"))
    parser.add_argument("--skip-loop", action="store_true", help="only the main job (profiling)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each side per size, alternating loop and main job; the table gives the median "
                             "of each side and the range of the pairs' ratios (this machine's noise: ±15%% between sittings)")
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for the main job")
    args = parser.parse_args()
    if any(s % GROUP for s in args.sizes):
        parser.error(f"--sizes must be multiples of {GROUP} (whole groups)")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    if not (model_dir / "config.json").is_file():
        write_model(model_dir)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    rows = []
    for samples in args.sizes:
        steps = args.steps or max(100, 16000 // samples)
        for repeat in range(args.repeats):
            loop = None if args.skip_loop else sync_loop(model_dir, samples, steps, args.warmup)
            loop_bf16 = sync_loop(model_dir, samples, steps, args.warmup, bf16=True) if args.loop_bf16 else None
            job = main_job(model_dir, samples, steps, args.warmup, args.out, args.overrides,
                           f"main_job_{samples}" + (f"_{repeat}" if args.repeats > 1 else ""))
            rows.append({"samples_per_step": samples, "steps": steps, "repeat": repeat, "loop": loop,
                         "loop_bf16": loop_bf16, "main_job": job})
            (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    nan = {"samples_per_s": float("nan"), "reward_mean": float("nan")}

    def rate(runs: list[dict | None]) -> float:
        return statistics.median((r or nan)["samples_per_s"] for r in runs)

    print(f"{'samples/step':>12} {'steps':>5} {'runs':>4} {'loop samples/s':>15} {'loop bf16':>10} {'main job samples/s':>19} "
          f"{'ratio':>6} {'pairs':>11} {'vs bf16':>8} {'reward loop/job':>16}")
    for samples in args.sizes:
        rs = [r for r in rows if r["samples_per_step"] == samples]
        loop, loop_bf16, job = rate([r["loop"] for r in rs]), rate([r["loop_bf16"] for r in rs]), rate([r["main_job"] for r in rs])
        pairs = [r["main_job"]["samples_per_s"] / (r["loop"] or nan)["samples_per_s"] for r in rs]
        reward = statistics.mean((r["loop"] or nan)["reward_mean"] for r in rs), statistics.mean(r["main_job"]["reward_mean"] for r in rs)
        print(f"{samples:>12} {rs[0]['steps']:>5} {len(rs):>4} {loop:>15.0f} {loop_bf16:>10.0f} {job:>19.0f} {job / loop:>6.2f} "
              f"{min(pairs):>5.2f}-{max(pairs):<5.2f} {job / loop_bf16:>8.2f} {reward[0]:>8.3f}/{reward[1]:.3f}")


if __name__ == "__main__":
    main()
