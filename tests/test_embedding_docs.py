"""docs/embedding.md runs as written: every code block, in order, like a notebook, at tiny size.

The only differences from a reader's run: ``my_run.yaml`` holds tiny settings, rewards scored in the
rollout worker (the docs' own YAML block is checked to be a valid config), and the OpenAI server listens on a free port instead of
30000. The Python blocks share one namespace; the shell block starts the server as a subprocess.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import meshrl
from meshrl.mesh.distributed import free_port
from serving import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "embedding.md"
pytestmark = pytest.mark.slow


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_every_snippet_of_the_embedding_docs_runs(ray_cluster, tmp_path, monkeypatch, tiny_model):
    found = blocks()
    assert [lang for lang, _ in found] == ["yaml", "python", "python", "python", "python", "python", "python", "python",
                                           "bash", "python", "bash", "python"]
    docs_yaml = tmp_path / "docs_run.yaml"
    docs_yaml.write_text(found[0][1])
    for overrides in ([], ["queue.max_staleness=2"], ["run.resume=latest"]):  # as the page loads it
        meshrl.load_config(meshrl.PipelineConfig, str(docs_yaml), overrides).validate()  # a config that runs

    model_dir = tiny_model
    (tmp_path / "my_run.yaml").write_text(f"""
model: {{path: {model_dir}}}
run: {{total_steps: 4, output_dir: runs/mine, eval_every: 0, progress: false}}
task: {{digits: 1, num_test: 8}}
algo: {{advantage: grpo, samples_per_prompt: 2}}
queue: {{max_staleness: 1}}
trainer: {{samples_per_step: 8, lr: 1.0e-3}}
rollout: {{prompts_per_request: 2, max_new_tokens: 3, episode: {{max_turns: 2}}}}
reward: {{num_workers: 0}}  # the rollout worker scores: one process fewer a run (docs: either works)
""")
    monkeypatch.chdir(tmp_path)
    port, server, ns = free_port(), None, {"__name__": "embedding_docs"}
    try:
        for i, (lang, code) in enumerate(found[1:], start=1):
            code = code.replace("30000", str(port))
            if lang == "python":
                exec(compile(code, f"{DOC}:block{i}", "exec"), ns)
            else:
                cmd = shlex.split(code.strip())
                assert cmd[:3] == ["python", "-m", "meshrl.engines.serve"], cmd
                if server is not None:  # the --tp server takes the same port
                    server.terminate()
                    server.wait(timeout=30)
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
                server = subprocess.Popen([sys.executable, *cmd[1:]], cwd=tmp_path, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                wait_healthy(server, f"http://127.0.0.1:{port}", 120.0)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)

    assert ns["cfg"].run.resume == "latest" and ns["in_code"].run.total_steps == 100
    summary = ns["summary"]
    assert summary["steps"] == 4 and summary["stopped"] is False  # the resumed run finished the run
    assert (tmp_path / "runs" / "mine" / "checkpoints").is_dir()
    assert ns["reply"]["success"] and "as version 7" in ns["reply"]["message"]  # the --tp 2 server took the load
    choice = ns["choice"]
    assert choice["token_ids"] and len(choice["meshrl"]["logprobs"]) == len(choice["token_ids"])
