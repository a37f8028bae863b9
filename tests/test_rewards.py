"""Rewards: plain functions (sync/async, per sample/batched), an HTTP scorer, a reward model on a mesh.

Whatever goes wrong — a raise, a timeout, a wrong answer shape, a server error — marks only the
samples concerned (None) and never raises; retries happen where they can help and only there.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time

import pytest
import ray.cloudpickle
import torch
from aiohttp import web

import tiny
from meshrl.envs import FunctionReward, HTTPReward, as_reward, batched_reward
from meshrl.mesh import Actor, endpoint, spawn_procs
from meshrl.tasks import AdditionTask, Problem, RewardOutput

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
torch.set_num_threads(1)
P = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(6)]
COMPLETIONS = ["1", "2", "x", "4", "5", "6"]


def exact(problem: Problem, completion: str) -> float:
    if completion == "x":
        raise ValueError("cannot score x")
    return float(completion == problem.answer)


async def exact_async(problem: Problem, completion: str) -> RewardOutput:
    await asyncio.sleep(0.01)
    if completion == "5":
        await asyncio.sleep(5)  # past the timeout
    return RewardOutput(reward=float(completion == problem.answer), info={"seen": 1.0})


def score(reward, problems=P, completions=COMPLETIONS):
    return asyncio.run(reward.score(problems, completions))


def test_function_rewards_sync_async_batched_with_failures_marked():
    out = score(as_reward(exact, timeout_s=5))
    assert [o.reward if o else None for o in out] == [1.0, 1.0, None, 1.0, 1.0, 1.0]

    t0 = time.monotonic()
    out = score(as_reward(exact_async, timeout_s=0.5))
    assert time.monotonic() - t0 < 3  # the slow call was cut off, the others ran concurrently
    assert [o.reward if o else None for o in out] == [1.0, 1.0, 0.0, 1.0, None, 1.0] and out[0].info == {"seen": 1.0}

    def slow_sync(problem, completion):
        if completion == "2":
            time.sleep(2.0)
        return {"reward": 0.5, "info": {"sync": 1}}

    t0 = time.monotonic()
    out = score(FunctionReward(slow_sync, timeout_s=0.3))
    assert time.monotonic() - t0 < 1.5  # the rest went on in a fresh thread
    assert [o.reward if o else None for o in out] == [0.5, None, 0.5, 0.5, 0.5, 0.5] and out[0].info == {"sync": 1.0}

    assert [o is None for o in score(as_reward(lambda p, c: "high", timeout_s=1))] == [True] * 6  # not a number

    @batched_reward
    def lengths(problems, completions):
        return [len(c) / 2 for c in completions]

    assert [o.reward for o in score(as_reward(lengths, timeout_s=1))] == [0.5] * 6

    async def short_batch(problems, completions):
        return [1.0]  # the wrong length: the whole batch is marked

    assert score(FunctionReward(short_batch, batched=True, timeout_s=1)) == [None] * 6
    task = AdditionTask(1, num_test=5)
    assert [o.info for o in score(as_reward(task, timeout_s=1))][:2] == [{"correct": 1.0}, {"correct": 1.0}]
    with pytest.raises(TypeError, match="reward must be"):
        as_reward(42, timeout_s=1)


@contextlib.asynccontextmanager
async def scorer_server():
    """A scorer service: /score (per sample), /flaky (503 twice per item), /slow, /bad, /batch."""
    seen: dict[str, int] = {}

    async def per_sample(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"reward": float(body["completion"] == body["answer"]), "info": {"remote": 1.0}})

    async def flaky(request: web.Request) -> web.Response:
        body = await request.json()
        key = body["completion"]
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= 2:
            return web.Response(status=503, text="busy")
        return web.json_response(1.0)

    async def slow(request: web.Request) -> web.Response:
        seen["slow"] = seen.get("slow", 0) + 1
        await asyncio.sleep(2)
        return web.json_response(1.0)

    async def bad(request: web.Request) -> web.Response:
        seen["bad"] = seen.get("bad", 0) + 1
        return web.Response(status=422, text="bad input")

    async def batch(request: web.Request) -> web.Response:
        items = (await request.json())["items"]
        return web.json_response({"rewards": [len(x["completion"]) for x in items]})

    app = web.Application()
    for path, handler in (("/score", per_sample), ("/flaky", flaky), ("/slow", slow), ("/bad", bad), ("/batch", batch)):
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen
    finally:
        await runner.cleanup()


def test_http_scorer_retries_what_can_succeed_and_marks_the_rest():
    async def main():
        async with scorer_server() as (url, seen):
            ok = await HTTPReward(f"{url}/score").score(P, COMPLETIONS)
            flaky = await HTTPReward(f"{url}/flaky", retries=2, backoff_s=0.01).score(P[:2], ["a", "b"])
            too_flaky = await HTTPReward(f"{url}/flaky", retries=0, backoff_s=0.01).score(P[:1], ["c"])
            t0 = time.monotonic()
            slow = await HTTPReward(f"{url}/slow", timeout_s=0.2, retries=1, backoff_s=0.01).score(P[:2], ["a", "b"])
            slow_s = time.monotonic() - t0
            bad = await HTTPReward(f"{url}/bad", retries=3).score(P[:1], ["a"])
            batch = await HTTPReward(f"{url}/batch", batch_size=4).score(P, COMPLETIONS)
            down = await HTTPReward("http://127.0.0.1:9/score", retries=1, backoff_s=0.01, timeout_s=1).score(P[:1], ["a"])
            return ok, flaky, too_flaky, slow, slow_s, bad, batch, down, dict(seen)

    ok, flaky, too_flaky, slow, slow_s, bad, batch, down, seen = asyncio.run(main())
    assert [o.reward for o in ok] == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0] and ok[0].info == {"remote": 1.0}
    assert [o.reward for o in flaky] == [1.0, 1.0] and seen["a"] == seen["b"] == 3  # two 503s, then an answer
    assert too_flaky == [None] and seen["c"] == 1
    assert slow == [None, None] and seen["slow"] == 4 and slow_s < 1.5  # 2 items x 2 attempts, each cut at 0.2 s
    assert bad == [None] and seen["bad"] == 1  # a 4xx other than 429 is not retried
    assert [o.reward for o in batch] == [1.0] * 6
    assert down == [None]
    with pytest.raises(ValueError, match="http://"):
        HTTPReward("127.0.0.1:8000/score")


class Judge(Actor):
    """A user's scorer actor: rewards the completion's length; refuses completions with an x."""

    @endpoint
    def score(self, problems: list[Problem], completions: list[str]) -> list[float]:
        if any("x" in c for c in completions):
            raise ValueError("the judge refuses x")
        return [float(len(c)) for c in completions]


def _spawn(name, cls, *args, procs=1, **kwargs):
    mesh = spawn_procs({"procs": procs}, cpus_per_proc=0.01, name=name)
    _spawned.append(mesh)
    return mesh.spawn(name, cls, *args, **kwargs)


_spawned: list = []


@pytest.mark.slow
def test_reward_model_and_scorer_actors_on_a_mesh(ray_cluster, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from meshrl.envs import MeshReward, RewardModel

    tok = tiny.char_tokenizer()
    torch.manual_seed(0)
    cfg = tiny.qwen2(vocab_size=len(tok), layers=1, positions=32768, tied=False,  # Qwen2Config's defaults
                     num_labels=1, pad_token_id=tok.pad_token_id)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    texts = ["12", "2", "a longer completion", "4", "5", "6"]

    async def main():
        rm = RewardModel(str(tmp_path / "rm"), batch_size=4, tokens_per_batch=32)  # chunks of 4, batches of <= 32 tokens
        await rm.start(_spawn)
        judge = MeshReward(Judge, num_workers=1, batch_size=3)
        await judge.start(_spawn)
        return await rm.score(P, texts), await judge.score(P, ["ab", "x", "abc", "a", "b", "c"])

    try:
        scores, judged = asyncio.run(main())
    finally:
        for mesh in _spawned:
            mesh.stop()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    with torch.no_grad():
        want = [model(input_ids=torch.tensor([hf_tok.encode(p.prompt + t)])).logits[0, 0].item() for p, t in zip(P, texts)]
    assert [o.reward for o in scores] == pytest.approx(want, abs=1e-5)  # padded batches score like single rows
    assert len(set(round(x, 6) for x in want)) == len(want)
    assert judged == [None, None, None, RewardOutput(1.0), RewardOutput(1.0), RewardOutput(1.0)]  # the refused chunk only


class _BareTask:
    """The least a task needs (README): ``split`` and ``reward``; no ``name``, a plain float reward."""

    def __init__(self):
        self._inner = AdditionTask()

    def split(self, name):
        return self._inner.split(name)

    def reward(self, problem, text):
        return float(text.strip() == problem.answer)


def test_a_bare_task_with_float_rewards_is_enough():
    from meshrl.actors.reward import call_reward
    from meshrl.embedded import EmbeddedModelConfig, WarmStartConfig
    from meshrl.embedded.warmstart import _cache_key

    task = _BareTask()
    p = task.split("test")[0]
    assert call_reward(task, p, p.answer) == (RewardOutput(reward=1.0), False)
    assert call_reward(task, p, "nope") == (RewardOutput(reward=0.0), False)
    assert len(_cache_key(EmbeddedModelConfig(), task, WarmStartConfig(), 20)) == 16  # no `name` needed


def test_non_finite_rewards_are_marked_and_numpy_or_torch_scalars_are_numbers():
    """NaN or inf in a group's rewards would turn all its advantages (and the step) into NaN: the
    sample is marked instead. numpy and 0-d torch scalars are numbers like any other."""
    import numpy as np

    from fractions import Fraction

    values = [float("nan"), float("inf"), np.float32(0.5), np.int64(1), torch.tensor(0.25),
              RewardOutput(reward=1.0, info={"x": float("nan")}), {"reward": float("-inf")}, True,
              10**400, Fraction(10**400, 3)]  # too large for a float: marked, never the whole job

    def by_index(problem: Problem, completion: str):
        return values[problem.id]

    problems = [Problem(id=i, prompt="", answer="") for i in range(len(values))]
    out = asyncio.run(as_reward(by_index, timeout_s=5).score(problems, [""] * len(values)))
    assert [o.reward if o else None for o in out] == [None, None, 0.5, 1.0, 0.25, None, None, 1.0, None, None]
    assert all(type(o.reward) is float for o in out if o)

    @batched_reward
    def nan_in_batch(problems, completions):
        return [1.0, float("nan")]

    assert score(nan_in_batch, problems[:2], ["", ""]) == [None, None]  # a batch fails as a whole

    class NanTask:
        name = "nan"

        def split(self, name):
            return []

        def reward(self, problem, completion):
            return float("nan")

    from meshrl.actors.reward import call_reward

    assert call_reward(NanTask(), problems[0], "") == (RewardOutput(reward=0.0), True)


def test_an_async_function_behind_a_plain_wrapper_is_awaited():
    """A functools.wraps decorator or a lambda hides an async def from iscoroutinefunction: its
    coroutines were never awaited and every sample was marked failed."""
    import functools

    async def exact(problem: Problem, completion: str) -> float:
        await asyncio.sleep(0)
        return float(completion == problem.answer)

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            return fn(*args)
        return wrapper

    async def exact_batch(problems, completions):
        return [float(c == p.answer) for p, c in zip(problems, completions)]

    problems = [Problem(id=i, prompt="", answer=str(i)) for i in range(3)]
    completions = ["0", "x", "2"]
    for fn in (logged(exact), lambda p, c: exact(p, c)):
        assert [o.reward for o in asyncio.run(as_reward(fn, timeout_s=5).score(problems, completions))] == [1.0, 0.0, 1.0]
    batched = batched_reward(lambda ps, cs: exact_batch(ps, cs))
    assert [o.reward for o in score(batched, problems, completions)] == [1.0, 0.0, 1.0]


class _UserReward:
    """A user's own Reward (an object with async ``score``), misbehaving as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def score(self, problems, completions):
        if self.mode == "raises":
            raise RuntimeError("the scorer is down")
        if self.mode == "hangs":
            await asyncio.sleep(3600)
        if self.mode == "short":
            return [1.0]
        return [1.0, float("nan"), {"reward": 0.5, "info": {"len": 3}}, "oops"]  # "mixed"


