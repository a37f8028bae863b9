"""The warm start: a short supervised phase that teaches a fresh model the task's format.

No pretrained weights exist offline, and RL from a random policy would never see a reward; a
few hundred steps of supervised learning on ``prompt → answer`` leave a policy that is right
some of the time, which is where RL starts. The result is a Hugging Face safetensors checkpoint
(model, config, tokenizer) in a cache folder keyed by everything that shapes it, so later runs
reuse it. It is written to a temporary folder, with a manifest of its files' sizes and digests
(``meshrl.manifest``), and renamed into place, so a run killed midway never leaves a half-written
cache entry; an entry damaged since (a truncated copy, a full disk) is found and trained again.

Simplification on purpose: one process, plain AdamW, constant learning rate.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import msgspec
import torch
from transformers import AutoModelForCausalLM

from meshrl import manifest
from meshrl.embedded.model import EmbeddedModelConfig, build_model_config
from meshrl.embedded.tokenizer import build_char_tokenizer
from meshrl.envs.rewards import to_reward_output
from meshrl.modeling import no_progress_bars, pack, response_logprobs
from meshrl.tasks import Task

__all__ = ["WarmStartConfig", "WarmStartStopped", "warm_start", "default_cache_dir"]

_FORMAT = 2  # bump when the warm start's procedure changes, so old cache entries are not reused
# 2: the char tokenizer spelled in the byte-level alphabet (entries of 1 carry a tokenizer that
#    transformers 5 reads without whitespace in Qwen2 folders)


class WarmStartConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Supervised warm start of the embedded default (skipped with ``model.path``)."""

    target_accuracy: float | None = 0.4
    """Stop once greedy accuracy on a sample of *training* problems reaches this (None: run all
    ``max_steps``); kept low on purpose, so that RL has room to improve."""
    max_steps: int = 1000
    """Upper bound on optimiser steps."""
    check_every: int = 10
    """Steps between accuracy checks."""
    batch_size: int = 128
    """Problems per step."""
    lr: float = 1e-3
    seed: int = 0
    cache_dir: str | None = None
    """Where checkpoints are cached; default $MESHRL_CACHE or ~/.cache/meshrl."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "check_every", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmstart.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"warmstart.lr must be a finite number > 0, got {self.lr}")
        if self.target_accuracy is not None and not 0 <= self.target_accuracy <= 1:
            raise ValueError(f"warmstart.target_accuracy must be in [0, 1] (or null), got {self.target_accuracy}")


def default_cache_dir() -> Path:
    return Path(os.environ.get("MESHRL_CACHE", Path.home() / ".cache" / "meshrl"))


def _cache_key(model_cfg: EmbeddedModelConfig, task: Task, cfg: WarmStartConfig, vocab_size: int) -> str:
    train = task.split("train")
    problems = hashlib.sha256()  # every training problem, answers included: corrected labels retrain
    for p in train:
        problems.update(json.dumps([p.prompt, p.answer]).encode())
    fingerprint = {
        "format": _FORMAT,
        "model": msgspec.to_builtins(model_cfg),
        "warmstart": {k: v for k, v in msgspec.to_builtins(cfg).items() if k != "cache_dir"},
        "task": [getattr(task, "name", type(task).__name__), len(train), problems.hexdigest(), len(task.split("test"))]
        + ([task.reward_mode] if getattr(task, "reward_mode", "exact") != "exact" else []),  # it decides when to stop
        "vocab": vocab_size,
    }
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task: Task, problems, max_new_tokens: int = 16) -> float:
    """Share of ``problems`` whose greedy completion earns the task's full reward (HF generate)."""
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True).to(model.device)
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
    finally:
        tokenizer.padding_side = side
        model.train()
    texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return sum(to_reward_output(task.reward(p, t)).reward >= 1.0 for p, t in zip(problems, texts)) / len(problems)


