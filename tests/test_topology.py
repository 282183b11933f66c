"""Two-level topology math (``moe_overlap.world.topology``): pure Python, no GPU.

Every placement of 1..4 nodes with 1..4 ranks each is checked against an independent brute-force
model (node = hostname index, local rank = position among same-host ranks), for torchrun
numbering and for shuffled host lists; uneven or malformed inputs must raise before anything
else happens.
"""

from __future__ import annotations

import random

import pytest

from moe_overlap.world.topology import (
    TRANSPORT_PUT,
    TRANSPORT_STORE,
    Topology,
    TopologyMixin,
    spans_nodes_from_env,
)

SIZES = [(n, L) for n in range(1, 5) for L in range(1, 5)]


def _model(hosts):
    """Brute force: (node, local rank) of every rank from a host list."""
    order = []
    for h in hosts:
        if h not in order:
            order.append(h)
    node = [order.index(h) for h in hosts]
    local = [sum(1 for q in range(r) if hosts[q] == hosts[r]) for r in range(len(hosts))]
    return node, local


def _check_against_model(topo: Topology, hosts):
    node, local = _model(hosts)
    W = len(hosts)
    assert topo.world_size == W
    assert topo.num_nodes == len(set(hosts))
    assert topo.local_world_size == W // topo.num_nodes
    assert topo.multi_node == (topo.num_nodes > 1)
    for r in range(W):
        assert topo.node_of(r) == node[r]
        assert topo.local_rank_of(r) == local[r]
        assert topo.rank_of(node[r], local[r]) == r
        assert r in topo.ranks_of_node(node[r])
        for d in range(W):
            same = hosts[r] == hosts[d]
            assert topo.same_node(r, d) == same
            assert topo.peer_reachable(r, d) == same
            assert topo.transport(r, d) == (TRANSPORT_STORE if same else TRANSPORT_PUT)
        assert topo.transports(r) == tuple(topo.transport(r, d) for d in range(W))
        assert topo.reachable_mask(r) == tuple(hosts[r] == hosts[d] for d in range(W))
    # The nodes partition the ranks, each in rank order.
    allr = [r for n in range(topo.num_nodes) for r in topo.ranks_of_node(n)]
    assert sorted(allr) == list(range(W))
    for n in range(topo.num_nodes):
        ranks = topo.ranks_of_node(n)
        assert list(ranks) == sorted(ranks)
        assert len(ranks) == topo.local_world_size