@pytest.mark.parametrize("mode", ["raises", "hangs", "short", "mixed"])
def test_a_users_own_reward_that_fails_marks_its_samples_and_never_ends_the_run(mode):
    """DESIGN: a reward that raises marks the sample, never kills the run; that holds for a user's
    own ``Reward`` object too (the library's own rewards bound and mark each call themselves)."""
    from meshrl.actors.reward import RolloutJob, score_job_with
    from meshrl.embedded.tokenizer import build_char_tokenizer
    from meshrl.engines.types import Completion, GenerateResult
    from meshrl.queues import decode_samples

    tok = build_char_tokenizer()
    ids = tok.encode("12", add_special_tokens=False)
    comp = Completion(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="length", versions=[3] * len(ids))
    job = RolloutJob(problems=[Problem(id=0, prompt="5+7=", answer="12"), Problem(id=1, prompt="1+1=", answer="2")],
                     prompt_ids=[[1, 2], [3, 4]], group_ids=[0, 1],
                     results=[GenerateResult(request_id=str(i), prompt_tokens=2, completions=[comp, comp]) for i in range(2)])
    start = time.monotonic()
    scored = asyncio.run(score_job_with(as_reward(_UserReward(mode), timeout_s=0.5), tok, job, timeout_s=0.5))
    assert time.monotonic() - start < 10
    samples = decode_samples(scored.encoded)
    assert len(samples) == 4
    if mode == "mixed":
        assert scored.rewards == [1.0, 0.0, 0.5, 0.0] and scored.failures == 2  # NaN and "oops" are marked
    else:
        assert scored.failures == 4 and scored.rewards == [0.0] * 4


