"""``DataParallel`` on a real 2-D gloo DeviceMesh, in spawned ranks.

Its own module so that the 4 spawned ranks import torch and ``data_parallel`` alone, not the
trainer and transformers that ``test_trainer_fsdp`` brings (4 interpreters on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

from meshrl.actors.data_parallel import DataParallel
from meshrl.mesh.distributed import free_port
from processes import run_processes


def _dp_axis_of_a_2d_mesh(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    try:
        dp = DataParallel(init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")), axis="dp")
        Path(out, f"{rank}").write_text(f"{dp.rank} {dp.size}")
    finally:
        dist.destroy_process_group()


def test_data_parallel_sizes_the_dp_axis_of_a_2d_mesh(tmp_path):
    """``size`` was the whole mesh's (4 on 2 x 2) while rank and group were the dp axis's (2): the
    batch was cut in 4 shares and two were never trained."""
    run_processes(_dp_axis_of_a_2d_mesh, (free_port(), str(tmp_path)), 4, timeout_s=120, what="the 4 ranks")
    got = sorted((tmp_path / str(r)).read_text() for r in range(4))
    assert got == ["0 2", "0 2", "1 2", "1 2"]
