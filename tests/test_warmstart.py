"""The warm start trains, writes an HF checkpoint that loads with the Auto classes, and is cached."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.embedded import EmbeddedModelConfig, WarmStartConfig, warm_start
from meshrl.modeling import pack, response_logprobs
from meshrl.tasks import AdditionTask

TINY = EmbeddedModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=64, max_position_embeddings=32)


def test_warm_start_lowers_the_loss_saves_and_reuses(tmp_path):
    task = AdditionTask(digits=1, num_test=10)
    cfg = WarmStartConfig(max_steps=30, target_accuracy=None, check_every=30, batch_size=32, lr=3e-3, cache_dir=str(tmp_path))
    lines: list[str] = []
    path = warm_start(TINY, task, cfg, log=lines.append)
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
    other = warm_start(TINY, task, WarmStartConfig(max_steps=2, target_accuracy=None, cache_dir=str(tmp_path)), log=lambda _: None)
    assert other != path  # a different recipe is a different cache entry


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