def test_sync_per_sample_rewards_are_scored_concurrently_and_within_the_callers_time(caplog):
    """A sync reward scored one sample after another made a job cost the sum of its samples (each
    within reward.timeout_s), past the rollout loop's run.step_timeout_s: the run ended. Now sync
    samples overlap on threads of their own, and a caller's ``within_s`` bounds the whole job:
    what is not scored by then is marked, what is scored is kept, and the warning names the reward."""
    from meshrl.actors.reward import RolloutJob, score_job_with, scoring_time_s
    from meshrl.embedded.tokenizer import build_char_tokenizer
    from meshrl.engines.types import Completion, GenerateResult

    problems = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(16)]
    release = threading.Event()

    def judge(problem: Problem, completion: str) -> float:  # e.g. a blocking HTTP call to a judge model
        time.sleep(0.25)
        return 1.0

    def hangs_sometimes(problem: Problem, completion: str) -> float:
        if problem.id % 4 == 0:
            release.wait()
        return 1.0

    try:
        t0 = time.monotonic()
        out = score(as_reward(judge, timeout_s=60), problems, ["x"] * 16)
        assert time.monotonic() - t0 < 1.5 and all(o.reward == 1.0 for o in out)  # one after another: 4 s
        t0 = time.monotonic()
        out = score(as_reward(hangs_sometimes, timeout_s=0.5), problems, ["x"] * 16)
        assert time.monotonic() - t0 < 1.5  # the hung calls were abandoned together: not 4 x 0.5 s
        assert [o is None for o in out] == [i % 4 == 0 for i in range(16)]

        one_at_a_time = FunctionReward(judge, timeout_s=60, threads=1)
        t0 = time.monotonic()
        out = asyncio.run(one_at_a_time.score(problems[:8], ["x"] * 8, within_s=0.6))
        assert time.monotonic() - t0 < 1.2
        assert [o is not None for o in out] == [True, True] + [False] * 6  # kept what it scored in time
        assert "FunctionReward" in caplog.text and "judge" in caplog.text and "6 of 8 samples not scored" in caplog.text

        # a job: the reward worker's call, bounded so it answers within its caller's timeout
        tok = build_char_tokenizer()
        ids = tok.encode("12", add_special_tokens=False)
        comp = Completion(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="length", versions=[0] * len(ids))
        job = RolloutJob(problems=problems[:8], prompt_ids=[[1, 2]] * 8, group_ids=list(range(8)),
                         results=[GenerateResult(request_id=str(i), prompt_tokens=2, completions=[comp]) for i in range(8)])
        for reward in (one_at_a_time, as_reward(hangs_sometimes, timeout_s=60), _UserReward("hangs")):
            t0 = time.monotonic()
            scored = asyncio.run(score_job_with(reward, tok, job, timeout_s=60, within_s=1.0))
            assert time.monotonic() - t0 < 1.0, reward  # the caller would have given up
            assert 0 < scored.failures < 8 or isinstance(reward, _UserReward) and scored.failures == 8
        assert scoring_time_s(600) == 570 and scoring_time_s(20) == 18
    finally:
        release.set()


