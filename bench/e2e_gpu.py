"""End to end: does asynchronous training beat synchronous by the overlap it promises?

Run on ``nvidia-h200-x2`` after ``source .whlb/install-on-gpu.sh`` (trainer on GPU0, engine on GPU1):

    python3 bench/e2e_gpu.py --models 0.5b --out $OUT/e2e             # η = 0 (sync), 1, 2, 4
    python3 bench/e2e_gpu.py --models 0.5b,1.5b --budget-s 480 --out $OUT/e2e
    python3 bench/e2e_gpu.py --tiny --out runs/e2e-tiny                # CPU, a 2-layer model: checks the script

On one GPU (``nvidia-h200`` or an H100), trainer and engine in one process, the engine generating through
the step (at 1.5B, 4,096 tokens per micro-batch fit an 80 GB card beside the resident engine):

    python3 bench/e2e_gpu.py --models 0.5b --out $OUT/e2e placement=colocated rollout.num_workers=1 colocated.overlap=true

For each model and each η in ``--etas`` it runs the library's own ``Pipeline`` in this process, on one
local Ray cluster, with the same configuration: GRPO (``--samples-per-prompt`` per group), a random
Qwen2.5-shaped model (bf16 weights, a vocabulary of 151,936 ids and a character tokenizer padded to
it, so every sampled id decodes), a synthetic task whose prompts are ``--prompt-len`` characters
(= tokens) and whose reward is the parity of a CRC of the completion's text (real decoding and
scoring on the reward worker, rewards that differ within a group), and fixed-length completions
(``rollout.ignore_eos``: exactly ``--response-len`` tokens). FSDP2 trainer (dp=1, bf16 compute, fp32
master weights) on one GPU, TorchEngine (CUDA graphs) on the other, weight pushes over NCCL
(``reshard.transport=distributed``) after every step. ``requests_in_flight × prompts_per_request ×
samples_per_prompt = samples_per_step``, so the engine's batch is one train step's samples in
every run: overlap is the only thing η changes.

Measured (``meshrl.pipeline.timeline``) over the steady-state window — from the end of the
``--warmup``-th train step to the end of the last, held-out evaluations cut out:

- samples/s and (response) tokens/s trained; mean staleness of the trained samples;
- phase times of the synchronous run (η = 0): T_gen (rollout side: generate ∪ score, per step) and
  T_train (train step), and the ideal overlap speedup (T_gen + T_train) / max(T_gen, T_train)
  (the two phases' overlap alone; the synchronous step also holds its push and gaps, which overlap
  may hide too, so a ratio a little above 1 is possible: ``meshrl.pipeline.timeline``);
- achieved speedup = samples/s of η over samples/s of η = 0, and its ratio to the ideal;
- idle fraction of each role (rollout engine, reward, trainer) from the per-role timeline;
- weight-sync time per push, and as a share of a train step.

Writes under ``--out``: per model ``<model>/eta<η>/`` (the run: metrics.jsonl, timeline.jsonl,
timeline.png, plots.png), ``<model>/timelines.png`` (every η's lanes over the same few seconds of
steady state: the overlap picture), ``e2e.json`` and ``e2e.md``, rewritten after every run (a run
cut short by a time limit still leaves the finished ones). The table prints last.

Balance matters: the speedup is only measurable when T_gen and T_train are close. Generation time
grows with ``--response-len`` (one decode step per token, nearly flat in batch size on an H200);
training time with samples × (prompt + response) tokens. The defaults per model aim at T_gen ≈
T_train on an H200; check the η = 0 row's T_gen and T_train and adjust with the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # before Ray starts: its workers inherit them

from meshrl.config import load_config  # noqa: E402
from meshrl.pipeline import Pipeline, PipelineConfig  # noqa: E402
from meshrl.pipeline.timeline import load_spans, run_summary, steady_window  # noqa: E402
from meshrl.tasks import Problem, RewardOutput  # noqa: E402

SHAPES = {  # Qwen2.5 config.json values; "tiny" for the CPU check
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
# Per model: samples per step, prompt and response tokens, so that T_train is about 1.2-1.4 x T_gen
# on an H200 (estimates from bench/RESULTS.md: TorchEngine ~1.2 ms per decode step at 0.5B, ~1.5 ms
# at 1.5B; the FSDP2 trainer ~66k tokens/s at 0.5B, ~3x slower at 1.5B): close enough for a large
# ideal speedup (~1.8x), far enough apart that the busier role is not a coin toss.
DEFAULTS = {
    "0.5b": dict(samples_per_step=96, prompt_len=64, response_len=512),
    "1.5b": dict(samples_per_step=48, prompt_len=64, response_len=512),
    "tiny": dict(samples_per_step=16, prompt_len=8, response_len=8),
}
ACCEPT = {"ratio_to_ideal": 0.9, "busier_idle": 0.10, "sync_share_of_train": 0.05}


class SyntheticTask:
    """Prompts of ``prompt_len`` random letters and digits (one token each); the reward is the
    parity of the completion's CRC-32 (deterministic, different within a group, needs the text)."""

    name = "synthetic"

    def __init__(self, prompt_len: int, *, num_train: int = 4096, num_test: int = 8, seed: int = 0):
        rng = random.Random(seed)
        alphabet = string.ascii_letters + string.digits

        def problems(n: int, first: int) -> list[Problem]:
            return [Problem(id=first + i, prompt="".join(rng.choices(alphabet, k=prompt_len)), answer="") for i in range(n)]

        self._splits = {"train": problems(num_train, 0), "test": problems(num_test, num_train)}

    def split(self, name: str) -> list[Problem]:
        return self._splits[name]

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return RewardOutput(reward=float(zlib.crc32(completion.encode()) & 1))


