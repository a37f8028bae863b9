"""``spawn_procs`` and ``ProcMesh``: named dims of processes, reserved as one Ray placement group.

Placement (Ray cannot say "pack these N bundles on one node and those N on another" in one
group, so the two cases differ on purpose):

- ``hosts == 1``: one bundle per process (``{"CPU": cpus_per_proc, "GPU": gpus_per_proc}``),
  ``STRICT_PACK``: every process of the mesh lands on the same node.
- ``hosts > 1``: one bundle per *host* holding that host's processes' resources, ``STRICT_SPREAD``:
  each host bundle on a different node; the processes of a host share their host's bundle.

A leading ``"hosts"`` dim is added when ``hosts > 1``. Processes ask for GPUs when
``gpus_per_proc`` says so, by default 1 if a dim is called ``"gpus"`` and 0 otherwise; Ray then
sets ``CUDA_VISIBLE_DEVICES`` so each actor sees only its own GPU(s) as ``cuda:0...``.

A "process" is a reservation, not a running process: each ``spawn`` starts one Ray actor (its own
OS process) per reserved slot, taking ``share`` (default all) of the slot's CPUs and GPUs. Several
actor meshes can live on the same slots when their shares add up to at most 1 (e.g. a trainer and
an engine at 0.5 each on one GPU); a spawn that would not fit fails at once instead of waiting
forever for resources. The accounting is per ``ProcMesh`` handle (and its views), in this process.
``ProcMesh.stop()`` kills every actor spawned through it and frees the reservation.

Actor names (``name/rank``) are unique per Ray namespace, by default the driver's. ``namespace``
gives a proc mesh's actors a namespace of their own, so that two programs (or two pipelines in one
program) can each have a mesh called ``"trainer"``.

Ray is started (``ray.init()``) on first use when this process is not connected to a cluster.
"""

from __future__ import annotations

import functools
import inspect
import math
import uuid
from typing import Any, Callable, TypeVar, cast

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshrl.mesh import supervision
from meshrl.mesh.actor import Actor, Context, endpoint_names, method_names, ray_actor_class
from meshrl.mesh.actor_mesh import RESERVED, ActorMesh, _ActorMeshImpl
from meshrl.mesh.shape import Shape

A = TypeVar("A", bound=Actor)


_TOKEN_CPU = 0.01
"""What a process reserves of Ray's CPUs unless told: enough to be scheduled, not a core."""


def _ensure_ray() -> None:
    if not ray.is_initialized():
        ray.init()