def test_a_fast_sync_reward_goes_to_its_threads_in_chunks_and_keeps_per_sample_outcomes():
    """A thread hop per sample cost 440 times an exact match's own work: once its calls are timed,
    a fast function's samples go in chunks (here 256 samples in 8 hops, one per thread), each sample
    still its own outcome (a raise marks that sample alone); a chunk past its time keeps what it
    scored and marks the rest."""
    problems = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(256)]
    threads_seen: set[int] = set()
    release = threading.Event()

    def exact(problem: Problem, completion: str) -> float:
        threads_seen.add(threading.get_ident())
        if problem.id == 7:
            raise ValueError("no")
        return float(completion == problem.answer)

    reward = FunctionReward(exact, timeout_s=60)
    comps = [p.answer if p.id % 2 else "?" for p in problems]
    first = score(reward, problems[:4], comps[:4])  # one sample a hop: the calls get timed
    assert reward._chunk_size(256) == 32  # 2 ms of these calls is far more than an equal share of 8 threads
    hops = []
    real_call = reward._call

    async def counted(*args, **kwargs):
        hops.append(len(args[0]) if kwargs.get("run") else 1)
        return await real_call(*args, **kwargs)

    reward._call = counted
    out = score(reward, problems, comps)
    assert hops == [32] * 8 and len(threads_seen) <= 8
    assert [o is None for o in out] == [p.id == 7 for p in problems]  # the raise marked its own sample only
    assert [o.reward for o in out if o is not None] == [float(p.id % 2) for p in problems if p.id != 7]
    assert [o.reward for o in first] == [0.0, 1.0, 0.0, 1.0]

    def hangs_at_5(problem: Problem, completion: str) -> float:
        if problem.id == 5 and not release.is_set():
            release.wait()
        return 1.0

    try:
        slow = FunctionReward(hangs_at_5, timeout_s=0.05, threads=2)
        score(slow, problems[8:12], ["x"] * 4)  # timed
        out = score(slow, problems[:16], ["x"] * 16)  # chunks of 8: samples 0-4 scored, 5-7 past the chunk's time
        assert [o is None for o in out] == [5 <= i < 8 for i in range(16)]
    finally:
        release.set()


