"""Does an engine process whose event loop holds the GIL in long C calls slow a bucketed push?

Run: ``python bench/push_gil_probe.py`` (CPU, gloo, two processes, about 1 minute). A trainer
process pushes a 6-layer Qwen2 model (≈ 80 MB float32, 8 MB buckets) seven times into an engine
process whose receive is armed as in the pipeline, with ``reshard.receive_depth`` 2 (a bucket is
posted only after the one two before it completed) and 0 (every bucket posted at once), each
with and without a "hog": a coroutine on the engine's event loop that pickles a 600k-float list
back to back — one long C call holding the GIL, like a rollout actor returning its results.
Prints the median and max send time per case. Numbers mean little in absolute terms (two shared
cores); the ratio between depths under the hog is the point (bench/RESULTS.md, issue 10).
"""
import asyncio
import pickle
import socket
import time

import torch
import torch.multiprocessing as mp

def cfg_():
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                       tie_word_embeddings=False, eos_token_id=None)

def main(rank, port, depth, hog, pushes):
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from meshrl.engines import TorchEngine, TorchEngineConfig
    from meshrl.engines.layout import EngineLayout, ModelSpec
    from meshrl.reshard import GroupRanks, ReshardConfig, Resharder, dest_layout, source_layout, local_tensors
    cfg = cfg_()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    source = source_layout(model.named_parameters())
    dest = dest_layout(EngineLayout(ModelSpec.from_hf_config(cfg)), 1, 1, "float32")
    conf = ReshardConfig(bucket_bytes=8 * 2**20, timeout_s=60, group_name=f"g{depth}{hog}", receive_depth=depth)
    res = Resharder.join(source, dest, GroupRanks.disjoint(1, 1), rank, "127.0.0.1", port, conf)
    if rank == 0:
        times = []
        for v in range(1, pushes + 1):
            time.sleep(0.3)
            t = time.perf_counter()
            res.send(local_tensors(model.named_parameters()), v)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"depth={depth or 'all'} hog={hog} buckets={len(res.plan.buckets)}: send median {times[len(times)//2]*1e3:.1f} ms"
              f" max {times[-1]*1e3:.1f} ms", flush=True)
        return
    engine = TorchEngine.from_hf_model(model, config=TorchEngineConfig(max_batch_size=2, max_seq_len=32))
    big = [float(i) for i in range(600_000)]
    async def hogger(stop):
        while not stop.is_set():
            if hog:
                pickle.dumps(big)  # one long C call holding the GIL
            await asyncio.sleep(0)
    async def run():
        stop = asyncio.Event()
        h = asyncio.create_task(hogger(stop))
        for v in range(1, pushes + 1):
            await res.arm(engine, v, timeout_s=60)
            await res.receive(engine, v)
        stop.set()
        await h
    asyncio.run(run())

if __name__ == "__main__":
    big = [float(i) for i in range(600_000)]
    t = time.perf_counter()
    pickle.dumps(big)
    print("one hog call (ms):", round((time.perf_counter() - t) * 1e3, 1), flush=True)
    for hog in (False, True):
        for depth in (2, 0):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.start_processes(main, args=(port, depth, hog, 7), nprocs=2, start_method="spawn")
