"""Two-level topology: nodes of NVLink-connected ranks, and the transport between two ranks.

Model
-----
``world_size`` ranks run on ``num_nodes`` nodes, every node holding the same number of ranks
``local_world_size`` (expert-parallel layouts split experts evenly over nodes, so an uneven job
is rejected up front instead of failing deep inside a layout computation). Within a node the
GPUs reach each other's memory over NVLink (peer-to-peer loads and stores); across nodes there is
no load/store path and rows travel as NVSHMEM puts.

Where ranks sit is given one of three ways:

* ``Topology.from_local_world_size(world_size, L)``: torchrun numbering, node ``n`` holds ranks
  ``[n * L, (n + 1) * L)`` (``--nnodes N --nproc-per-node L``);
* ``Topology.from_hostnames(names)``: one host name per rank, any placement; nodes are numbered
  in order of first appearance and local ranks in rank order within a node;
* ``Topology.from_node_ids(ids)``: the node id of every rank, ids ``0..N-1``.

Transport choice (the contract the fused kernels follow)
--------------------------------------------------------
For a destination rank ``d`` seen from ``src``: ``"store"`` when both sit on one node (the
kernel writes the tile through the peer pointer table, then publishes the tile's flag with a
release atomic), ``"put"`` otherwise (the kernel stages the tile in its own symmetric workspace
and issues ``putmem_signal_nbi_block``: data and flag travel in one NVSHMEM operation, the flag a
64-bit word). Every tile stays flagged either way. On the device the rule reads the peer table:
an entry of 0 means "not load/store reachable: put". A world whose backend knows better than the
host names (NVSHMEM reports which peers ``nvshmem_ptr`` can map) overrides ``peer_reachable``.

World integration
-----------------
:class:`TopologyMixin` gives a World ``topology``, ``node``, ``local_rank``, ``local_world_size``,
``num_nodes``, ``peer_reachable(r)`` and ``transport(r)``. Without an explicit topology a world is
one node holding all its ranks (emulated and torch_symm worlds are single-node by construction).
``set_topology`` lets tests give an emulated world several virtual nodes for host-side logic.

Pure Python, no torch.distributed: unit-tested on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TRANSPORT_STORE = "store"
TRANSPORT_PUT = "put"


def _check_int(name: str, value, lo: int | None = None) -> int:
    # bool is an int subclass: True as a world size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


@dataclass(frozen=True)
class Topology:
    """Placement of ``world_size`` ranks on nodes. Immutable; build with the ``from_*`` methods.

    ``node_ids[r]`` is rank r's node (``0 .. num_nodes - 1``); every node holds the same number of
    ranks.
    """

    node_ids: tuple[int, ...]

    def __post_init__(self):
        ids = tuple(self.node_ids)
        if not ids:
            raise ValueError("a topology needs at least one rank (node_ids is empty)")
        for r, n in enumerate(ids):
            _check_int(f"node_ids[{r}]", n, lo=0)
        num_nodes = max(ids) + 1
        counts = [0] * num_nodes
        for n in ids:
            counts[n] += 1
        missing = [n for n, c in enumerate(counts) if c == 0]
        if missing:
            raise ValueError(
                f"node ids must be 0..{num_nodes - 1} without gaps; nodes {missing} have no rank"
            )
        if len(set(counts)) != 1:
            per_node = ", ".join(f"node {n}: {c}" for n, c in enumerate(counts))
            raise ValueError(
                f"every node must hold the same number of ranks, got {per_node} "
                "(expert parallelism splits experts evenly over nodes)"
            )
        object.__setattr__(self, "node_ids", ids)
        local = []
        seen = [0] * num_nodes
        for n in ids:
            local.append(seen[n])
            seen[n] += 1
        object.__setattr__(self, "_local_ranks", tuple(local))
        object.__setattr__(
            self,
            "_nodes",
            tuple(tuple(r for r, n in enumerate(ids) if n == k) for k in range(num_nodes)),
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def single_node(cls, world_size: int) -> Topology:
        """All ``world_size`` ranks on one node."""
        _check_int("world_size", world_size, lo=1)
        return cls((0,) * world_size)

    @classmethod
    def from_local_world_size(cls, world_size: int, local_world_size: int) -> Topology:
        """torchrun numbering: node ``n`` holds ranks ``[n * L, (n + 1) * L)``."""
        _check_int("world_size", world_size, lo=1)
        _check_int("local_world_size", local_world_size, lo=1)
        if local_world_size > world_size:
            raise ValueError(
                f"local_world_size ({local_world_size}) exceeds world_size ({world_size})"
            )
        if world_size % local_world_size:
            raise ValueError(
                f"world_size ({world_size}) is not a multiple of local_world_size "
                f"({local_world_size}): nodes would hold different numbers of ranks"
            )
        return cls(tuple(r // local_world_size for r in range(world_size)))

    @classmethod
    def from_hostnames(cls, hostnames: Sequence[str]) -> Topology:
        """One host name per rank (rank order). Nodes are numbered by first appearance."""
        if isinstance(hostnames, (str, bytes)) or not isinstance(hostnames, Sequence):
            kind = type(hostnames).__name__
            raise TypeError(f"hostnames must be a sequence of str (one per rank), got {kind}")
        if len(hostnames) == 0:
            raise ValueError("hostnames is empty: need one host name per rank")
        index: dict[str, int] = {}
        ids = []
        for r, h in enumerate(hostnames):
            if not isinstance(h, str) or not h:
                raise ValueError(f"hostnames[{r}] must be a non-empty str, got {h!r}")
            ids.append(index.setdefault(h, len(index)))
        try:
            return cls(tuple(ids))
        except ValueError as e:
            counts = {h: ids.count(i) for h, i in index.items()}
            raise ValueError(f"{e}; ranks per host: {counts}") from None

    @classmethod
    def from_node_ids(cls, node_ids: Sequence[int]) -> Topology:
        """The node id of every rank, ids ``0 .. N-1``."""
        return cls(tuple(node_ids))

    @classmethod
    def from_env(
        cls, world_size: int | None = None, environ: Mapping[str, str] | None = None
    ) -> Topology:
        """From the launcher's variables (torchrun ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``).

        Without ``LOCAL_WORLD_SIZE`` the job is taken as one node.
        """
        env = os.environ if environ is None else environ
        if world_size is None:
            world_size = _env_int(env, "WORLD_SIZE", 1)
        local = _env_int(env, "LOCAL_WORLD_SIZE", None)
        if local is None:
            return cls.single_node(world_size)
        return cls.from_local_world_size(world_size, local)

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return len(self.node_ids)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def local_world_size(self) -> int:
        return len(self._nodes[0])

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def _rank(self, name: str, r: int) -> int:
        _check_int(name, r)
        if not 0 <= r < self.world_size:
            raise ValueError(f"{name} must be in [0, {self.world_size}), got {r}")
        return r

    def node_of(self, rank: int) -> int:
        return self.node_ids[self._rank("rank", rank)]

    def local_rank_of(self, rank: int) -> int:
        return self._local_ranks[self._rank("rank", rank)]

    def ranks_of_node(self, node: int) -> tuple[int, ...]:
        _check_int("node", node)
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes}), got {node}")
        return self._nodes[node]

    def rank_of(self, node: int, local_rank: int) -> int:
        """Inverse of (``node_of``, ``local_rank_of``)."""
        ranks = self.ranks_of_node(node)
        _check_int("local_rank", local_rank)
        if not 0 <= local_rank < len(ranks):
            raise ValueError(f"local_rank must be in [0, {len(ranks)}), got {local_rank}")
        return ranks[local_rank]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_ids[self._rank("a", a)] == self.node_ids[self._rank("b", b)]

    def peer_reachable(self, src: int, dst: int) -> bool:
        """True when ``src`` can load/store ``dst``'s memory (same node: NVLink P2P)."""
        return self.same_node(src, dst)

    def transport(self, src: int, dst: int) -> str:
        """``"store"`` (NVLink store + release flag) or ``"put"`` (NVSHMEM put with signal)."""
        return TRANSPORT_STORE if self.peer_reachable(src, dst) else TRANSPORT_PUT

    def transports(self, src: int) -> tuple[str, ...]:
        """The transport from ``src`` to every destination, in rank order."""
        self._rank("src", src)
        return tuple(self.transport(src, d) for d in range(self.world_size))

    def reachable_mask(self, src: int) -> tuple[bool, ...]:
        self._rank("src", src)
        return tuple(self.peer_reachable(src, d) for d in range(self.world_size))