def test_a_quick_reward_is_scored_on_the_event_loop_and_the_built_in_tasks_are_quick():
    """``inline=True`` (a task's ``quick_reward``): every sample on the caller's loop thread, no
    thread hop, each its own outcome; refused for a batched or an async function; the built-in
    tasks' rewards are built inline, a user's task only when it says so."""
    loop_threads: list[int] = []
    scored_on: set[int] = set()

    def exact(problem: Problem, completion: str) -> float:
        scored_on.add(threading.get_ident())
        if problem.id == 2:
            raise ValueError("no")
        return float(completion == problem.answer)

    async def run(reward, problems, comps):
        loop_threads.append(threading.get_ident())
        return await reward.score(problems, comps)

    problems = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(5)]
    reward = FunctionReward(exact, timeout_s=60, inline=True)
    out = asyncio.run(run(reward, problems, ["1", "?", "3", "4", "?"]))
    assert scored_on == set(loop_threads) and reward._idle == []  # the loop's thread; no thread was started
    assert [None if o is None else o.reward for o in out] == [1.0, 0.0, None, 1.0, 0.0]  # the raise marked its own

    async def judge(problem, completion):
        return 1.0

    for fn, kw in ((judge, {}), (lambda ps, cs: [1.0] * len(cs), {"batched": True})):
        with pytest.raises(ValueError, match="inline=True is for a sync per-sample function"):
            FunctionReward(fn, inline=True, **kw)
    assert as_reward(AdditionTask(1, num_train=10, num_test=5), timeout_s=5).inline

    class MyTask:
        name = "mine"

        def split(self, name):
            return [Problem(0, "1+1=", "2")]

        def reward(self, problem, completion):
            return float(completion == problem.answer)

    assert not as_reward(MyTask(), timeout_s=5).inline  # a user's reward may block: it goes to threads
    MyTask.quick_reward = True
    assert as_reward(MyTask(), timeout_s=5).inline


def test_a_task_with_a_score_helper_is_scored_by_its_reward():
    """A Task is recognised as a Task before a Reward (any object with a ``score`` attribute passes
    the runtime-checkable protocol): its ``reward`` scores, not its ``score`` helper."""

    class MyTask:
        name = "mine"

        def split(self, name):
            return [Problem(0, "1+1=", "2")]

        def score(self, problem, completion):  # a helper the reward uses
            return float(completion.strip() == problem.answer)

        def reward(self, problem, completion):
            return self.score(problem, completion)

    reward = as_reward(MyTask(), timeout_s=5)
    assert isinstance(reward, FunctionReward)
    assert [o.reward for o in score(reward, [Problem(0, "1+1=", "2")] * 2, ["2", "3"])] == [1.0, 0.0]
    assert as_reward(_UserReward("mixed"), timeout_s=5).__class__ is _UserReward  # a Reward that is no Task


