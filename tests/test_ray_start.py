"""The pipeline starts Ray off its caller's event loop, and the cluster outlives that call.

``ray.init`` takes seconds, so ``Pipeline.run`` calls ``ensure_ray`` on a thread. Ray's GCS and
raylet die with the thread that started them (Linux's parent-death signal); started on an executor
thread, they died when ``asyncio.run`` ended, and the next run in the same program failed after a
minute with "Failed to connect to GCS". A fresh interpreter, since the tests' own cluster is up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio, time
    import ray
    from meshrl.pipeline import ensure_ray

    asyncio.run(asyncio.to_thread(ensure_ray, 1))  # the first run's start, on a thread that then ends
    time.sleep(1)

    @ray.remote(num_cpus=0.1)
    def one():
        return 1

    async def second_run():
        await asyncio.to_thread(ensure_ray, 1)  # already up: nothing to do
        return await asyncio.wait_for(one.remote(), 30)

    print("second run:", asyncio.run(second_run()), flush=True)
""")


def test_a_cluster_started_off_the_loop_outlives_the_first_asyncio_run(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0 and "second run: 1" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "SIGTERM handler is not set" not in out.stderr  # Ray's note on a thread's start is not the user's concern
