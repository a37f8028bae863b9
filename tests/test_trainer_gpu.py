"""The trainer on a CUDA device: a train step that runs out of memory says which settings lower it."""

from __future__ import annotations

import random

import pytest
import torch

from meshrl.actors import AlgoConfig, TrainerConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import PolicyTrainer
from meshrl.queues import Sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RESPONSE = 1024


def _long_samples(n: int) -> list[Sample]:
    rng = random.Random(0)
    return [Sample(prompt_id=i, group_id=i // 2, group_size=2, prompt_ids=[3, 5, 7],
                   response_ids=[rng.randrange(4, 90) for _ in range(RESPONSE)], behavior_logprobs=[-1.0] * RESPONSE,
                   behavior_version=0, reward=float(i % 2)) for i in range(n)]


def test_an_out_of_memory_step_names_what_it_held_and_the_settings_that_lower_it(tiny_model):
    device = torch.device("cuda", torch.cuda.current_device())
    trainer = PolicyTrainer(tiny_model, TrainerConfig(tokens_per_microbatch=64 * (RESPONSE + 3)),
                            AlgoConfig(advantage="grpo", samples_per_prompt=2), dp=DataParallel(None, device),
                            temperature=1.0, max_new_tokens=RESPONSE, total_steps=1)
    torch.cuda.synchronize(device)
    total = torch.cuda.get_device_properties(device).total_memory
    # the allocator may hold what it holds now and 16 MiB more: 64 rows of 1,027 tokens need far more
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + (16 << 20)) / total, device)
    try:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            trainer.train_step(_long_samples(64), 0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    message = str(caught.value)
    assert f"the train step ran out of memory on {device}" in message
    assert f"trainer.tokens_per_microbatch={64 * (RESPONSE + 3)}" in message
    assert f"rows of up to {RESPONSE + 3} tokens" in message
    assert "trainer.activation_checkpointing=true" in message and "colocated.overlap=false" in message
    assert "GiB held by torch of" in message and "torch said: CUDA out of memory" in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    torch.cuda.empty_cache()
    metrics = trainer.train_step(_long_samples(4), 0)  # the trainer goes on once memory allows
    assert metrics["grad_norm"] > 0