def write_model(path: Path, shape: str, max_len: int, *, bf16: bool) -> None:
    """A random Qwen2.5-shaped model and a character tokenizer padded to its vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from meshrl.embedded import build_char_tokenizer

    tok = build_char_tokenizer(SHAPES[shape]["vocab_size"])
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=max(4096, max_len), rope_theta=1e6, rms_norm_eps=1e-6,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # HF's init is seconds on a GPU, long on a CPU at 1.5B
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if bf16 else torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def overrides(args: argparse.Namespace, shape: str, eta: int, model_dir: Path, run_dir: Path) -> list[str]:
    s = {**DEFAULTS[shape], **{k: v for k, v in vars(args).items() if k in DEFAULTS[shape] and v is not None}}
    n, rif = args.samples_per_prompt, args.requests_in_flight
    if s["samples_per_step"] % (n * rif):
        sys.exit(f"--samples-per-step {s['samples_per_step']} must be a multiple of --samples-per-prompt × "
                 f"--requests-in-flight = {n * rif}")
    device = "cpu" if args.tiny else "cuda"
    return [
        f"model.path={model_dir}", f"run.output_dir={run_dir}", "run.overwrite=true",  # a rerun replaces the cell
        f"run.total_steps={args.warmup + args.steps}",
        "run.eval_every=0", "run.eval_max_new_tokens=4", "run.progress=false", "run.checkpoint_at_end=false",
        f"run.step_timeout_s={args.step_timeout_s}", f"queue.max_staleness={eta}",
        f"queue.reserve_timeout_s={args.step_timeout_s}", f"queue.get_timeout_s={args.step_timeout_s}",
        "algo=grpo", f"algo.samples_per_prompt={n}",
        f"trainer.samples_per_step={s['samples_per_step']}", f"trainer.device={device}", "trainer.lr=1e-6",
        f"trainer.tokens_per_microbatch={args.tokens_per_microbatch}", f"trainer.threads={1 if args.tiny else 8}",
        f"rollout.max_new_tokens={s['response_len']}", "rollout.ignore_eos=true", "rollout.temperature=1.0",
        f"rollout.requests_in_flight={rif}", f"rollout.prompts_per_request={s['samples_per_step'] // (n * rif)}",
        f"rollout.engine.device={device}", f"rollout.engine.max_batch_size={s['samples_per_step']}",
        f"rollout.engine.max_seq_len={s['prompt_len'] + s['response_len'] + 8}",
        f"rollout.threads={1 if args.tiny else 4}", "reshard.transport=distributed",
    ] + list(args.overrides)


def run_one(args: argparse.Namespace, shape: str, eta: int, model_dir: Path, run_dir: Path, task: SyntheticTask) -> dict:
    cfg = load_config(PipelineConfig, None, overrides(args, shape, eta, model_dir, run_dir))
    print(f"\n=== {shape} η={eta}: {cfg.trainer.samples_per_step} samples/step × ({args_len(args, shape)}) tokens, "
          f"{args.warmup} + {args.steps} steps -> {run_dir}", flush=True)
    t0 = time.perf_counter()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    summary = runner(Pipeline(cfg, task=task).run())
    wall = time.perf_counter() - t0
    shutil.rmtree(run_dir / "final", ignore_errors=True)  # the HF export: a model's worth of bytes, not a result
    s = run_summary(run_dir, args.warmup)
    balance = s["t_gen_s"] / s["t_train_s"] if s["t_train_s"] else float("nan")
    print(f"{shape} η={eta}: {s['samples_per_s']:.1f} samples/s, step {s['t_step_s']:.3f}s, T_gen {s['t_gen_s']:.3f}s, "
          f"T_train {s['t_train_s']:.3f}s (T_gen/T_train {balance:.2f}"
          + (": within 10%, the busier role is a coin toss; change --samples-per-step or --response-len" if eta == 0 and
             0.9 < balance < 1.1 else "") + f"), push {s['t_sync_s'] * 1e3:.1f} ms, idle "
          + ", ".join(f"{k} {v:.1%}" for k, v in s["idle"].items()) + f"; run wall {wall:.0f}s", flush=True)
    print(f"{shape} η={eta}: steps median {s.get('step_s_median', float('nan')):.3f}s, p90 {s.get('step_s_p90', float('nan')):.3f}s "
          f"(p90/median {s.get('step_p90_over_median', float('nan')):.2f}); train part median "
          f"{s.get('train_s_median', float('nan')):.3f}s, p90 {s.get('train_s_p90', float('nan')):.3f}s", flush=True)
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"kind": "step"' in x]
    measured = steps[-s["steps"] :]
    # the push's parts (meshrl.reshard PushStats.phases, logged as sync/*), mean over the measured steps
    phases = sorted({k for r in measured for k in r if k.startswith("sync/")})
    sync_phases = {k: sum(r.get(k, 0.0) for r in measured) / max(1, sum(k in r for r in measured)) for k in phases}
    if sync_phases:
        print(f"{shape} η={eta} push parts (ms, mean): "
              + ", ".join(f"{k[5:]} {v * 1e3:.1f}" for k, v in sync_phases.items() if k.endswith("_s")), flush=True)
    # generated but never trained (meshrl.queues admission should make these zero), over the whole run
    wasted = {k: steps[-1].get(f"queue/{k}", 0) for k in ("dropped_stale", "kept_stale", "dropped_incomplete")}
    if any(wasted.values()):
        print(f"{shape} η={eta} samples past the staleness bound or incomplete: {wasted}", flush=True)
    return {
        "eta": eta, "wall_s": wall, "steps": summary["steps"], "measured_steps": s["steps"], "queue": wasted,
        "response_tokens_mean": sum(r["response_tokens_mean"] for r in measured) / len(measured),
        "trainer_train_time_s": sum(r["train_time_s"] for r in measured) / len(measured),
        **{k: v for k, v in s.items() if k != "steps"}, "sync_phases": sync_phases,
    }


def args_len(args: argparse.Namespace, shape: str) -> str:
    d = {**DEFAULTS[shape], **{k: v for k, v in vars(args).items() if k in DEFAULTS[shape] and v is not None}}
    return f"{d['prompt_len']} + {d['response_len']}"


def evaluate(runs: list[dict]) -> dict:
    """Speedups against the η = 0 run, and the acceptance checks (module docstring)."""
    sync = next((r for r in runs if r["eta"] == 0), None)
    if sync is None:
        return {}
    ideal = sync["ideal_speedup"]
    busier = "trainer" if sync["t_train_s"] >= sync["t_gen_s"] else "rollout"
    for r in runs:
        r["speedup"] = r["samples_per_s"] / sync["samples_per_s"]
        r["ratio_to_ideal"] = r["speedup"] / ideal
        r["idle_rollout"] = max(v for k, v in r["idle"].items() if k.startswith("rollout/"))
        r["idle_trainer"] = r["idle"].get("trainer", 1.0)
        r["idle_reward"] = r["idle"].get("reward", 1.0)
        r["busier_idle"] = r[f"idle_{busier}"]
        r["sync_share_of_train"] = r["t_sync_s"] / r["t_train_s"] if r["t_train_s"] else float("inf")
        if r["eta"] > 0:
            r["accepted"] = {
                "speedup >= 0.9 x ideal": r["ratio_to_ideal"] >= ACCEPT["ratio_to_ideal"],
                f"busier role ({busier}) idle <= 10%": r["busier_idle"] <= ACCEPT["busier_idle"],
                "push <= 5% of a train step": r["sync_share_of_train"] <= ACCEPT["sync_share_of_train"],
            }
    return {"ideal_speedup": ideal, "t_gen_s": sync["t_gen_s"], "t_train_s": sync["t_train_s"], "busier": busier}


def table(model: dict) -> list[str]:
    ev = model.get("reference", {})
    head = (f"**{model['model']}** ({model['config']['samples_per_step']} samples/step × ({model['config']['prompt_len']} + "
            f"{model['config']['response_len']}) tokens, {model['config']['measured_steps']} measured steps after "
            f"{model['config']['warmup_steps']}): sync T_gen {ev.get('t_gen_s', float('nan')):.3f} s, "
            f"T_train {ev.get('t_train_s', float('nan')):.3f} s, ideal speedup {ev.get('ideal_speedup', float('nan')):.2f}x, "
            f"busier role: {ev.get('busier', '?')}")
    lines = [head, "",
             "| η | samples/s | tokens/s | step s | T_gen s | T_train s | speedup | ideal | ratio | idle rollout | idle trainer "
             "| idle reward | push ms | push % train | staleness | accepted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in model["runs"]:
        ok = r.get("accepted")
        if ok is None or model["model"] == "tiny":  # the CPU check of the script: its numbers mean nothing
            verdict = "-"
        else:
            verdict = "PASS" if all(ok.values()) else "FAIL: " + "; ".join(k for k, v in ok.items() if not v)
        lines.append(
            f"| {r['eta']} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['t_step_s']:.3f} | {r['t_gen_s']:.3f} | "
            f"{r['t_train_s']:.3f} | {r.get('speedup', float('nan')):.2f}x | {ev.get('ideal_speedup', float('nan')):.2f}x | "
            f"{r.get('ratio_to_ideal', float('nan')):.2f} | {r.get('idle_rollout', float('nan')):.1%} | "
            f"{r.get('idle_trainer', float('nan')):.1%} | {r.get('idle_reward', float('nan')):.1%} | {r['t_sync_s'] * 1e3:.1f} | "
            f"{r.get('sync_share_of_train', float('nan')):.1%} | {r.get('staleness_mean', float('nan')):.2f} | {verdict} |"
        )
    return lines


def plot_overlap(model_dir_out: Path, runs: list[dict], warmup: int) -> Path | None:
    """Every η's lanes over the same stretch of steady state (about four synchronous steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from meshrl.pipeline.plots import draw_timeline

    if not runs:
        return None
    span_s = 4 * max(r["t_step_s"] for r in runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(14, 2.4 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        spans = load_spans(model_dir_out / f"eta{r['eta']}")
        window, _ = steady_window(spans, warmup)
        x0 = window[0][0] if window else 0.0
        shifted = [{**s, "start": s["start"] - x0, "end": s["end"] - x0} for s in spans]
        label = "synchronous (η=0)" if r["eta"] == 0 else f"asynchronous η={r['eta']}"
        draw_timeline(ax, shifted, warmup_steps=warmup, xlim=(-0.05 * span_s, span_s),
                      title=f"{label}: {r['samples_per_s']:.1f} samples/s, step {r['t_step_s']:.2f}s"
                      + (f", {r['speedup']:.2f}x sync" if "speedup" in r else ""))
        ax.set_xlabel("seconds since the steady-state window opened")
    fig.tight_layout()
    out = model_dir_out / "timelines.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="0.5b", help="comma-separated: 0.5b, 1.5b (default: %(default)s)")
    p.add_argument("--etas", default="0,1,2,4", help="max_staleness values; 0 (synchronous) is the reference")
    p.add_argument("--steps", type=int, default=10, help="measured train steps per run")
    p.add_argument("--warmup", type=int, default=2, help="train steps before the measured window")
    p.add_argument("--samples-per-step", type=int, help="default per model (DEFAULTS)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens; default per model")
    p.add_argument("--response-len", type=int, help="completion tokens (fixed); default per model")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="GRPO group size")
    p.add_argument("--requests-in-flight", type=int, default=2, help="generate calls at once (they share one step's samples)")
    p.add_argument("--tokens-per-microbatch", type=int, default=16384)
    p.add_argument("--step-timeout-s", type=float, default=300.0, help="longest wait for any step, batch or push")
    p.add_argument("--budget-s", type=float, help="skip a run when the previous one's wall time would end past this")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU (checks the script; numbers mean nothing)")
    p.add_argument("--out", default="runs/e2e", help="output directory")
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides for every run, e.g. rollout.engine.cuda_graphs=false")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after the options
    if args.tiny:
        args.models = "tiny"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    etas = sorted({int(x) for x in args.etas.split(",")})
    result = {"args": vars(args), "models": []}
    skipped: list[str] = []
    last_wall = 0.0
    with tempfile.TemporaryDirectory(prefix="e2e_models_") as tmp:
        for shape in args.models.split(","):
            d = {**DEFAULTS[shape], **{k: v for k, v in vars(args).items() if k in DEFAULTS[shape] and v is not None}}
            model = {"model": shape, "config": {**d, "samples_per_prompt": args.samples_per_prompt,
                                                "measured_steps": args.steps, "warmup_steps": args.warmup},
                     "runs": []}
            result["models"].append(model)
            model_dir = Path(tmp) / shape
            t0 = time.perf_counter()
            write_model(model_dir, shape, d["prompt_len"] + d["response_len"] + 8, bf16=not args.tiny)
            print(f"{shape}: random model written in {time.perf_counter() - t0:.1f}s", flush=True)
            task = SyntheticTask(d["prompt_len"])
            for eta in etas:
                elapsed = time.perf_counter() - start
                # a bigger model's first run: guess it takes half again as long as the last one
                estimate = last_wall * (1.0 if model["runs"] else 1.5)
                if args.budget_s is not None and elapsed + estimate > args.budget_s:
                    skipped.append(f"{shape} η={eta}")
                    print(f"skipping {shape} η={eta}: {elapsed:.0f}s used, the next run would take about {estimate:.0f}s, "
                          f"--budget-s {args.budget_s:.0f}", flush=True)
                    continue
                t0 = time.perf_counter()
                try:
                    run = run_one(args, shape, eta, model_dir, out / shape / f"eta{eta}", task)
                except Exception as exc:  # one failed run (say, out of memory at 1.5B) keeps the others' results
                    traceback.print_exc()
                    model.setdefault("failed", []).append({"eta": eta, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                    print(f"FAILED {shape} η={eta}: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
                    write_outputs(out, result, skipped)
                    continue
                finally:
                    last_wall = time.perf_counter() - t0
                model["runs"].append(run)
                model["reference"] = evaluate(model["runs"])
                plot_overlap(out / shape, model["runs"], args.warmup)
                write_outputs(out, result, skipped)
    lines = write_outputs(out, result, skipped)
    print("\n" + "\n".join(lines), flush=True)
    return 0


def write_outputs(out: Path, result: dict, skipped: list[str]) -> list[str]:
    result["skipped"] = skipped
    (out / "e2e.json").write_text(json.dumps(result, indent=1, default=str))
    lines = []
    for model in result["models"]:
        lines += table(model) + [f"FAILED η={f['eta']}: {f['error'][:300]}" for f in model.get("failed", [])] + [""]
    if skipped:
        lines.append(f"skipped (time budget): {', '.join(skipped)}")
    (out / "e2e.md").write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    sys.exit(main())
