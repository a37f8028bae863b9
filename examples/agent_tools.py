"""Tool use: the policy learns to call a calculator for multiplications it cannot do itself.

    python examples/agent_tools.py                      # about 6-8 minutes on a 2-core CPU
    python examples/agent_tools.py run.total_steps=60   # dotted overrides, as in async_ppo.py

The task is 2-digit multiplication (``23*47=`` → ``1081``), far beyond a 100k-parameter model.
The environment (``meshrl.envs.ToolEnv``) offers one tool: when the policy writes
``<calc>23*47</calc>`` the environment appends ``=1081;`` (loss mask 0: never trained on), and the
policy's next turn is its answer, scored by exact match. A short supervised warm start (cached
under ~/.cache/meshrl) teaches the format on a mix where only ``warm_tool_share`` of the answers
use the tool, so the policy starts out mostly guessing. RL (GRPO) then finds that calling the tool
pays: the tool-call rate and the accuracy rise together. It prints both before and after, on
held-out problems, greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import msgspec
import torch

import meshrl
from meshrl.embedded import EmbeddedModelConfig, build_char_tokenizer, build_model_config, default_cache_dir
from meshrl.modeling import pack, response_logprobs

RESULT_FORMAT = "={};"
"""How the environment shows the calculator's result (appended after the policy's tool call)."""
TOOLS = {"calc": meshrl.calculator}


class MultiplyTask:
    """``a*b=`` for 2-digit a and b; the answer is the product; exact-match reward."""

    name = "multiply"

    def __init__(self, num_test: int = 200, seed: int = 0) -> None:
        pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
        random.Random(seed).shuffle(pairs)
        self._splits = {
            "test": [meshrl.Problem(i, f"{a}*{b}=", str(a * b)) for i, (a, b) in enumerate(pairs[:num_test])],
            "train": [meshrl.Problem(i, f"{a}*{b}=", str(a * b)) for i, (a, b) in enumerate(pairs[num_test:])],
        }

    def split(self, name: str):
        return self._splits[name]

    def reward(self, problem: meshrl.Problem, completion: str) -> meshrl.RewardOutput:
        correct = float(completion.strip() == problem.answer)
        return meshrl.RewardOutput(reward=correct, info={"correct": correct})


class WarmStart(msgspec.Struct, frozen=True, kw_only=True):
    """The supervised warm start on tool and direct transcripts (policy tokens only are trained)."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    tool_share: float = 0.3
    """Share of warm-start answers that call the tool; the rest answer directly (mostly wrong)."""
    seed: int = 0


MODEL = EmbeddedModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256, max_position_embeddings=64)


def transcript(tok, problem: meshrl.Problem, use_tool: bool) -> tuple[list[int], list[int]]:
    """The response tokens of a correct episode and their loss mask (0 on the tool's result)."""
    ids, mask = [], []
    for text, policy in ((f"<calc>{problem.prompt[:-1]}</calc>", 1), (RESULT_FORMAT.format(problem.answer), 0))[: 2 if use_tool else 0]:
        part = tok.encode(text, add_special_tokens=False)
        ids, mask = ids + part, mask + [policy] * len(part)
    answer = tok.encode(problem.answer, add_special_tokens=False) + [tok.eos_token_id]
    return ids + answer, mask + [1] * len(answer)


def warm_start(task: MultiplyTask, cfg: WarmStart, log=print) -> Path:
    """Train (or reuse from the cache) the starting policy; returns its HF checkpoint folder."""
    key = hashlib.sha256(json.dumps([msgspec.to_builtins(MODEL), msgspec.to_builtins(cfg), RESULT_FORMAT,
                                     len(task.split("train"))]).encode()).hexdigest()[:16]
    out = default_cache_dir() / "agent_tools" / key
    if (out / "config.json").is_file():
        log(f"warm start: reusing {out}")
        return out
    tok = build_char_tokenizer()
    torch.manual_seed(cfg.seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(build_model_config(MODEL, tok)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng, train, t0 = random.Random(cfg.seed), task.split("train"), time.perf_counter()
    for step in range(cfg.steps):
        batch = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)]
        parts = [transcript(tok, p, rng.random() < cfg.tool_share) for p in batch]
        packed = pack([tok.encode(p.prompt) for p in batch], [ids for ids, _ in parts], pad_id=tok.pad_token_id,
                      loss_masks=[mask for _, mask in parts])
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
        loss = -(response_logprobs(logits, packed) * packed.response_mask).sum() / packed.response_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 200 == 0:
            log(f"warm start: step {step + 1}/{cfg.steps}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f}s)")
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def config(overrides: list[str]) -> meshrl.PipelineConfig:
    base = [
        "run.output_dir=runs/agent_tools", "run.total_steps=50", "run.eval_every=10", "algo=grpo",
        "algo.samples_per_prompt=8", "trainer.samples_per_step=128", "trainer.lr=1e-3", "queue.max_staleness=1",
        "rollout.prompts_per_request=8", "rollout.requests_in_flight=2", "rollout.max_new_tokens=20",
        "rollout.episode.max_turns=3", "rollout.episode.max_tokens=48",
    ]
    return meshrl.load_config(meshrl.PipelineConfig, None, base + overrides)


def rates(record: dict) -> str:
    return f"tool-call rate {record.get('info/tool_used', 0.0):6.1%}   accuracy {record['accuracy']:6.1%}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the pipeline config")
    p.add_argument("--warm-steps", type=int, default=WarmStart().steps, help="warm-start steps (default %(default)s)")
    p.add_argument("--warm-tool-share", type=float, default=WarmStart().tool_share, help="share of tool transcripts")
    args = p.parse_args(argv)
    try:
        cfg = config(args.overrides).validate()  # before the warm start: a bad value is named at once
    except ValueError as exc:  # ConfigError included
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    task = MultiplyTask()
    model_dir = warm_start(task, WarmStart(steps=args.warm_steps, tool_share=args.warm_tool_share))
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model_dir)))
    environment = meshrl.ToolEnv.factory(TOOLS, result_format=RESULT_FORMAT, max_calls=1)
    try:
        summary = asyncio.run(meshrl.Pipeline(cfg, task=task, reward=task.reward, environment=environment).run())
    except meshrl.ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    steps = [r for r in records if r["kind"] == "step"]
    head, tail = steps[: max(1, len(steps) // 10)], steps[-max(1, len(steps) // 10) :]
    sampled = [sum(s["reward_info/tool_used"] for s in part) / len(part) for part in (head, tail)]
    print(f"\nheld-out, greedy ({evals[0]['problems']} problems):\n"
          f"  before RL: {rates(evals[0])}\n  after  RL: {rates(evals[-1])}\n"
          f"sampled tool-call rate in training: {sampled[0]:.1%} (first steps) -> {sampled[1]:.1%} (last steps)\n"
          f"{summary['steps']} RL steps; {(time.perf_counter() - started) / 60:.1f} min in all, warm start included\n"
          f"checkpoint: {summary['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
