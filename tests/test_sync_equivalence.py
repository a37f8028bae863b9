"""Invariant: the asynchronous pipeline at max_staleness=0 trains exactly like synchronous RL.

The pipeline runs every role as a Ray actor with two rollout requests in flight, a queue, and
DTensor-planned weight pushes. The reference is the textbook synchronous loop in this process:
take the next prompts, generate with the current policy, score, train one step, load the new
weights into the engine. With the same seeds both must produce the same samples, the same
losses and the same final weights.

The runs train with plain SGD, and the final weights and metrics are compared within the bounds
that ``bounds.py`` derives (AdamW would amplify rounding past any useful bound).
"""

from __future__ import annotations

import asyncio
import collections
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bounds import PIPELINE_METRIC_TOL, sgd_weight_atol
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import PolicyTrainer
from meshrl.actors.reward import RolloutJob, score_job
from meshrl.config import load_config
from meshrl.embedded import warm_start
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine
from meshrl.mesh.actor_mesh import SENT
from meshrl.pipeline import Pipeline, PipelineConfig
from meshrl.queues import decode_samples
from meshrl.tasks import PromptStream, build_task

OVERRIDES = [
    "model.embedded.hidden_size=32", "model.embedded.num_hidden_layers=2", "model.embedded.intermediate_size=64",
    "model.embedded.num_attention_heads=2", "model.embedded.num_key_value_heads=2",
    "warmstart.max_steps=40", "warmstart.target_accuracy=null", "warmstart.batch_size=32", "warmstart.lr=3e-3",
    "task.digits=1", "task.num_test=16", "queue.max_staleness=0", "trainer.samples_per_step=16",
    "rollout.prompts_per_request=4", "rollout.requests_in_flight=2", "rollout.max_new_tokens=4",
    "run.total_steps=3", "run.eval_every=0", "run.progress=false",
    "trainer.optimizer=sgd", "trainer.lr=0.1", "trainer.critic_lr=0.1",
]
WEIGHT_ATOL = sgd_weight_atol(steps=3, lr=0.1)


def synchronous_reference(cfg: PipelineConfig, model_dir: str) -> tuple[list[dict], torch.nn.Module]:
    """Generate → score → train → load weights, one step at a time, all in this process."""
    task = build_task(cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = TorchEngine.from_pretrained(model_dir, cfg.rollout.engine)
    trainer = PolicyTrainer(model_dir, cfg.trainer, cfg.algo, dp=DataParallel(None, "cpu"),
                            temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                            total_steps=cfg.run.total_steps)
    stream, n, r = PromptStream(task.split("train"), seed=cfg.run.seed), cfg.algo.samples_per_prompt, cfg.rollout
    next_group, metrics = 0, []
    for version in range(cfg.run.total_steps):
        problems = stream.take(cfg.trainer.samples_per_step // n)
        group_ids = list(range(next_group, next_group + len(problems)))
        next_group += len(problems)
        prompt_ids = [tokenizer.encode(p.prompt) for p in problems]
        requests = [
            GenerateRequest(input_ids=ids, sampling=SamplingParams(
                max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=n,
                seed=(cfg.run.seed * 1_000_003 + g) % (1 << 62)))
            for ids, g in zip(prompt_ids, group_ids)
        ]
        results = asyncio.run(engine.generate(requests))
        scored = score_job(task, tokenizer, RolloutJob(problems=problems, prompt_ids=prompt_ids, results=results, group_ids=group_ids))
        metrics.append(trainer.train_step(decode_samples(scored.encoded), version))
        asyncio.run(engine.update_weights(trainer.policy_state().items(), version + 1))
    return metrics, trainer.policy


@pytest.mark.slow
@pytest.mark.parametrize("tp,transport,reward_workers", [(1, "distributed", 1), (2, "distributed", 1),
                                                         (2, "object_store", 0)])
def test_async_pipeline_at_staleness_zero_equals_synchronous_training(ray_cluster, tmp_path, capsys, tp, transport,
                                                                      reward_workers):
    """``tp=2``: each engine replica is two tensor-parallel actors (leader-driven), and the weight pushes
    reach both shards (each its own slices, or both the whole tensors); the run must still be the
    synchronous one on a single unsharded engine. ``reward_workers=0``: the rollout workers score.
    The roles run the loops: the controller makes no call a step or a request."""
    cfg = load_config(PipelineConfig, None, [*OVERRIDES, f"warmstart.cache_dir={tmp_path / 'cache'}",
                                             f"run.output_dir={tmp_path / 'run'}", f"rollout.tp_size={tp}",
                                             f"reshard.transport={transport}", f"reward.num_workers={reward_workers}",
                                             ])
    sent = collections.Counter(SENT)
    summary = asyncio.run(Pipeline(cfg).run())
    sent = collections.Counter(SENT) - sent
    # the rollout workers run their own loops: this process (the controller) took and put nothing
    assert not [m for m in sent if m.split(".")[1] in ("take", "put_encoded", "put_ref", "release")], sent
    assert sent["rollout.run_loops"] == 1, sent
    # and the trainer runs the train loop: one call a chunk (steps 1..3: one chunk), no batch or push from here
    assert not [m for m in sent if m.split(".")[1] in ("get_batch_refs", "train_step", "reshard_send",
                                                       "reshard_receive", "reshard_arm")], sent
    # the version pushed before the end's checkpoint, after it (the sampler: the one rollout worker's, or its own actor's)
    assert sent["rollout.set_version"] + sent["queue.set_version"] == 1, sent
    assert 1 <= sent["trainer.run_steps"] <= 3, sent
    out = capsys.readouterr().out
    assert ("x 2 tensor-parallel ranks, as the engines report" in out) == (tp == 2)
    model_dir = str(warm_start(cfg.model.embedded, build_task(cfg.task), cfg.warmstart, log=lambda _: None))

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["staleness_max"] for r in steps] == [0.0, 0.0, 0.0]  # η = 0 is strictly on-policy

    ref_metrics, ref_policy = synchronous_reference(cfg, model_dir)
    for got, want in zip(steps, ref_metrics, strict=True):
        for key in ("reward_mean", "response_tokens_mean", "samples"):
            assert got[key] == want[key], key  # the very same samples
        for key in ("loss", "grad_norm", "ratio_mean", "value_loss", "advantage_mean"):
            if key in want:
                assert got[key] == pytest.approx(want[key], **PIPELINE_METRIC_TOL), key

    final = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    ref_state = ref_policy.state_dict()
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert max((ref_state[k] - start[k]).abs().max().item() for k in start) > 20 * WEIGHT_ATOL  # it trained
    for name, tensor in final.state_dict().items():
        torch.testing.assert_close(tensor, ref_state[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
