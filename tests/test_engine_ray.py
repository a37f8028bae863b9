"""TorchEngine inside a real async Ray actor: generate awaited concurrently with pause and weight updates.

This is how the rollout worker hosts the engine: one asyncio loop in the actor, several actor calls in
flight at once. The checks are the engine's own invariants seen from outside the actor.
"""

from __future__ import annotations

import asyncio
import math
import sys

import pytest
import ray.cloudpickle

from tiny import hf_model, qwen2

# Ray workers cannot import test modules: ship this module's classes, and tiny's functions, by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules["tiny"])


class EngineActor:
    """A minimal host: builds the engine in the actor and exposes its coroutines as actor methods."""

    def __init__(self):
        import torch

        from meshrl.engines import TorchEngine, TorchEngineConfig

        torch.set_num_threads(1)
        self.engine = TorchEngine.from_hf_model(hf_model(qwen2(vocab_size=48, positions=128, tied=False)),
                                                config=TorchEngineConfig(max_batch_size=4, max_seq_len=128))

    async def generate(self, prompts, max_new_tokens):
        from meshrl.engines import GenerateRequest, SamplingParams

        res = await self.engine.generate([GenerateRequest(input_ids=p, sampling=SamplingParams(
            max_new_tokens=max_new_tokens, temperature=1.0, seed=i)) for i, p in enumerate(prompts)])
        return [(c.logprobs, c.versions, c.finish_reason) for r in res for c in r.completions]

    async def steps(self):
        return self.engine.steps

    async def zero_head(self, version):
        import torch

        await self.engine.update_weights({"lm_head.weight": torch.zeros(48, 32)}, version)

    async def pause(self, mode):
        await self.engine.pause(mode)

    async def resume(self):
        await self.engine.resume()


@pytest.mark.slow
def test_engine_in_async_ray_actor(ray_cluster):
    ray = ray_cluster
    actor = ray.remote(num_cpus=0.5)(EngineActor).options(max_concurrency=8).remote()

    async def main():
        gen = actor.generate.remote([[1, 2, 3], [4, 5]], 100)
        async with asyncio.timeout(60):
            while await actor.steps.remote() < 5:
                await asyncio.sleep(0.01)
        await actor.pause.remote("keep")  # returns while generate is still awaited in the actor
        await actor.zero_head.remote(7)
        await actor.resume.remote()
        return await asyncio.wait_for(gen, 60)

    out = asyncio.run(main())
    uniform = -math.log(48)
    for logprobs, versions, reason in out:
        k = versions.index(7)
        assert reason == "length" and versions == [0] * k + [7] * (100 - k) and k >= 5
        # a zero LM head makes every token equally likely: exactly from the flip on, not before
        assert all(abs(lp - uniform) < 1e-5 for lp in logprobs[k:])
        assert not any(abs(lp - uniform) < 1e-5 for lp in logprobs[:k])
    ray.kill(actor)
