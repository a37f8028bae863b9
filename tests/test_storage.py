"""The shared-storage check a run makes at start on a cluster (meshrl.pipeline.storage, issue 26)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_node_that_sees_other_directories_fails_the_run_at_start(tmp_path):
    """What another node sees at the driver's paths is its own disk: here, other directories. Its
    report (written by the same code the actors run) fails the start, naming the role, the node and
    the directory; a node that shares them passes."""
    from meshrl.config import ConfigError
    from meshrl.pipeline.storage import PROBE_DIR, judge, storage_report

    out, elsewhere, model = tmp_path / "out", tmp_path / "elsewhere", tmp_path / "model"
    for d in (out / PROBE_DIR, elsewhere, model):
        d.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x" * 10)
    token = "t0ken"
    (out / PROBE_DIR / token).write_text(token)

    judge(out, token, str(model), [("trainer", 0, storage_report(str(out), token, str(model)))])  # shared: passes
    with pytest.raises(ConfigError, match=r"`run.output_dir`: .* is not the driver's directory on trainer rank 1 on "
                                          r"node [\d.]+/[\w-]{6}: it does not see the probe file .*FileNotFoundError"):
        judge(out, token, str(model), [("trainer", 1, storage_report(str(elsewhere), token, str(model)))])
    # a node that sees the probe (a copy), but writes where the driver cannot read
    # (a new probe: the shared check above left this process's answer to the first in the driver's directory)
    token = "t0ken2"
    (out / PROBE_DIR / token).write_text(token)
    (elsewhere / PROBE_DIR / token).write_text(token)  # the first report made the folder there
    with pytest.raises(ConfigError, match="the driver does not see the probe file trainer rank 0 on node"):
        judge(out, token, str(model), [("trainer", 0, storage_report(str(elsewhere), token, str(model)))])
    # the model directory: a copy without the weights
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"`model.path`: the model directory .* is not the driver's on rollout rank 0 "
                                          r"on node .*missing \['model.safetensors'\]"):
        judge(out, token, str(model), [("rollout", 0, storage_report(None, token, str(copy)))])
    assert Path(out / PROBE_DIR).is_dir()
