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

    from pathlib import Path
    from meshrl.pipeline.output_dir import OutputLock

    @ray.remote(num_cpus=0.1)
    class Worker:
        def ready(self):
            return True

    lock = OutputLock(Path("run"))  # a run's hold on its directory, dropped with this process
    lock.acquire()
    worker = Worker.remote()
    assert ray.get(worker.ready.remote(), timeout=60)
    print("ready", flush=True)
    time.sleep(300)  # until the test kills this driver
""")


def test_a_cluster_started_off_the_loop_outlives_the_first_asyncio_run_and_ends_with_a_killed_driver(tmp_path):
    """Then the driver is killed (SIGKILL, as the OOM killer or a scheduler's last resort): nothing of
    its cluster may be left. Ray's agents outlived it by a minute or more, holding their ports;
    meshrl.mesh.reaper stops them. Its hold on its output directory goes with it."""
    import signal

    from meshrl.pipeline.output_dir import OutputLock
    from processes import descendants, left_running

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines == ["second run: 1\n", "ready\n"], "".join(lines) + proc.stderr.read()[-2000:]
        cluster = descendants(proc.pid)
        assert len(cluster) >= 5  # the head processes, the agents, the worker and the reaper
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        left = left_running(cluster, 20)
        assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "SIGTERM handler is not set" not in proc.stderr.read()  # Ray's note on a thread's start is not the user's concern
    lock = OutputLock(tmp_path / "run")
    lock.acquire()
    lock.release()