def _damage(entry: Path) -> str | None:
    """What is wrong with a cache entry (naming the file), or None. Entries written before manifests:
    each safetensors file's header must cover the file (a truncated one does not) and the config read."""
    if manifest.has_manifest(entry):
        return manifest.damage(entry)
    from safetensors import SafetensorError, safe_open

    for path in sorted(entry.glob("*.safetensors")) or [entry / "model.safetensors"]:
        try:
            with safe_open(str(path), "pt"):
                pass
        except (OSError, SafetensorError) as exc:
            return f"{path}: {str(exc)[:120]}"
    try:
        json.loads((entry / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{entry / 'config.json'}: {type(exc).__name__}"
    return None


class WarmStartStopped(RuntimeError):
    """``warm_start``'s ``stop`` was set before it finished; nothing was cached."""


def warm_start(
    model_cfg: EmbeddedModelConfig, task: Task, cfg: WarmStartConfig, *, log=print,
    stop: threading.Event | None = None,
) -> Path:
    """Return the warm-started checkpoint folder, training and caching it on first use.

    ``stop``, when set (from another thread: the caller that runs this in a thread was cancelled),
    ends the training at its next step with ``WarmStartStopped``, caching nothing."""
    tokenizer = build_char_tokenizer()
    root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    out = root / "warmstart" / _cache_key(model_cfg, task, cfg, len(tokenizer))
    if (out / "meshrl_warmstart.json").is_file():
        problem = _damage(out)
        if problem is None:
            log(f"warm start: reusing {out}")
            return out
        log(f"warm start: the cached {out} is damaged ({problem}): training it again")
        shutil.rmtree(out, ignore_errors=True)

    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a GPU makes a bigger model's warm start seconds
    model = AutoModelForCausalLM.from_config(build_model_config(model_cfg, tokenizer)).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    train = task.split("train")
    eos = tokenizer.eos_token_id
    probe = [train[rng.randrange(len(train))] for _ in range(256)]
    start, last_loss, accuracy = time.perf_counter(), float("nan"), 0.0
    for step in range(cfg.max_steps):
        if stop is not None and stop.is_set():
            raise WarmStartStopped(f"warm start: stopped after {step} of at most {cfg.max_steps} steps; nothing was cached")
        batch = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)]
        prompts = [tokenizer.encode(p.prompt) for p in batch]
        answers = [tokenizer.encode(p.answer) + [eos] for p in batch]
        packed = pack(prompts, answers, pad_id=tokenizer.pad_token_id).to(device)
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
        logp = response_logprobs(logits, packed)
        loss = -(logp * packed.response_mask).sum() / packed.response_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        last_loss = loss.item()
        if (step + 1) % cfg.check_every == 0 or step + 1 == cfg.max_steps:
            accuracy = greedy_accuracy(model, tokenizer, task, probe)
            log(f"warm start: step {step + 1}  loss {last_loss:.3f}  train accuracy {accuracy:.0%}")
            if cfg.target_accuracy is not None and accuracy >= cfg.target_accuracy:
                break

    # one folder per writer: two runs (two processes, or two pipelines of one program) may warm-start
    # the same entry at once; the first to finish puts it in place and the other keeps that one
    tmp = out.with_name(out.name + f".tmp{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with no_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    meta = {"steps": step + 1, "train_accuracy": accuracy, "final_loss": last_loss, "seconds": time.perf_counter() - start}
    (tmp / "meshrl_warmstart.json").write_text(json.dumps(meta))
    manifest.write_manifest(tmp)  # what a later run checks the entry against before it trusts it
    if not (out / "meshrl_warmstart.json").is_file():
        shutil.rmtree(out, ignore_errors=True)  # an entry without its metadata file is not one
        try:
            tmp.rename(out)
        except OSError:  # another writer put its entry in place between the check and here
            if not (out / "meshrl_warmstart.json").is_file():
                raise
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"warm start: another run cached {out} first; using it")
        return out
    log(f"warm start: {meta['steps']} steps in {meta['seconds']:.0f}s, accuracy {accuracy:.0%}, saved {out}")
    return out
