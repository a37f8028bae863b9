"""The warm start trains, writes an HF checkpoint that loads with the Auto classes, and is cached."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.embedded import EmbeddedModelConfig, WarmStartConfig, warm_start
from meshrl.modeling import pack, response_logprobs
from meshrl.tasks import AdditionTask

TINY = EmbeddedModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=64, max_position_embeddings=32)


def test_warm_start_lowers_the_loss_saves_and_reuses(tmp_path, capfd):
    task = AdditionTask(digits=1, num_test=10)
    cfg = WarmStartConfig(max_steps=30, target_accuracy=None, check_every=30, batch_size=32, lr=3e-3, cache_dir=str(tmp_path))
    lines: list[str] = []
    path = warm_start(TINY, task, cfg, log=lines.append)
    assert "Writing model shards" not in capfd.readouterr().err  # transformers' bar would cut into the run's lines
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) < 100_000

    # The warm-started model predicts answers better than a fresh one with the same shape.
    problems = task.split("train")[:64]
    packed = pack([tok.encode(p.prompt) for p in problems], [tok.encode(p.answer) + [tok.eos_token_id] for p in problems],
                  pad_id=tok.pad_token_id)
    fresh = AutoModelForCausalLM.from_config(model.config)

    def nll(m):
        with torch.no_grad():
            logp = response_logprobs(m(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits, packed)
        return float(-(logp.sum() / packed.response_mask.sum()))

    assert nll(model) < nll(fresh) - 0.5

    again: list[str] = []
    assert warm_start(TINY, task, cfg, log=again.append) == path
    assert again == [f"warm start: reusing {path}"]  # no training the second time

    # a damaged entry (a copy cut short, a full disk) is found by its manifest and trained again: it was
    # a safetensors error in every worker, and a restart loop
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    rebuilt: list[str] = []
    assert warm_start(TINY, task, cfg, log=rebuilt.append) == path
    assert rebuilt[0] == (f"warm start: the cached {path} is damaged ({weights} is {size // 2:,} bytes, {size:,} when "
                          "it was written): training it again")
    assert rebuilt[-1].startswith("warm start: 30 steps in ")
    AutoModelForCausalLM.from_pretrained(path)
    # an entry written before manifests: its safetensors headers must cover the files
    (path / "manifest.json").unlink()
    weights.write_bytes(weights.read_bytes()[:-10])
    rebuilt.clear()
    warm_start(TINY, task, cfg, log=rebuilt.append)
    assert rebuilt[0].startswith(f"warm start: the cached {path} is damaged ({weights}: ") and "training it again" in rebuilt[0]
    assert (path / "manifest.json").is_file()
    other = warm_start(TINY, task, WarmStartConfig(max_steps=2, target_accuracy=None, cache_dir=str(tmp_path)), log=lambda _: None)
    assert other != path  # a different recipe is a different cache entry


def test_two_runs_warm_starting_the_same_entry_at_once_both_get_it(tmp_path):
    """Two pipelines of one program warm-start the same entry side by side. Both wrote the same
    temporary folder (named by the process id alone) and renamed it into place: one deleted what the
    other was writing. Here both reach the save together (a barrier in their log)."""
    import threading

    task = AdditionTask(digits=1, num_test=10)
    cfg = WarmStartConfig(max_steps=3, target_accuracy=None, check_every=3, batch_size=8, cache_dir=str(tmp_path))
    barrier = threading.Barrier(2, timeout=60)
    results: dict[int, object] = {}

    def log(line: str) -> None:
        if line.startswith("warm start: step 3"):  # the last step: both save from here
            barrier.wait()

    def one(i: int) -> None:
        try:
            results[i] = warm_start(TINY, task, cfg, log=log)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results[0] == results[1], results
    entries = sorted(p.name for p in (tmp_path / "warmstart").iterdir())
    assert entries == [results[0].name]  # one entry, no temporary folder left
    AutoModelForCausalLM.from_pretrained(results[0])
    AutoTokenizer.from_pretrained(results[0])


def test_the_cache_key_covers_every_training_answer(tmp_path):
    """Two files with the same prompts and corrected labels shared one key (only the first and last
    prompts were in it), so fixing the answers reused a model trained on the wrong ones."""
    import json

    from meshrl.embedded.warmstart import _cache_key
    from meshrl.tasks import FileTask

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    paths = []
    for name, fix in (("a", rows), ("b", [dict(r, answer="0") if i == 7 else r for i, r in enumerate(rows)])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in fix))
        paths.append(path)
    cfg = WarmStartConfig()
    keys = [_cache_key(TINY, FileTask(p, p), cfg, 40) for p in paths]
    assert keys[0] != keys[1]
    assert _cache_key(TINY, FileTask(paths[0], paths[0]), cfg, 40) == keys[0]  # and stable


def test_a_stopped_warm_start_ends_at_its_next_step_and_caches_nothing(tmp_path):
    import threading

    import pytest

    from meshrl.embedded import WarmStartStopped

    task = AdditionTask(digits=1, num_test=10)
    cfg = WarmStartConfig(max_steps=100_000, target_accuracy=None, check_every=2, batch_size=8, cache_dir=str(tmp_path))
    stop = threading.Event()
    lines: list[str] = []

    def log(line: str) -> None:  # stop once training is under way
        lines.append(line)
        stop.set()

    with pytest.raises(WarmStartStopped, match=r"stopped after 2 of at most 100000 steps; nothing was cached"):
        warm_start(TINY, task, cfg, log=log, stop=stop)
    assert lines == ["warm start: step 2  loss " + lines[0].split("loss ")[1]]
    assert not (tmp_path / "warmstart").exists()  # no entry, no temporary folder


def test_cancelling_the_pipeline_during_its_warm_start_ends_the_warm_start_thread(tmp_path):
    """A second Ctrl-C cancels run(); the warm start ran on in its thread, and asyncio.run's exit
    (which joins the default executor) waited for all of it: minutes on a CPU. Here the warm start
    would take over a minute (12,000 steps); cancelled, its thread must end within seconds."""
    import asyncio

    from meshrl.config import load_config
    from meshrl.pipeline import Pipeline, PipelineConfig

    cfg = load_config(PipelineConfig, None, [f"run.output_dir={tmp_path / 'run'}", f"warmstart.cache_dir={tmp_path}",
                                             "warmstart.max_steps=12000", "warmstart.target_accuracy=null",
                                             "warmstart.check_every=100000", "warmstart.batch_size=8",
                                             "model.embedded.hidden_size=32", "model.embedded.intermediate_size=64"])

    async def main() -> float:
        task = asyncio.ensure_future(Pipeline(cfg)._model_dir())
        await asyncio.sleep(1.0)  # the warm start is under way in its thread
        task.cancel()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await loop.shutdown_default_executor()  # what asyncio.run waits for at exit
        return loop.time() - t0

    assert asyncio.run(main()) < 20
    assert not (tmp_path / "warmstart").exists()  # nothing cached, no temporary folder left


def test_stopping_the_pipeline_during_its_warm_start_ends_it_at_its_next_step(tmp_path):
    """The first Ctrl-C or SIGTERM (Pipeline.stop) during a warm start waited for the whole warm start
    (a minute on a CPU, past a scheduler's grace period), then started every role, evaluated,
    checkpointed step 0 and exported. Now the warm start ends at its next step and the run with it,
    having started and written nothing (a fresh run may start there again)."""
    import asyncio

    import pytest

    from meshrl.config import load_config
    from meshrl.embedded import WarmStartStopped
    from meshrl.pipeline import Pipeline, PipelineConfig

    out = tmp_path / "run"
    cfg = load_config(PipelineConfig, None, [f"run.output_dir={out}", f"warmstart.cache_dir={tmp_path}",
                                             "warmstart.max_steps=12000", "warmstart.target_accuracy=null",
                                             "warmstart.check_every=100000", "warmstart.batch_size=8",
                                             "model.embedded.hidden_size=32", "model.embedded.intermediate_size=64"])

    async def main() -> tuple[object, float]:
        pipeline = Pipeline(cfg)
        run = asyncio.ensure_future(pipeline.run())
        await asyncio.sleep(1.5)  # the warm start is under way in its thread
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stopped = await pipeline.stop(timeout_s=60)
        with pytest.raises(WarmStartStopped, match="nothing was cached"):
            await run
        return stopped, loop.time() - t0

    stopped, took = asyncio.run(main())
    assert stopped is None and took < 20
    assert not (tmp_path / "warmstart").exists() and not (out / "checkpoints").exists()
    assert sorted(p.name for p in out.iterdir()) == [".meshrl.lock"]
    Pipeline(cfg)  # not refused: nothing of a run is there