def _env_int(env: Mapping[str, str], key: str, default):
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an int") from None


def spans_nodes_from_env(environ: Mapping[str, str] | None = None) -> bool | None:
    """Whether the launcher says the job spans several nodes; None when it does not say.

    Read, in order: torchrun (``LOCAL_WORLD_SIZE`` < ``WORLD_SIZE``), Slurm (``SLURM_NNODES`` /
    ``SLURM_JOB_NUM_NODES`` > 1), Open MPI (``OMPI_COMM_WORLD_LOCAL_SIZE`` <
    ``OMPI_COMM_WORLD_SIZE``).
    """
    env = os.environ if environ is None else environ
    world = _env_int(env, "WORLD_SIZE", None)
    local = _env_int(env, "LOCAL_WORLD_SIZE", None)
    if world is not None and local is not None:
        return local < world
    for key in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        n = _env_int(env, key, None)
        if n is not None:
            return n > 1
    world = _env_int(env, "OMPI_COMM_WORLD_SIZE", None)
    local = _env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", None)
    if world is not None and local is not None:
        return local < world
    return None


class TopologyMixin:
    """Topology attributes for a World (which supplies ``rank`` and ``world_size``).

    A world is one node holding all its ranks until ``set_topology`` says otherwise.
    """

    @property
    def topology(self) -> Topology:
        topo = self.__dict__.get("_topology")
        if topo is None:
            topo = Topology.single_node(self.world_size)
            self.__dict__["_topology"] = topo
        return topo

    def set_topology(self, topology: Topology) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        if topology.world_size != self.world_size:
            raise ValueError(
                f"topology has {topology.world_size} ranks but the world has {self.world_size}"
            )
        self.__dict__["_topology"] = topology
        # Worlds whose reachability comes from the topology build their put mask now, not
        # lazily inside a CUDA-graph capture (NVSHMEM's world builds it after its probe).
        own_rule = type(self).peer_reachable is TopologyMixin.peer_reachable
        if own_rule and hasattr(type(self), "put_mask") and getattr(self, "device", None):
            self.put_mask  # noqa: B018

    @property
    def node(self) -> int:
        return self.topology.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank_of(self.rank)

    @property
    def local_world_size(self) -> int:
        return self.topology.local_world_size

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    def peer_reachable(self, r: int) -> bool:
        """True when this rank's kernels can store into rank ``r``'s symmetric memory."""
        return self.topology.peer_reachable(self.rank, r)

    def transport(self, r: int) -> str:
        """``"store"`` or ``"put"``: how this rank's kernels move tiles to rank ``r``."""
        return TRANSPORT_STORE if self.peer_reachable(r) else TRANSPORT_PUT
