"""Process groups and ports outside any mesh, with no Ray: what an SGLang weight push or a server needs.

``join_process_group`` builds a group over processes that share no default group (a trainer and
its engines, or SGLang servers) exactly the way SGLang builds its own (``init_custom_process_group``:
tcp rendezvous, ``PrefixStore(group_name, store)``, ``_new_process_group_helper``), so it works in
a process that has a default group, or none, and interoperates with an SGLang engine.
``free_ports`` finds ports for its store, ``routable_ip`` the address other nodes reach this one at.
``meshrl.mesh.distributed`` builds the mesh-wide groups on top of these.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["free_port", "free_ports", "join_process_group", "routable_ip"]


def routable_ip() -> str:
    """This host's address on its default route (what other nodes reach it at); Ray's node address
    when this process is connected to Ray (the one Ray's other nodes use), 127.0.0.1 if none."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# Ports handed out by free_port: above Ray's worker ports (10002-19999), below the OS's ephemeral range.
_FIRST_FREE_PORT = 20000
_FREE_PORT_TRIES = 64


def _ephemeral_ports() -> tuple[int, int]:
    """The range the OS takes source ports of outgoing connections from (Linux default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on this host a moment ago.

    They are drawn outside the OS's ephemeral range when it leaves room: every outgoing connection
    (gloo's pairs, Ray's gRPC) takes an ephemeral port, so one found by binding port 0 can be taken
    in the moment before the group's store binds it (``EADDRINUSE``). Falls back to the OS's pick.
    """
    low, _ = _ephemeral_ports()
    rng, ports = random.SystemRandom(), []
    tries = _FREE_PORT_TRIES * n if low - _FIRST_FREE_PORT >= 1000 else 0  # else no room below: the OS picks
    for _ in range(tries):
        port = rng.randrange(_FIRST_FREE_PORT, low)
        if port not in ports and _bindable(port):
            ports.append(port)
            if len(ports) == n:
                break
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            if (port := s.getsockname()[1]) not in ports:
                ports.append(port)
    return ports


def free_port() -> int:
    """A TCP port that was free on this host a moment ago (see ``free_ports``)."""
    return free_ports(1)[0]



def join_process_group(
    group_name: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout: float = 120.0,
    high_priority: bool = False,
) -> ProcessGroup:
    """Join an extra process group (SGLang's construction); rank 0 hosts the store on ``master_port``.

    ``high_priority`` (NCCL): the group's kernels run on high-priority CUDA streams, so their
    thread blocks are scheduled ahead of those of kernels already queued on the device.

    Use it as ``dist.broadcast(t, src=0, group=pg)`` (group ranks equal the ``rank`` given here)
    and ``dist.destroy_process_group(pg)`` when done.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if backend == "nccl":
        # SGLang's engines run with these; a mismatch makes the first broadcast hang or fail.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    td = timedelta(seconds=timeout)
    try:
        store, rank, world_size = next(rendezvous(f"tcp://{master_addr}:{master_port}", rank, world_size, timeout=td))
        store.set_timeout(td)
        store = PrefixStore(group_name, store)
        options = None
        if backend == "nccl" and high_priority:
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=td,  # type: ignore[arg-type]
            backend_options=options,
        )
    except Exception as exc:
        exc.add_note(
            f"joining process group {group_name!r} as rank {rank} of {world_size} at {master_addr}:{master_port} "
            f"(timeout {timeout} s)"
        )
        raise
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
