"""The main job: asynchronous PPO (or GRPO) on a built-in task, end to end.

    python examples/async_ppo.py                                 # embedded default, CPU, minutes
    python examples/async_ppo.py algo=grpo queue.max_staleness=2 # dotted overrides
    python examples/async_ppo.py --model DIR task.kind=file task.train_file=train.jsonl task.test_file=test.jsonl

With no model given it warm-starts a small Qwen2 model on multi-digit addition (cached after the
first run), then trains it with RL: rollout, reward and training run at once as Ray actors joined
by a staleness-bounded queue. It prints one line per step and writes, under run.output_dir,
metrics.jsonl, timeline.jsonl, plots.png, config.yaml and final/ (a Hugging Face checkpoint).
Ctrl-C stops cleanly: the steps in flight finish, a checkpoint is written (``run.resume=latest``
continues from it) and final/ is exported; a second Ctrl-C aborts (a warm start under way ends at
its next step, caching nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

from meshrl.config import ConfigError, load_config, to_yaml
from meshrl.actors.trainer import NonFiniteStepsError
from meshrl.pipeline import Pipeline, PipelineConfig

DEFAULT_CONFIG = Path(__file__).with_suffix(".yaml")


def parse(argv: list[str] | None) -> PipelineConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. queue.max_staleness=2 algo=grpo")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--model", help="a local Hugging Face causal LM directory (same as model.path=DIR)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_intermixed_args(argv)  # overrides before and after --model alike
    overrides = list(args.overrides)
    if args.model is not None:
        if any(o.partition("=")[0].strip() in ("model", "model.path") for o in overrides):
            raise ConfigError("--model DIR and a model.path= override both name the model: give one")
        overrides.append(f"model.path={json.dumps(args.model)}")  # quoted: `2024`, `null` or `a#b` stay the path
    cfg = load_config(PipelineConfig, args.config, overrides).validate()
    if args.print_config:
        print(to_yaml(cfg), end="")
        sys.exit(0)
    return cfg


async def run_until_interrupted(pipeline: Pipeline) -> dict:
    """``pipeline.run()``; the first Ctrl-C stops it cleanly (``Pipeline.stop``), a second cancels it."""
    loop, run = asyncio.get_running_loop(), asyncio.ensure_future(pipeline.run())
    stopping: list[asyncio.Future] = []

    def interrupted() -> None:
        if stopping:
            run.cancel()
            return
        print("\nstopping: the steps in flight finish, then a checkpoint (run.resume=latest continues from it) and "
              "final/ are written; Ctrl-C again to abort", file=sys.stderr, flush=True)
        stopping.append(asyncio.ensure_future(pipeline.stop()))

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # no signal handlers off the main thread (uvloop: ValueError)
        loop.add_signal_handler(signal.SIGINT, interrupted)
    try:
        return await run
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
        await asyncio.gather(*stopping, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(argv)
    except (ConfigError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        pipeline = Pipeline(cfg)  # reads the task's files: a bad one stops here, before any actor starts
    except (ConfigError, ValueError, OSError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = runner(run_until_interrupted(pipeline))
    except asyncio.CancelledError:
        print("aborted: nothing was saved beyond the last checkpoint", file=sys.stderr)
        return 130
    except ConfigError as exc:  # found once the task is tokenized (a prompt too long for the engine), before any actor
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteStepsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if summary["stopped"]:
        before = summary["accuracy_before"]
        print(f"\nstopped after {summary['steps']} steps" + (f" (held-out accuracy before RL {before:.1%})" if before is not None else "")
              + "\n"
              f"resume:     python examples/async_ppo.py ... run.resume=latest   ({summary['last_checkpoint']})\n"
              f"checkpoint: {summary['checkpoint']}\nmetrics:    {summary['metrics']}\nplots:      {summary['plot']}")
        return 0
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    print(
        f"\nheld-out accuracy: {summary['accuracy_before']:.1%} before RL -> {summary['accuracy_after']:.1%} after "
        f"{summary['steps']} steps ({gain * 100:+.1f} pp) in {summary['seconds'] / 60:.1f} min\n"
        f"checkpoint: {summary['checkpoint']}\nmetrics:    {summary['metrics']}\nplots:      {summary['plot']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
