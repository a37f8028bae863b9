"""The main job: asynchronous PPO (or GRPO) on a built-in task, end to end.

    python examples/async_ppo.py                                 # embedded default, CPU, minutes
    python examples/async_ppo.py algo=grpo queue.max_staleness=2 # dotted overrides
    python examples/async_ppo.py --model DIR task.kind=file task.train_file=train.jsonl task.test_file=test.jsonl

With no model given it warm-starts a small Qwen2 model on multi-digit addition (cached after the
first run), then trains it with RL: rollout, reward and training run at once as Ray actors joined
by a staleness-bounded queue. It prints one line per step and writes, under run.output_dir,
metrics.jsonl, timeline.jsonl, plots.png, config.yaml and final/ (a Hugging Face checkpoint).
Ctrl-C, SIGTERM (Slurm, Kubernetes, ``ray job stop``, ``kill``) and SIGHUP stop cleanly: the steps
in flight finish, a checkpoint is written (``run.resume=latest`` continues from it) and final/ is
exported, and the exit status is 128 + the signal's number (130, 143, 129); a warm start under way
ends at its next step, caching nothing. A second signal aborts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from meshrl.config import ConfigError, load_config, to_yaml
from meshrl.actors.trainer import NonFiniteStepsError
from meshrl.embedded import WarmStartStopped
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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, what Slurm, Kubernetes, `ray job stop` and `kill` send, and a closed terminal: each stops
the run cleanly (a second one aborts it), and the exit status is 128 + the signal's number."""


async def run_until_interrupted(pipeline: Pipeline) -> tuple[dict, list[int]]:
    """``pipeline.run()`` and the signals received: the first of ``STOP_SIGNALS`` stops it cleanly
    (``Pipeline.stop``), a second cancels it."""
    loop, run = asyncio.get_running_loop(), asyncio.ensure_future(pipeline.run())
    stopping: list[asyncio.Future] = []
    received: list[int] = []

    def interrupted(signum: int) -> None:
        received.append(signum)
        if stopping:
            run.cancel()
            return
        stopping.append(asyncio.ensure_future(pipeline.stop()))
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        with contextlib.suppress(OSError):
            print(f"\nstopping ({name}): the steps in flight finish, then a checkpoint (run.resume=latest continues "
                  f"from it) and final/ are written; {name} again to abort", file=sys.stderr, flush=True)

    installed = []
    for signum in STOP_SIGNALS:
        # no signal handlers off the main thread (uvloop: ValueError)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, interrupted, signum)
            installed.append(signum)
    try:
        return await run, received
    except asyncio.CancelledError:
        if received:
            raise Aborted(received[-1]) from None
        raise
    except WarmStartStopped as exc:  # stopped before RL began: nothing to save
        exc.signum = received[0] if received else signal.SIGINT
        raise
    finally:
        for signum in installed:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signum)
        await asyncio.gather(*stopping, return_exceptions=True)


class Aborted(Exception):
    """A second signal cancelled the run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _detach_from_terminal() -> None:
    """SIGHUP: the terminal is likely gone, and writing to it would fail (EIO) and stop the run
    uncleanly; its output goes to /dev/null from here (metrics.jsonl has every record)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                os.dup2(devnull, fd)
    os.close(devnull)


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
        summary, received = runner(run_until_interrupted(pipeline))
    except Aborted as exc:
        print("aborted: nothing was saved beyond the last checkpoint", file=sys.stderr)
        return 128 + exc.signum
    except asyncio.CancelledError:
        print("aborted: nothing was saved beyond the last checkpoint", file=sys.stderr)
        return 130
    except WarmStartStopped as exc:
        print(exc, file=sys.stderr)
        return 128 + exc.signum
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
        return 128 + received[0] if received else 0  # the shell's convention: which signal stopped it
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    print(
        f"\nheld-out accuracy: {summary['accuracy_before']:.1%} before RL -> {summary['accuracy_after']:.1%} after "
        f"{summary['steps']} steps ({gain * 100:+.1f} pp) in {summary['seconds'] / 60:.1f} min\n"
        f"checkpoint: {summary['checkpoint']}\nmetrics:    {summary['metrics']}\nplots:      {summary['plot']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