@pytest.mark.parametrize("nodes,L", SIZES)
def test_torchrun_numbering(nodes, L):
    W = nodes * L
    topo = Topology.from_local_world_size(W, L)
    hosts = [f"node{r // L}" for r in range(W)]
    _check_against_model(topo, hosts)
    assert topo == Topology.from_hostnames(hosts)
    assert topo.ranks_of_node(nodes - 1) == tuple(range((nodes - 1) * L, W))
    assert topo.node_ids == tuple(r // L for r in range(W))


@pytest.mark.parametrize("nodes,L", SIZES)
@pytest.mark.parametrize("seed", [0, 1])
def test_hostnames_any_placement(nodes, L, seed):
    rng = random.Random(seed * 100 + nodes * 10 + L)
    hosts = [f"h-{n}.cluster" for n in range(nodes) for _ in range(L)]
    rng.shuffle(hosts)
    topo = Topology.from_hostnames(hosts)
    _check_against_model(topo, hosts)
    # Node ids follow first appearance, so rank 0 is always on node 0.
    assert topo.node_of(0) == 0


def test_single_node_and_from_node_ids():
    for W in (1, 2, 7, 64):
        topo = Topology.single_node(W)
        assert (topo.num_nodes, topo.local_world_size, topo.multi_node) == (1, W, False)
        assert all(topo.transport(0, d) == TRANSPORT_STORE for d in range(W))
    topo = Topology.from_node_ids([1, 0, 1, 0, 2, 2])
    assert topo.ranks_of_node(0) == (1, 3)
    assert topo.ranks_of_node(1) == (0, 2)
    assert topo.local_rank_of(5) == 1
    assert topo.transport(4, 5) == TRANSPORT_STORE
    assert topo.transport(0, 1) == TRANSPORT_PUT


@pytest.mark.parametrize(
    "hosts,match",
    [
        (["a", "a", "b"], r"same number of ranks.*node 0: 2, node 1: 1.*'a': 2, 'b': 1"),
        (["a", "b", "b", "b", "c", "c"], r"same number of ranks"),
        (["a", "a", "a", "b", "b", "c", "c", "c"], r"same number of ranks"),
        (["a", ""], r"hostnames\[1\] must be a non-empty str"),
        (["a", None], r"hostnames\[1\] must be a non-empty str"),
        ([], r"hostnames is empty"),
    ],
)
def test_hostnames_rejected(hosts, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_hostnames(hosts)


@pytest.mark.parametrize("bad", ["node0", b"ab", 3, None, {"a": 1}])
def test_hostnames_type(bad):
    with pytest.raises(TypeError, match="hostnames must be a sequence of str"):
        Topology.from_hostnames(bad)


@pytest.mark.parametrize(
    "W,L,exc,match",
    [
        (6, 4, ValueError, r"not a multiple of local_world_size"),
        (7, 2, ValueError, r"not a multiple"),
        (2, 4, ValueError, r"exceeds world_size"),
        (0, 1, ValueError, r"world_size must be >= 1"),
        (4, 0, ValueError, r"local_world_size must be >= 1"),
        (4, -2, ValueError, r"local_world_size must be >= 1"),
        (4.0, 2, TypeError, r"world_size must be an int"),
        (4, "2", TypeError, r"local_world_size must be an int"),
        (True, 1, TypeError, r"world_size must be an int"),
    ],
)
def test_local_world_size_rejected(W, L, exc, match):
    with pytest.raises(exc, match=match):
        Topology.from_local_world_size(W, L)


@pytest.mark.parametrize(
    "ids,match",
    [
        ([0, 2], r"without gaps; nodes \[1\]"),
        ([1, 1], r"without gaps; nodes \[0\]"),
        ([0, 0, 1], r"same number of ranks"),
        ([0, -1], r"must be >= 0"),
        ([], r"at least one rank"),
    ],
)
def test_node_ids_rejected(ids, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_node_ids(ids)


def test_queries_validate_ranks():
    topo = Topology.from_local_world_size(4, 2)
    for bad in (-1, 4, 100):
        with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
            topo.node_of(bad)
        with pytest.raises(ValueError, match=r"must be in \[0, 4\)"):
            topo.transport(0, bad)
    with pytest.raises(TypeError, match="rank must be an int"):
        topo.local_rank_of(1.0)
    with pytest.raises(ValueError, match=r"node must be in \[0, 2\)"):
        topo.ranks_of_node(2)
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, 2\)"):
        topo.rank_of(1, 2)


def test_immutable_and_hashable():
    topo = Topology.from_local_world_size(4, 2)
    with pytest.raises(AttributeError):
        topo.node_ids = (0, 0, 0, 0)
    assert {topo: 1}[Topology.from_node_ids([0, 0, 1, 1])] == 1


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, False),
        ({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, False),
        ({"SLURM_NNODES": "2"}, True),
        ({"SLURM_JOB_NUM_NODES": "1"}, False),
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, False),
        ({"WORLD_SIZE": "4"}, None),
        ({}, None),
        # torchrun's variables win over a stale Slurm allocation size.
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "SLURM_NNODES": "4"}, False),
    ],
)
def test_spans_nodes_from_env(env, expected):
    assert spans_nodes_from_env(env) is expected


def test_env_values_checked():
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='eight' is not an int"):
        spans_nodes_from_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "eight"})
    assert Topology.from_env(environ={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}).num_nodes == 2
    assert Topology.from_env(environ={"WORLD_SIZE": "3"}).num_nodes == 1
    assert Topology.from_env(world_size=6, environ={"LOCAL_WORLD_SIZE": "2"}).num_nodes == 3
    with pytest.raises(ValueError, match="not a multiple"):
        Topology.from_env(environ={"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})


class _FakeWorld(TopologyMixin):
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


@pytest.mark.parametrize("nodes,L", [(1, 1), (1, 4), (2, 2), (3, 2), (4, 1)])
def test_mixin(nodes, L):
    W = nodes * L
    for r in range(W):
        w = _FakeWorld(r, W)
        # Default: one node holding every rank.
        assert (w.node, w.local_rank, w.local_world_size, w.num_nodes) == (0, r, W, 1)
        assert all(w.peer_reachable(d) for d in range(W))
        w.set_topology(Topology.from_local_world_size(W, L))
        assert (w.node, w.local_rank, w.local_world_size, w.num_nodes) == (r // L, r % L, L, nodes)
        for d in range(W):
            assert w.peer_reachable(d) == (d // L == r // L)
            assert w.transport(d) == (TRANSPORT_STORE if d // L == r // L else TRANSPORT_PUT)


def test_mixin_rejects_wrong_topology():
    w = _FakeWorld(0, 4)
    with pytest.raises(ValueError, match="topology has 2 ranks but the world has 4"):
        w.set_topology(Topology.single_node(2))
    with pytest.raises(TypeError, match="topology must be a Topology"):
        w.set_topology([0, 0, 1, 1])


def test_world_integration():
    """Once ``World`` inherits the mixin, every emulated world is one node."""
    from moe_overlap.testing import spawn
    from moe_overlap.world import World

    if not issubclass(World, TopologyMixin):
        pytest.skip("moe_overlap.world.base.World does not inherit TopologyMixin yet")

    def body(w):
        return (
            w.node,
            w.local_rank,
            w.local_world_size,
            w.num_nodes,
            [w.peer_reachable(d) for d in range(w.world_size)],
        )

    got = spawn(3, body)
    assert got == [(0, r, 3, 1, [True] * 3) for r in range(3)]
