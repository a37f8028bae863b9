"""``trainer.compile=true`` on the CPU: the same steps as eager, and a clear refusal without a C++ compiler.

The steps are compared with ``trainer.compile_backend=aot_eager``: dynamo traces the shared-prompt
passes (``meshrl.shared_prompts``: the prompts', then the rows' through the prompts' keys and
values, as one graph), the decoder layers (for rows that share no prompt) and the head's log-prob
math into the same graphs as inductor would get, and runs them with eager ops. Inductor's
C++ kernels on top would cost the suite 35-50 s of g++ on two cores; they were compared by hand the
same way (float32, SGD, two steps: loss, gradient norm and entropy within 1.2e-7 relative, weights within 4e-9;
bench/RESULTS.md) and train the laptop bench (``python bench/laptop_grpo.py ... trainer.compile=true``).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters

from meshrl import modeling, shared_prompts
from meshrl.actors import AlgoConfig, TrainerConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import PolicyTrainer
from meshrl.queues import Sample

ALGO = AlgoConfig(advantage="grpo", samples_per_prompt=4)
STEPS = 2


def _batch(step: int) -> list[Sample]:
    """16 samples in groups of 4 of one prompt each (so rows of a prompt share it), prompts and
    responses of varied lengths."""
    rng, out = random.Random(step), []
    for i in range(16):
        response = [rng.randrange(4, 20) for _ in range(rng.randrange(1, 5))]
        prompt = [3] + [(7 * (i // 4) + j) % 16 + 4 for j in range(3 + i // 4)]
        out.append(Sample(prompt_id=i // 4, group_id=step * 100 + i // 4, group_size=4, prompt_ids=prompt,
                          response_ids=response, behavior_logprobs=[-rng.uniform(0.1, 3.0) for _ in response],
                          behavior_version=0, reward=float(rng.random() < 0.5)))
    return out


def _trainer(model_dir: str, compile: bool, backend: str = "aot_eager") -> PolicyTrainer:
    # SGD: a weight moves by lr x its gradient (AdamW's first steps move it by about lr whatever the
    # gradient's size, so a gradient near 0 rounded otherwise would move it by a different sign)
    cfg = TrainerConfig(compile=compile, compile_backend=backend, optimizer="sgd", lr=0.1)
    return PolicyTrainer(model_dir, cfg, ALGO, dp=DataParallel(None), temperature=1.0, max_new_tokens=4, total_steps=10)


@pytest.mark.slow
def test_compiled_cpu_steps_equal_eager_ones(tiny_model, monkeypatch):
    # compile_head and compile_passes swap the head's math and the shared-prompt passes for the rest
    # of the process: put them back after this test
    monkeypatch.setattr(modeling._Math, "forward", modeling._Math.forward)
    monkeypatch.setattr(modeling._Math, "backward", modeling._Math.backward)
    monkeypatch.setattr(shared_prompts._Passes, "forward", shared_prompts._Passes.forward)
    torch.set_num_threads(1)
    counters.clear()
    eager = _trainer(tiny_model, False)  # all its steps first: compile_head is for the rest of the process
    wants = [eager.train_step(_batch(step), 0) for step in range(STEPS)]
    assert not counters["stats"]["unique_graphs"]  # nothing compiled yet
    compiled = _trainer(tiny_model, True)
    assert compiled.updater.share_prompts  # the CPU default: the prompt's cache serves its rows
    assert shared_prompts.fits(compiled.policy, compiled.policy.get_decoder())  # both passes as one graph
    for step, want in enumerate(wants):
        got = compiled.train_step(_batch(step), 0)
        for key in ("loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
    assert counters["stats"]["unique_graphs"] >= 2  # the decoder layer's and the head's, at least
    trained = compiled.policy.state_dict()
    for name, tensor in eager.policy.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    initial = _trainer(tiny_model, False).policy.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # the steps moved the weights


def test_compile_on_a_cpu_without_a_cpp_compiler_is_refused_at_start(tiny_model, monkeypatch):
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/bin/g++",))
    with pytest.raises(RuntimeError, match=r"trainer.compile=true on the CPU needs a C\+\+ compiler"):
        _trainer(tiny_model, True, "inductor")
    monkeypatch.setattr(modeling._Math, "forward", modeling._Math.forward)  # compile_head, as above
    monkeypatch.setattr(modeling._Math, "backward", modeling._Math.backward)
    monkeypatch.setattr(shared_prompts._Passes, "forward", shared_prompts._Passes.forward)
    assert _trainer(tiny_model, True, "aot_eager").cfg.compile  # builds no kernel: needs no compiler