@pytest.mark.slow
def test_a_mesh_reward_serves_a_second_run(ray_cluster):
    """The pipeline stops the meshes of a run, the reward's included; the same MeshReward object
    passed to the next run (a resume in the same program) spawns a fresh mesh instead of calling
    the dead one."""
    from meshrl.envs import MeshReward

    judge = MeshReward(Judge, num_workers=1, timeout_s=30)

    async def run() -> list:
        procs: list = []

        def spawn(name, cls, *args, procs_n=1, **kwargs):  # the pipeline's _spawn, as it stops them
            mesh = spawn_procs({"procs": kwargs.pop("procs", 1)}, cpus_per_proc=0.01, name=name)
            procs.append(mesh)
            return mesh.spawn(name, cls, *args, **kwargs)

        try:
            await judge.start(spawn)
            return await judge.score(P[:1], ["abc"])
        finally:
            for mesh in procs:
                mesh.stop()

    first = asyncio.run(run())
    second = asyncio.run(run())
    assert first == second == [RewardOutput(3.0)]


def _slow_judge(problem: Problem, completion: str) -> float:
    time.sleep(0.5)
    return 1.0


@pytest.mark.slow
def test_a_reward_worker_answers_within_its_callers_timeout(ray_cluster, tmp_path):
    """What the rollout loop does: ``rewards.score.choose(job, within_s=t)`` bounded by ``t``. A
    slow sync reward (8 samples x 0.5 s, one at a time) marks what it has not scored by then; the
    call answers in time, so the run goes on."""
    from meshrl.actors.reward import RewardWorker, RolloutJob
    from meshrl.embedded.tokenizer import build_char_tokenizer
    from meshrl.engines.types import Completion, GenerateResult

    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    ids = tok.encode("12", add_special_tokens=False)
    comp = Completion(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="length", versions=[0] * len(ids))
    job = RolloutJob(problems=P[:4], prompt_ids=[[1, 2]] * 4, group_ids=list(range(4)),
                     results=[GenerateResult(request_id=str(i), prompt_tokens=2, completions=[comp, comp]) for i in range(4)])
    procs = spawn_procs({"procs": 1}, cpus_per_proc=0.01, name="reward-within")
    try:
        workers = procs.spawn("reward-within", RewardWorker, FunctionReward(_slow_judge, threads=1), str(tmp_path / "tok"), 60.0)
        asyncio.run(workers.ready().within(60))
        t0 = time.monotonic()
        scored = asyncio.run(workers.score.choose(job, within_s=2.5).within(2.5))
        assert time.monotonic() - t0 < 2.5 and 0 < scored.failures < 8 and scored.rewards.count(1.0) == 8 - scored.failures
    finally:
        procs.stop()


def test_a_reward_failing_on_every_job_says_so_in_one_line_now_and_then(caplog, monkeypatch):
    """A batched reward answering with the wrong number of scores printed 34 tracebacks (215 lines)
    in 3 steps. Now: one line naming the counts, no traceback; the same failure again within
    WARN_EVERY_S is counted into the next line. An exception the function raises keeps its
    traceback, on its first line only."""
    import logging

    from meshrl.envs import rewards

    monkeypatch.setattr(rewards, "_warned", {})

    async def short_batch(problems, completions):
        return [1.0]

    reward = FunctionReward(short_batch, batched=True, timeout_s=1)
    with caplog.at_level(logging.WARNING, logger="meshrl.envs.rewards"):
        for _ in range(5):
            assert score(reward) == [None] * 6
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"{reward!r}: returned 1 scores for 6 completions (one each expected): the 6 samples are marked "
                     "reward_failed, reward 0"]
    monkeypatch.setattr(rewards, "WARN_EVERY_S", 0.0)  # the window passed: the next line counts what it held back
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshrl.envs.rewards"):
        score(reward)
    assert [r.getMessage() for r in caplog.records] == [lines[0] + " (4 more like it in the last 0s)"]

    def broken(problem, completion):
        raise KeyError("answer")

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshrl.envs.rewards"):
        score(FunctionReward(broken, threads=1, timeout_s=1))
        score(FunctionReward(broken, threads=1, timeout_s=1))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("FunctionReward('test_a_reward_failing_on_every_job_says_so_in_one_line_now_and_then"
                                  ".<locals>.broken', batched=False) failed: KeyError: 'answer'\nTraceback")
    assert all("Traceback" not in m and m.count("\n") == 0 for m in messages[1:])