def spawn_procs(
    per_host: dict[str, int],
    hosts: int = 1,
    *,
    cpus_per_proc: float | None = None,
    gpus_per_proc: float | None = None,
    resources: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
    pack: bool | str = True,
    env: dict[str, str] | None = None,
    name: str | None = None,
    namespace: str | None = None,
    timeout: float = 60.0,
) -> ProcMesh:
    """Reserve ``hosts`` × ``prod(per_host)`` processes with dims ``per_host`` (e.g. ``{"gpus": 2}``).

    ``env`` is set in every actor spawned on the mesh. A process reserves ``cpus_per_proc`` of
    Ray's CPUs only when asked: by default a token (0.01), so a laptop's two cores hold a mesh of
    four processes, and another beside it, as processes share cores anyway. A fraction of a GPU
    per process shares the GPU with another mesh's processes (a trainer and an SGLang server on
    one device).

    Where the processes go (``hosts == 1``):

    - ``resources``: further Ray resources each process reserves, e.g. ``{"trainer_node": 0.01}``
      (a custom resource ``ray start --resources`` gave some nodes: the mesh goes only there),
      ``{"node:10.0.0.2": 0.01}`` (one node, by its address) or ``{"CPU": 1}`` (a whole core).
    - ``labels``: node labels every process's node must carry (``ray start --labels``; Ray's label
      selectors, on a Ray that has them).
    - ``pack``: True puts the whole mesh on one node; False lets Ray place each process where it
      fits (packed where it can); a dim's name puts each group of processes that differ only in
      that dim and the dims after it on one node (``{"replica": 4, "tp": 2}`` with ``pack="tp"``:
      each replica's two ranks together, the replicas wherever they fit).

    Raises ``TimeoutError`` naming the mesh and what the cluster lacks if it cannot place the
    reservation within ``timeout`` seconds.
    """
    resources = dict(resources or {})
    for key, amount in (("CPU", cpus_per_proc), ("GPU", gpus_per_proc)):
        if key in resources and amount is not None:
            raise ValueError(f"resources[{key!r}] and {key.lower()}s_per_proc both say how many {key}s a process "
                             "reserves: give one")
    cpus_per_proc = resources.pop("CPU", _TOKEN_CPU if cpus_per_proc is None else cpus_per_proc)
    gpus_per_proc = resources.pop("GPU", gpus_per_proc)
    if not per_host:
        raise ValueError('per_host needs at least one dim, e.g. {"gpus": 2} or {"procs": 4}')
    if "hosts" in per_host:
        raise ValueError('"hosts" is the dim spawn_procs adds itself; pass hosts=N instead')
    if not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be an integer >= 1, got {hosts!r}")
    if gpus_per_proc is None:
        gpus_per_proc = 1 if "gpus" in per_host else 0
    if cpus_per_proc < 0 or gpus_per_proc < 0:
        raise ValueError(f"cpus_per_proc and gpus_per_proc must be >= 0, got {cpus_per_proc}, {gpus_per_proc}")
    if cpus_per_proc == 0 and gpus_per_proc == 0 and not resources:
        raise ValueError("cpus_per_proc and gpus_per_proc are both 0: a process must reserve something")
    bad = {k: v for k, v in resources.items() if not k or not isinstance(v, (int, float)) or not v > 0}
    if bad:
        raise ValueError(f"resources must map Ray resource names to amounts > 0, got {bad}")
    if isinstance(pack, str) and pack not in per_host:
        raise ValueError(f"pack={pack!r} names no dim of {dict(per_host)}: give a dim, True (one node) or False")
    if hosts > 1 and pack is not True:
        raise ValueError("pack applies to a mesh of one host; hosts > 1 puts each host's processes on a node of its own")
    dims = ({"hosts": hosts} if hosts > 1 else {}) | dict(per_host)
    shape = Shape.from_dims(dims)  # validates sizes
    _ensure_ray()

    per_proc: dict[str, float] = {"CPU": cpus_per_proc} if cpus_per_proc else {}
    if gpus_per_proc:
        per_proc["GPU"] = gpus_per_proc
    per_proc.update(resources)
    if hosts > 1:  # a bundle per host, each on a node of its own
        group, strategy = math.prod(per_host.values()), "STRICT_SPREAD"
    elif isinstance(pack, str):  # a bundle per group: a bundle never spans nodes
        dim_names = list(per_host)
        group, strategy = math.prod(list(per_host.values())[dim_names.index(pack):]), "PACK"
    else:
        group, strategy = 1, "STRICT_PACK" if pack else "PACK"
    bundles = [{k: v * group for k, v in per_proc.items()} for _ in range(len(shape) // group)]
    bundle_of = tuple(r // group for r in range(len(shape)))
    uid = uuid.uuid4().hex[:12]
    mesh_name = name or "procs"
    options: dict[str, Any] = {}
    if labels:
        if "bundle_label_selector" not in inspect.signature(placement_group).parameters:
            raise ValueError(f"labels={labels}: this Ray ({ray.__version__}) has no label selectors for placement "
                             "groups: pin the mesh by a custom resource (resources=) instead, or upgrade Ray")
        options["bundle_label_selector"] = [dict(labels) for _ in bundles]
    pg = placement_group(bundles, strategy=strategy, name=f"{mesh_name}-{uid}", **options)
    if not pg.wait(timeout):
        remove_placement_group(pg)
        raise TimeoutError(_unplaced(mesh_name, dims, strategy, bundles, labels or {}, timeout))
    return ProcMesh(mesh_name, uid, shape, pg, bundle_of, cpus_per_proc, gpus_per_proc, env or {}, namespace)


def _unplaced(name: str, dims: dict[str, int], strategy: str, bundles: list[dict[str, float]],
              labels: dict[str, str], timeout: float) -> str:
    """Why a proc mesh was not placed: what it needs, and what the cluster's nodes lack of it."""
    need = {k: round(sum(b.get(k, 0) for b in bundles), 3) for k in bundles[0]}
    where = {"STRICT_PACK": "on one node", "STRICT_SPREAD": f"on {len(bundles)} distinct nodes",
             "PACK": f"in {len(bundles)} group(s) of {bundles[0]}, each on one node"}[strategy]
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if all(n.get("Labels", {}).get(k) == v for k, v in labels.items())]
    lacking = sorted(k for k in need if not any(k in n["Resources"] for n in fits))
    free = ray.available_resources()
    short = {k: round(v - free.get(k, 0), 3) for k, v in need.items() if v > free.get(k, 0) + 1e-9}
    why = []
    if labels and not fits:
        why.append(f"no node carries the labels {labels} (ray start --labels=...)")
    elif lacking:
        names = ", ".join(repr(k) for k in lacking)
        why.append(f"no node{' with the labels ' + str(labels) if labels else ''} has {names} "
                   f"(give it with ray start --resources='{{\"{lacking[0]}\": N}}')")
    elif short:
        why.append(f"the cluster has {short} less free than that")
    else:
        why.append("no single node has that much free")
    per_node = "; ".join(f"{n['NodeManagerAddress']}/{n['NodeID'][:6]}: "
                         + str({k: v for k, v in n["Resources"].items() if k in need}) for n in nodes)
    return (f"proc mesh {name!r} ({dims}) was not placed within {timeout:g} s: it needs {need} {where}, and "
            f"{why[0]}; the nodes have {per_node or 'nothing (no node is alive)'}")


class ProcMesh:
    """Reserved processes with named dims; ``spawn`` starts an actor mesh on them."""

    def __init__(
        self,
        name: str,
        uid: str,
        shape: Shape,
        pg: Any,
        bundle_of: tuple[int, ...],
        cpus_per_proc: float,
        gpus_per_proc: float,
        env: dict[str, str],
        namespace: str | None = None,
    ):
        self._name = name
        self._uid = uid
        self._shape = shape
        self._pg = pg
        self._bundle_of = bundle_of  # by rank of the full proc mesh
        self._cpus = cpus_per_proc
        self._gpus = gpus_per_proc
        self._env = env
        self._namespace = namespace
        self._spawned: list[_ActorMeshImpl[Any]] = []  # meshes spawned through this handle
        self._used = [0.0] * len(bundle_of)  # share of each slot taken by spawned actors
        self._stopped = [False]  # shared with every view: stop() frees the reservation of all of them

    def __reduce__(self) -> Any:
        args = (self._name, self._uid, self._shape, self._pg, self._bundle_of, self._cpus, self._gpus, self._env,
                self._namespace)
        return (ProcMesh, args)

    @property
    def name(self) -> str:
        return self._name

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.dims

    def __len__(self) -> int:
        return len(self._shape)

    def __repr__(self) -> str:
        return f"ProcMesh({self._name!r}, {self._shape.dims})"

    def nodes(self) -> list[str]:
        """The node each process of this view is reserved on, in rank order: ``address/node id``
        (its first 6 hex digits: raylets sharing a machine share the address)."""
        from ray.util import placement_group_table

        table = placement_group_table(self._pg).get("bundles_to_node_id", {})
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        nodes = [table.get(self._bundle_of[r], "") for r in self._shape.ranks]
        return [f"{address.get(n, '?')}/{n[:6]}" for n in nodes]

    def slice(self, **dims: int | slice) -> ProcMesh:
        """A view on some of the processes: ``dim=slice(...)`` keeps the dim, ``dim=int`` drops it."""
        shape, _ = self._shape.slice(**dims)
        return self._view(shape)

    def flatten(self, name: str) -> ProcMesh:
        """A view with all dims merged into one called ``name``."""
        return self._view(self._shape.flatten(name))

    def _view(self, shape: Shape) -> ProcMesh:
        view = ProcMesh(self._name, self._uid, shape, self._pg, self._bundle_of, self._cpus, self._gpus, self._env,
                        self._namespace)
        view._spawned = self._spawned
        view._used = self._used
        view._stopped = self._stopped
        return view

    def spawn(
        self,
        name: str,
        actor_cls: type[A],
        *args: Any,
        max_restarts: int = 0,
        on_restart: Callable[[supervision.RestartEvent], Any] | None = None,
        max_concurrency: int | None = None,
        share: float = 1.0,
        **kwargs: Any,
    ) -> ActorMesh[A]:
        """Start ``actor_cls(*args, **kwargs)`` in every process; actors are named ``name/rank``.

        Returns at once; a failing ``__init__`` surfaces as ``ActorFailure`` on the first call
        (or on ``await mesh.ready()``). ``max_restarts``/``on_restart``: see ``supervision``.
        ``max_concurrency``: Ray's, i.e. calls in flight per actor (default 1 for a sync actor,
        1000 for an async one; a low limit can deadlock an actor whose calls wait on each other).
        ``share``: fraction of each process's reservation the actor takes (module docstring).
        These four keyword names are therefore not passed on to ``actor_cls``.
        """
        if not (isinstance(actor_cls, type) and issubclass(actor_cls, Actor)):
            raise TypeError(f"spawn needs a subclass of meshrl.mesh.Actor, got {actor_cls!r}")
        if self._stopped[0]:  # its reservation is gone: the actors could never be placed
            raise RuntimeError(f"proc mesh {self._name!r} was stopped: spawn_procs(...) a new one")
        if not name or "/" in name:
            raise ValueError(f"mesh name must be non-empty and without '/', got {name!r}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        endpoints = endpoint_names(actor_cls)
        clash = sorted(endpoints & RESERVED)
        if clash:
            raise ValueError(f"endpoint(s) {clash} of {actor_cls.__name__} shadow ActorMesh methods: rename them")
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        taken = [r for r in self._shape.ranks if self._used[r] + share > 1 + 1e-9]
        if taken:
            raise ValueError(
                f"processes {taken} of proc mesh {self._name!r} have {1 - self._used[taken[0]]:.2f} of their "
                f"resources left and mesh {name!r} asks for share={share}: spawn every mesh that shares "
                "them with a share < 1 (e.g. 0.5 each), or stop the other meshes"
            )
        supervised = max_restarts > 0
        if on_restart is not None and not supervised:
            raise ValueError("on_restart needs max_restarts >= 1")
        remote_cls = ray_actor_class(actor_cls, supervised)
        uid = uuid.uuid4().hex[:12]
        options: dict[str, Any] = {
            "num_cpus": self._cpus * share,
            "num_gpus": self._gpus * share,
            "max_restarts": max_restarts,
            "max_task_retries": 0,
        }
        if max_concurrency is not None:
            options["max_concurrency"] = max_concurrency
        if self._env:
            options["runtime_env"] = {"env_vars": dict(self._env)}
        if self._namespace is not None:
            options["namespace"] = self._namespace
        handles: list[Any] = []
        for rank, proc_rank in enumerate(self._shape.ranks):
            ctx = Context(name, uid, rank, self._shape.labels, self._shape.sizes)
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=self._bundle_of[proc_rank])
            actor_name = f"{name}/{rank}"
            try:
                handle = remote_cls.options(name=actor_name, scheduling_strategy=strategy, **options).remote(
                    ctx, *args, **kwargs
                )
            except ValueError as exc:
                if "already" not in str(exc):
                    raise
                for started in handles:
                    ray.kill(started, no_restart=True)
                where = f" in Ray namespace {self._namespace!r}" if self._namespace is not None else ""
                raise ValueError(
                    f"an actor named {actor_name!r} already exists{where}: stop that mesh first, spawn under "
                    "another name, or give the proc mesh a namespace of its own (spawn_procs(namespace=...))"
                ) from exc
            handles.append(handle)
        shape = Shape(self._shape.labels, self._shape.sizes)
        mesh: _ActorMeshImpl[A] = _ActorMeshImpl(
            name, uid, actor_cls.__name__, endpoints, method_names(actor_cls), tuple(handles), shape, len(shape)
        )
        for r in self._shape.ranks:
            self._used[r] += share
        mesh._on_stop[0] = functools.partial(self._release, tuple(self._shape.ranks), share)
        if supervised:
            supervision.watch(handles, list(range(len(handles))), name, uid, self._uid, on_restart)
        self._spawned.append(mesh)
        return cast(ActorMesh[A], mesh)

    def _release(self, ranks: tuple[int, ...], share: float) -> None:
        for r in ranks:
            self._used[r] = max(0.0, self._used[r] - share)

    def stop(self) -> None:
        """Kill every actor spawned on this proc mesh and release its reservation (of the whole proc
        mesh, through any view of it); later spawns on it are refused. Idempotent."""
        self._stopped[0] = True
        supervision.unwatch_procs(self._uid)
        for mesh in self._spawned:
            mesh.stop()
        self._spawned.clear()
        try:
            remove_placement_group(self._pg)
        except Exception:  # already removed, or Ray shut down
            pass
