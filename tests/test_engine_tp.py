"""Tensor parallelism: the declared plan covers every HF tensor exactly once, and TP=2 (two real
processes, gloo) generates exactly what TP=1 does."""

from __future__ import annotations

import asyncio
import datetime
import os
import time

import pytest
import torch

import tiny
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.engines.layout import EngineLayout, ModelSpec
from meshrl.mesh.distributed import free_port
from processes import run_processes
from serving import start_server, wait_healthy

torch.set_num_threads(1)


def hf_model(arch: str = "qwen2"):
    config = tiny.qwen2 if arch == "qwen2" else tiny.qwen3
    return tiny.hf_model(config(vocab_size=64, hidden_size=64, positions=64), sharp=6.0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_plan_covers_each_hf_tensor_once(arch):
    hf = hf_model(arch)
    state = hf.state_dict()
    layout = EngineLayout(ModelSpec.from_hf_config(hf.config))
    tp = 2
    hits = {name: torch.zeros_like(t, dtype=torch.int32) for name, t in state.items() if not layout.is_skipped(name)}
    for pl in layout.params.values():
        for rank in range(tp):
            local = torch.full(pl.local_shape(tp), float("nan"))
            for hf_name, src, dst in pl.local_slices(rank, tp):
                local[dst] = state[hf_name][src]
                hits[hf_name][src] += 1
            assert not torch.isnan(local).any(), f"{pl.name} rank {rank} has unfilled entries"
            if pl.name.endswith("qkv.weight"):  # column-parallel fused: [q_r | k_r | v_r]
                q = state[pl.parts[0].hf_name]
                assert torch.equal(local[: q.shape[0] // tp], q[rank * q.shape[0] // tp: (rank + 1) * q.shape[0] // tp])
            if pl.shard_dim is None:
                assert pl.local_shape(tp) == pl.shape
    for name, h in hits.items():
        expected = 1 if layout.params[layout.hf_index[name][0]].shard_dim is not None else tp
        assert bool((h == expected).all()), name  # sharded: once over all ranks; replicated: once per rank


REQS = [GenerateRequest(input_ids=[5, 9, 17, 4], sampling=SamplingParams(max_new_tokens=10, temperature=0)),
        GenerateRequest(input_ids=[11, 3, 8], sampling=SamplingParams(max_new_tokens=7, temperature=0.9, n=3, seed=5)),
        GenerateRequest(input_ids=[2, 60, 33, 7, 7, 1], sampling=SamplingParams(max_new_tokens=9, temperature=1.0,
                                                                                top_p=0.7, seed=6))]


def _rank_main(rank: int, path: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshrl.engines.tp import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = TensorParallel.from_device_mesh(mesh, "tp")
    engine = TorchEngine.from_pretrained(path, TorchEngineConfig(max_batch_size=4, max_seq_len=32), tp=tp)
    assert engine.model.num_heads == 2 and engine.cache.num_kv_heads == 1  # half the heads per rank
    res = asyncio.run(engine.generate(REQS))
    torch.save([[(c.output_ids, c.logprobs) for c in r.completions] for r in res], os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_generates_what_tp1_generates(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "ckpt")
    run_processes(_rank_main, (str(tmp_path / "ckpt"), free_port(), str(tmp_path)), 2, timeout_s=120, what="TP ranks")
    ref = asyncio.run(TorchEngine.from_pretrained(str(tmp_path / "ckpt"), TorchEngineConfig(
        max_batch_size=4, max_seq_len=32)).generate(REQS))
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        for r, g in zip(ref, got):
            for c, (ids, lps) in zip(r.completions, g):
                assert ids == c.output_ids
                assert torch.allclose(torch.tensor(lps), torch.tensor(c.logprobs), atol=1e-5)


# ---- leader-driven TP: calls reach rank 0 only, at any time; the other ranks follow its schedule ----

def _req(rid: str, ids: list[int], new: int, **sp) -> GenerateRequest:
    return GenerateRequest(input_ids=ids, request_id=rid, sampling=SamplingParams(max_new_tokens=new, **sp))


LEAD = {"a": _req("a", [5, 9, 17, 4], 20, temperature=0),
        "b": _req("b", [11, 3, 8], 12, temperature=0.9, n=2, seed=5),
        "c": _req("c", [2, 60, 33], 25, temperature=1.0, seed=7),
        "d": _req("d", [7, 7, 1, 30, 2], 20, temperature=0.8, top_p=0.9, seed=8),
        "e": _req("e", [5, 9, 17, 4], 12, temperature=0.7, seed=9),
        "f": _req("f", [5, 9, 17, 4], 12, temperature=0.7, seed=9)}


def _version_state(path: str, version: int) -> dict[str, torch.Tensor]:
    """Weights of policy version 1 and 2: the checkpoint's, with every matrix scaled."""
    from safetensors.torch import load_file
    state = load_file(os.path.join(path, "model.safetensors"))
    return {k: v * (1.0 + 0.1 * version) if v.dim() == 2 else v for k, v in state.items()}


async def _wait_steps(engine: TorchEngine, n: int) -> None:
    deadline = time.monotonic() + 30
    while engine.steps < n:
        assert time.monotonic() < deadline, f"engine did not reach {n} steps (at {engine.steps})"
        await asyncio.sleep(0.001)


async def _lead(engine: TorchEngine, path: str) -> dict:
    await engine.start()
    a = asyncio.ensure_future(engine.generate([LEAD["a"]]))
    await _wait_steps(engine, 3)
    b = asyncio.ensure_future(engine.generate([LEAD["b"]]))  # joins three steps late
    c = asyncio.ensure_future(engine.generate([LEAD["c"]]))
    await _wait_steps(engine, 8)
    while not engine.is_running("c"):
        await asyncio.sleep(0)
    await engine.abort("c")
    out = {"a": await a, "b": await b, "c": await c}
    s0 = engine.steps
    d = asyncio.ensure_future(engine.generate([LEAD["d"]]))
    await _wait_steps(engine, s0 + 4)
    await engine.pause("keep")
    await asyncio.sleep(2.5)  # idle while paused: heartbeats keep the follower within the group's 60 s
    await engine.resume()
    out["d"] = await d
    await engine.update_weights(_version_state(path, 1).items(), version=1)
    out["e"] = await engine.generate([LEAD["e"]])
    await engine.update_weights(_version_state(path, 2).items(), version=2)  # the follower ends its v2 late
    out["f"] = await engine.generate([LEAD["f"]])
    try:  # rank 1 cannot read this checkpoint (see _follow): no rank may change weights
        await engine.update_weights_from_disk(path, 3)
        out["disk"] = "loaded"
    except RuntimeError as exc:
        out["disk"] = str(exc)
    out["f_again"] = await engine.generate([LEAD["f"]])
    await engine.shutdown()
    await engine.shutdown()  # a second call does nothing (it used to wait on followers that are gone)
    return {k: [(c.output_ids, c.logprobs, c.finish_reason, c.versions) for c in r[0].completions]
            if isinstance(r, list) else r for k, r in out.items()}


async def _follow(engine: TorchEngine, path: str) -> dict:
    from meshrl.engines import schedule

    def unreadable(model, where):  # this rank alone cannot read checkpoints (a missing mount, say)
        raise OSError(f"{where}: permission denied")

    schedule.stage_checkpoint = unreadable
    refused = []
    for call in (lambda: engine.generate([LEAD["a"]]), lambda: engine.pause("keep"), lambda: engine.abort("a")):
        try:
            await call()
        except RuntimeError as e:
            refused.append("follows rank 0's schedule" in str(e))
    follow = asyncio.ensure_future(engine.follow())
    await engine.begin_weight_update()
    await engine.load_weights(_version_state(path, 1).items())
    staged_at = engine.version
    await engine.end_weight_update(1)  # returns once rank 0 flipped to 1 (it is staged meanwhile)
    await asyncio.sleep(1.0)  # rank 0 flips to 2 first: this rank's flip waits for its own end
    await engine.update_weights(_version_state(path, 2).items(), version=2)
    await follow
    return {"refused": refused, "version_after_stage": staged_at, "version": engine.version}


def _leader_rank_main(rank: int, path: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshrl.engines.tp import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = TensorParallel.from_device_mesh(mesh, "tp", leader_driven=True, heartbeat_s=0.5)
    engine = TorchEngine.from_pretrained(path, TorchEngineConfig(max_batch_size=4, max_seq_len=32), tp=tp)
    out = asyncio.run((_lead if rank == 0 else _follow)(engine, path))
    out["steps"] = engine.steps
    out["messages"] = engine._channel.messages
    torch.save(out, os.path.join(out_dir, f"lead{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_leader_driven_tp_follows_calls_made_at_any_step(tmp_path):
    """Rank 0 takes requests three steps apart, an abort, a pause/keep with idle heartbeats and two
    weight flips (the follower ends the second one after rank 0 flipped); rank 1 runs the same steps,
    and every result equals TP=1 on the same weights."""
    hf = hf_model()
    path = str(tmp_path / "ckpt")
    hf.save_pretrained(path)
    run_processes(_leader_rank_main, (path, free_port(), str(tmp_path)), 2, timeout_s=120, what="leader-driven TP ranks")
    lead, follow = torch.load(tmp_path / "lead0.pt"), torch.load(tmp_path / "lead1.pt")
    assert follow["refused"] == [True, True, True]
    assert follow["version_after_stage"] == 0 and follow["version"] == 2  # staged, then live only at the flips
    assert follow["steps"] == lead["steps"] and follow["messages"] == lead["messages"]
    assert lead["messages"] > lead["steps"] + 3  # heartbeats while paused (every 0.5 s for 2.5 s)

    async def reference() -> dict:
        eng = TorchEngine.from_pretrained(path, TorchEngineConfig(max_batch_size=4, max_seq_len=32))
        ref = {k: await eng.generate([LEAD[k]]) for k in "abcd"}
        await eng.update_weights(_version_state(path, 1).items(), version=1)
        ref["e"] = await eng.generate([LEAD["e"]])
        await eng.update_weights(_version_state(path, 2).items(), version=2)
        ref["f"] = await eng.generate([LEAD["f"]])
        return ref

    ref = asyncio.run(reference())
    for k, r in ref.items():
        got = lead[k]
        assert len(got) == len(r[0].completions)
        for c, (ids, lps, finish, versions) in zip(r[0].completions, got):
            if k == "c":  # aborted mid-stream: a prefix of the full run
                assert finish == "abort" and 0 < len(ids) < len(c.output_ids)
                assert ids == c.output_ids[: len(ids)]
                continue
            assert ids == c.output_ids, k
            assert torch.allclose(torch.tensor(lps), torch.tensor(c.logprobs), atol=1e-5), k
            assert versions == c.versions, k
    assert lead["e"][0][3] == [1] * 12 and lead["f"][0][3] == [2] * 12
    assert "could not read its shard" in lead["disk"] and lead["f_again"] == lead["f"]  # all or nothing
    assert lead["e"][0][0] != lead["f"][0][0]  # the two versions do generate differently


@pytest.mark.slow
def test_server_with_tp2_takes_requests_at_any_time_and_loads_weights_from_disk(tmp_path):
    """``serve --tp 2``: requests posted while others run, an in-place pause with an abort, a refused
    distributed update and a disk update give exactly what one engine gives on the same weights."""
    import aiohttp
    from safetensors.torch import save_file

    hf = hf_model()
    path, v1 = tmp_path / "ckpt", tmp_path / "v1"
    hf.save_pretrained(path)
    v1.mkdir()
    save_file(_version_state(str(path), 1), str(v1 / "model.safetensors"))
    reqs = {k: LEAD[k] for k in "abde"}

    def body(r: GenerateRequest) -> dict:
        sp = r.sampling
        return {"input_ids": r.input_ids, "rid": r.request_id, "return_logprob": True, "sampling_params": {
            "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            **({"sampling_seed": sp.seed} if sp.seed is not None else {})}}

    async def client(url: str) -> dict:
        async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def post(route: str, b: dict):
                async with s.post(route, json=b) as r:
                    return r.status, await r.json()

            async with s.get("/get_server_info") as r:
                info = await r.json()
            out = {"tp_size": info["tp_size"]}
            first = asyncio.ensure_future(post("/generate", body(reqs["a"])))
            await asyncio.sleep(0.03)  # a few steps in
            later = [asyncio.ensure_future(post("/generate", body(reqs[k]))) for k in "bd"]
            # c as a batch of one: an aborted single-prompt request is a bare 499, as on SGLang; a batch
            # returns each output, abort and all
            batch = {**body(LEAD["c"]), "input_ids": [LEAD["c"].input_ids], "rid": [LEAD["c"].request_id]}
            long = asyncio.ensure_future(post("/generate", batch))
            await asyncio.sleep(0.005)
            assert (await post("/pause_generation", {"mode": "in_place"}))[0] == 200  # c cannot finish first
            while not long.done():  # (until c's own /generate has reached the server)
                async with s.post("/abort_request", json={"rid": "c"}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            assert (await post("/continue_generation", {}))[0] == 200
            for k, task in zip("abdc", [first, *later, long]):
                out[k] = await task
            out["refused"] = await post("/update_weights_from_distributed",
                                        {"names": [], "dtypes": [], "shapes": [], "group_name": "g"})
            out["disk"] = await post("/update_weights_from_disk", {"model_path": str(v1), "weight_version": "1"})
            out["bad_disk"] = await post("/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
            out["e"] = await post("/generate", body(reqs["e"]))
            return out

    proc, url = start_server(path, "--tp", "2", "--device", "cpu", "--max-batch-size", "4", "--max-seq-len", "32")
    try:
        wait_healthy(proc, url)
        got = asyncio.run(client(url))
    finally:
        proc.terminate()
        rc = proc.wait(timeout=60)  # rank 0 stops its follower first (engine.shutdown), then exits
        log = proc.stdout.read()
    assert "Traceback" not in log, log[-3000:]
    assert rc is not None

    async def reference() -> dict:
        eng = TorchEngine.from_pretrained(str(path), TorchEngineConfig(max_batch_size=4, max_seq_len=32))
        ref = {k: (await eng.generate([reqs[k]]))[0].completions[0] for k in "abd"}
        ref["c"] = (await eng.generate([LEAD["c"]]))[0].completions[0]
        await eng.update_weights_from_disk(str(v1), 1)
        ref["e"] = (await eng.generate([reqs["e"]]))[0].completions[0]
        return ref

    ref = asyncio.run(reference())
    assert got["tp_size"] == 2
    for k in "abde":
        st, o = got[k]
        assert st == 200, o
        assert o["output_ids"] == ref[k].output_ids, k
        lps = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref[k].logprobs), atol=1e-5), k
    st, (c,) = got["c"]
    assert st == 200 and c["meta_info"]["finish_reason"]["type"] == "abort"
    assert c["output_ids"] == ref["c"].output_ids[: len(c["output_ids"])]
    assert got["refused"][0] == 400 and not got["refused"][1]["success"] and "--tp" in got["refused"][1]["message"]
    assert got["disk"][0] == 200 and got["disk"][1]["success"]
    assert got["bad_disk"][0] == 400 and "no checkpoint directory" in got["bad_disk"][1]["message"]
    assert got["e"][1]["meta_info"]["weight_version"] == "1"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.slow
def test_server_with_tp2_stops_when_a_rank_dies_and_on_ctrl_c(tmp_path):
    """A follower killed while serving stops ``serve --tp 2`` with an error (it used to go on answering
    /health and fail every request); Ctrl-C to the whole process group stops it cleanly, exit 0."""
    import signal
    import subprocess
    import sys

    hf = hf_model()
    hf.save_pretrained(tmp_path / "ckpt")

    def start() -> tuple[subprocess.Popen, str]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "meshrl.engines.serve", "--model", str(tmp_path / "ckpt"),
                                 "--port", str(port), "--tp", "2", "--device", "cpu", "--max-seq-len", "32"],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return proc, f"http://127.0.0.1:{port}"

    proc, url = start()
    try:
        wait_healthy(proc, url)
        follower = [c for c in _children(proc.pid) if "resource_tracker" not in _cmdline(c)]
        assert len(follower) == 1, [_cmdline(c) for c in _children(proc.pid)]
        os.kill(follower[0], signal.SIGKILL)
        rc = proc.wait(timeout=60)
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc != 0 and "TP rank 1 exited with code -9" in log, log[-2000:]

    proc, url = start()
    try:
        wait_healthy(proc, url)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: every process of the group gets it
        rc = proc.wait(timeout=60)
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0 and "Traceback" not in log, log[-2000:]
