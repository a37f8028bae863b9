"""placement=colocated: the trainer and a TorchEngine in one process, taking turns (meshrl.actors.hybrid).

Invariant: at max_staleness=0 with fixed seeds, a colocated run trains exactly like a
disaggregated one (same samples, losses, final weights). Also: one-step overlap (η = 1) with the
engine's weights released while training; colocated.overlap (generation through the step); the mode gate (a train step waits for the generate
calls in flight, generate calls wait for the hand-over); memory release/restore of the engine;
the configuration errors; and the GPU benchmark's CPU smoke run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tiny
from bounds import PIPELINE_METRIC_TOL, sgd_weight_atol
from meshrl.config import ConfigError, load_config
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.pipeline import Pipeline, PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "model.embedded.hidden_size=32", "model.embedded.num_hidden_layers=2", "model.embedded.intermediate_size=64",
    "model.embedded.num_attention_heads=2", "model.embedded.num_key_value_heads=1",
    "warmstart.max_steps=40", "warmstart.target_accuracy=null", "warmstart.batch_size=32", "warmstart.lr=3e-3",
    "task.digits=1", "task.num_test=16", "trainer.samples_per_step=16",
    "rollout.prompts_per_request=4", "rollout.requests_in_flight=2", "rollout.max_new_tokens=4",
    "run.total_steps=3", "run.eval_every=0", "run.progress=false", "trainer.lr=1e-3",
]
SGD = ["trainer.optimizer=sgd", "trainer.lr=0.1", "trainer.critic_lr=0.1"]  # the invariant's runs (bounds.py: why)


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[list[dict], Path]:
    cfg = load_config(PipelineConfig, None, [*OVERRIDES, f"warmstart.cache_dir={tmp_path / 'cache'}",
                                             f"run.output_dir={tmp_path / name}", *extra])
    summary = asyncio.run(Pipeline(cfg).run())
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step"], Path(summary["checkpoint"])


@pytest.mark.slow
def test_colocated_at_staleness_zero_equals_disaggregated(ray_cluster, tmp_path):
    # the colocated run scores in its hybrid workers (reward.num_workers=0), the other in a reward worker
    colocated, colocated_final = _run(tmp_path, "colocated", "queue.max_staleness=0", "placement=colocated",
                                      "reward.num_workers=0", *SGD)
    disaggregated, disaggregated_final = _run(tmp_path, "disaggregated", "queue.max_staleness=0", *SGD)
    assert [r["staleness_max"] for r in colocated] == [0.0, 0.0, 0.0]
    for got, want in zip(colocated, disaggregated, strict=True):
        for key in ("reward_mean", "response_tokens_mean", "samples", "version"):
            assert got[key] == want[key], key  # the very same samples
        for key in ("loss", "grad_norm", "ratio_mean"):
            assert got[key] == pytest.approx(want[key], **PIPELINE_METRIC_TOL), key
        assert got["colocated/switch_to_train_s"] >= 0 and got["colocated/graph_recaptures"] == 0
    assert all("colocated/switch_to_rollout_s" in r for r in colocated[1:])  # the previous cycle's hand-over
    ours = AutoModelForCausalLM.from_pretrained(colocated_final).state_dict()
    for name, tensor in AutoModelForCausalLM.from_pretrained(disaggregated_final).state_dict().items():
        # both runs batch their rows as they arrive: twice the bound against one exact reference
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=2 * sgd_weight_atol(steps=3, lr=0.1),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_colocated_one_step_overlap_with_released_weights_trains(ray_cluster, tmp_path):
    steps, final = _run(tmp_path, "overlap", "queue.max_staleness=1", "placement=colocated",
                        "colocated.release_weights=true", "run.total_steps=4",
                        "reward.num_workers=0")  # the hybrid workers score: one process fewer (not tested here)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["version"] for r in steps] == [1, 2, 3, 4]
    assert max(r["staleness_max"] for r in steps) <= 1
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in steps)
    base = AutoModelForCausalLM.from_pretrained(next((tmp_path / "cache" / "warmstart").iterdir())).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the policy moved


def _tiny_model_dir(path: Path) -> str:
    # Qwen2Config's default context (32768 positions), as this model always had
    config = tiny.qwen2(vocab_size=128, heads=2, kv_heads=1, positions=32768, pad_token_id=0)
    return tiny.model_dir(path, config=config)


def _requests(n: int, tokens: int, seed: int) -> list[GenerateRequest]:
    sp = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, seed=seed)
    return [GenerateRequest(input_ids=[3 + i, 5, 7], sampling=sp) for i in range(n)]


def test_engine_release_and_restore_memory_keeps_generation_identical(tmp_path):
    model_dir = _tiny_model_dir(tmp_path / "m")
    engine = TorchEngine.from_pretrained(model_dir, TorchEngineConfig(device="cpu", max_batch_size=4, max_seq_len=32,
                                                                       contiguous_weights=True))
    from meshrl.reshard.colocated import LocalHandover

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    handover = LocalHandover(hf.named_parameters, engine)
    before = asyncio.run(engine.generate(_requests(3, 6, seed=1)))
    engine.release_memory(weights=True)
    assert engine.memory_released and engine.weights_released
    assert engine.cache.kv.untyped_storage().nbytes() == 0 and engine.model.embed.untyped_storage().nbytes() == 0
    engine.restore_memory()
    handover.write(engine, 1)  # restored weights are undefined until a whole version is written
    after = asyncio.run(engine.generate(_requests(3, 6, seed=1)))
    assert engine.version == 1 and not engine.memory_released
    assert [c.output_ids for r in after for c in r.completions] == [c.output_ids for r in before for c in r.completions]
    for a, b in zip([c.logprobs for r in after for c in r.completions], [c.logprobs for r in before for c in r.completions]):
        assert a == pytest.approx(b, abs=1e-6)
    with pytest.raises(RuntimeError, match="contiguous_weights"):
        TorchEngine.from_pretrained(model_dir, TorchEngineConfig(device="cpu", max_batch_size=2, max_seq_len=16)
                                    ).release_memory(weights=True)


@contextlib.contextmanager
def _hybrid(tmp_path: Path, name: str, colocated, max_seq_len: int = 512, device: str = "cpu"):
    """One HybridWorker over the tiny model (on ``device``): its one-actor mesh and the model directory."""
    from meshrl.actors import AlgoConfig, TrainerConfig
    from meshrl.actors.hybrid import HybridWorker
    from meshrl.mesh import spawn_procs

    model_dir = _tiny_model_dir(tmp_path / "m")
    procs = spawn_procs({"procs": 1}, cpus_per_proc=0.01, gpus_per_proc=1 if device == "cuda" else None, name=name)
    try:
        w = procs.spawn("hybrid", HybridWorker, model_dir, TrainerConfig(samples_per_step=4, device=device),
                        AlgoConfig(samples_per_prompt=4), TorchEngineConfig(device=device, max_batch_size=8, max_seq_len=max_seq_len),
                        colocated, temperature=1.0, max_new_tokens=4, total_steps=10)
        yield w.slice(procs=0), model_dir
    finally:
        procs.stop()


async def _engine_batch(one, model_dir: str) -> bytes:
    """A training batch from the engine itself, scored by the arithmetic task."""
    from meshrl.actors.reward import RolloutJob, score_job
    from meshrl.tasks import Problem, TaskConfig, build_task

    task, tok = build_task(TaskConfig(digits=1, num_test=16)), AutoTokenizer.from_pretrained(model_dir)
    reqs = [GenerateRequest(input_ids=tok.encode("1+2="), sampling=SamplingParams(max_new_tokens=4, n=4, seed=3))]
    results = await one.generate.call_one(reqs).within(60)
    return score_job(task, tok, RolloutJob(problems=[Problem(id=0, prompt="1+2=", answer="3")],
                                           prompt_ids=[reqs[0].input_ids], results=results, group_ids=[0])).encoded


async def _long_generate_in_flight(one, tokens: int = 500) -> asyncio.Future:
    """A generate of ``tokens`` decode steps, returned once the worker counts it in flight."""
    long = asyncio.ensure_future(one.generate.call_one(_requests(2, tokens, seed=5)).within(60))
    for _ in range(3000):
        if (await one.colocated_state.call_one().within(30))["in_flight"] == 1:
            return long
        await asyncio.sleep(0.01)
    raise AssertionError("the long generate never showed up in flight")


def test_mode_gate_orders_generation_train_steps_and_the_hand_over(ray_cluster, tmp_path):
    from meshrl.actors.hybrid import ColocatedConfig

    with _hybrid(tmp_path, "hybrid_gate", ColocatedConfig(switch_timeout_s=60)) as (one, model_dir):

        async def scenario():
            batch = await _engine_batch(one, model_dir)
            # a long generate is in flight: the train step waits for it, then frees the KV cache
            long = await _long_generate_in_flight(one)  # the train step goes in as soon as it is seen
            assert not long.done()
            metrics = await one.train_step.call_one(batch, 0).within(60)
            assert long.done() and len((await long)[0].completions[0].output_ids) == 500
            state = await one.colocated_state.call_one().within(30)
            assert state["mode"] == "train" and state["kv_released"] and metrics["colocated/switch_to_train_s"] >= 0
            # a generate now waits for the hand-over, and then runs on the new version
            waiting = asyncio.ensure_future(one.generate.call_one(_requests(1, 3, seed=7)).within(60))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            stats = await one.reshard_receive.call_one(1).within(60)
            assert stats.version == 1 and stats.bytes > 0
            out = await waiting
            assert out[0].completions[0].versions == [1, 1, 1]
            state = await one.colocated_state.call_one().within(30)
            assert state["mode"] == "rollout" and not state["kv_released"] and state["switches"] == 1

        asyncio.run(scenario())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_overlap_generates_through_the_train_step_and_the_hand_over(ray_cluster, tmp_path, device):
    """colocated.overlap: no switch. A generate in flight keeps running while the step trains (nothing
    released, the gate open) and across the in-place hand-over, whose version its later tokens carry.
    On CUDA the step runs on the trainer's own stream beside the engine's decode loop."""
    from meshrl.actors.hybrid import ColocatedConfig

    # on CUDA the tiny model decodes 2,000 tokens within a step of 0.15 s (one H200): a far longer generate, and a
    # first step (allocator, cuBLAS) taken before it
    tokens = 500 if device == "cpu" else 30_000
    with _hybrid(tmp_path, f"hybrid_overlap_{device}", ColocatedConfig(switch_timeout_s=60, overlap=True),
                 max_seq_len=tokens + 16, device=device) as (one, model_dir):

        async def scenario():
            batch = await _engine_batch(one, model_dir)
            if device == "cuda":
                await one.train_step.call_one(batch, 0).within(60)
            long = await _long_generate_in_flight(one, tokens)
            t0 = time.perf_counter()
            metrics = await one.train_step.call_one(batch, 0).within(60)
            step_s = time.perf_counter() - t0
            state = await one.colocated_state.call_one().within(30)
            assert not long.done(), f"the train step ({step_s:.3f} s) waited for the generate in flight"
            assert state["mode"] == "rollout" and not state["kv_released"] and state["in_flight"] == 1
            assert "colocated/switch_to_train_s" not in metrics and metrics["samples"] == 4
            # a new generate is not held back either
            short = await one.generate.call_one(_requests(1, 3, seed=7)).within(60)
            assert short[0].completions[0].versions == [0, 0, 0]
            stats = await one.reshard_receive.call_one(1).within(60)
            assert stats.version == 1 and stats.bytes > 0
            versions = (await long)[0].completions[0].versions
            assert len(versions) == tokens and versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
            state = await one.colocated_state.call_one().within(30)
            assert state["switches"] == 0 and state["version"] == 1

        asyncio.run(scenario())


def test_a_failed_hand_over_keeps_generation_out_until_one_succeeds(ray_cluster, tmp_path):
    """The hand-over restores the engine's memory, then writes the weights: when the write fails, the
    engine holds restored-but-unwritten (released: zero) weights under the old version, so rollout
    calls must keep waiting, not generate from them (the gate used to reopen in a finally)."""
    from meshrl.actors.hybrid import ColocatedConfig

    with _hybrid(tmp_path, "hybrid_failed_handover", ColocatedConfig(switch_timeout_s=3, release_weights=True),
                 max_seq_len=64) as (one, model_dir):

        async def scenario():
            batch = await _engine_batch(one, model_dir)
            await one.train_step.call_one(batch, 0).within(60)
            with pytest.raises(ValueError, match="policy version must be an integer"):
                await one.reshard_receive.call_one("1").within(60)  # stands in for any failed write
            with pytest.raises(TimeoutError, match="colocated.switch_timeout_s"):
                await one.generate.call_one(_requests(1, 3, seed=7)).within(60)
            await one.reshard_receive.call_one(1).within(60)
            out = await one.generate.call_one(_requests(1, 3, seed=7)).within(60)
            assert out[0].completions[0].versions == [1, 1, 1]
            # in rollout mode a push writes in place with the gate open (a resume's, the run's last one):
            # a failed one must close it too (it stayed open, and generation went on from mixed weights)
            with pytest.raises(ValueError, match="policy version must be an integer"):
                await one.reshard_receive.call_one("2").within(60)
            with pytest.raises(TimeoutError, match="colocated.switch_timeout_s"):
                await one.generate.call_one(_requests(1, 3, seed=7)).within(60)
            await one.reshard_receive.call_one(2).within(60)
            out = await one.generate.call_one(_requests(1, 3, seed=7)).within(60)
            assert out[0].completions[0].versions == [2, 2, 2]

        asyncio.run(scenario())


@pytest.mark.parametrize("overrides, key", [
    (["placement=colocated", "rollout.num_workers=2"], "rollout.num_workers"),
    (["placement=colocated", "reshard.transport=object_store"], "reshard.transport"),
    (["placement=colocated", "trainer.device=cuda", "rollout.engine.device=cpu"], "rollout.engine.device"),
    (["placement=colocated", "colocated.release_weights=true", "trainer.sync_interval=2"], "colocated.release_weights"),
    (["colocated.release_weights=true"], "colocated.release_weights"),
    (["colocated.overlap=true"], "colocated.overlap"),
    (["placement=colocated", "colocated.overlap=true", "colocated.release_weights=true"], "colocated"),
])
def test_bad_colocated_configs_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"`{key}`"):
        load_config(PipelineConfig, None, overrides).validate()
    with pytest.raises(ValueError, match="placement"):
        load_config(PipelineConfig, None, ["placement=hybrid"])


def test_gpu_bench_runs_tiny_on_cpu(monkeypatch, capsys):
    """The bench's main() in this process (an interpreter of its own would only add its start-up)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_colocated

    gpu_colocated.main(["--tiny"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 and "False" in rows[0] and "True" in rows[1]


def test_gate_close_waits_for_a_call_that_passed_the_open_check_in_the_same_iteration():
    """A generate whose wait for the open gate completed just before close() cleared it must be
    counted and waited for (wait_for resumes its caller an iteration later: the old gate let it
    into the engine after close() returned, and the KV cache was released under it)."""
    from meshrl.actors.hybrid import _Gate

    async def scenario(iterations: int):
        gate, inside = _Gate(5.0), []

        async def call():
            async with gate.rollout("generate"):
                inside.append(1)
                await asyncio.sleep(0.05)
                inside.append(-1)

        task = asyncio.ensure_future(call())
        for _ in range(iterations):  # the call gets that far into its wait for the (open) gate
            await asyncio.sleep(0)
        await gate.close()
        assert sum(inside) == 0, f"a generate call is inside after close() returned ({iterations} iterations)"
        gate.open.set()
        await task
        assert inside and sum(inside) == 0

    for iterations in (0, 1, 2, 3):  # the old gate failed at 2
        asyncio.run(scenario(iterations))
