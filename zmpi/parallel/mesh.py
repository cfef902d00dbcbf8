"""The process mesh: data x pipeline x tensor parallelism over the world communicator.

    mesh = Mesh(comm, tp=2, pp=2)          # 8 ranks: dp = 8 / (2 * 2) = 2
    mesh.dp, mesh.pp, mesh.tp              # sizes
    mesh.dp_rank, mesh.pp_rank, mesh.tp_rank
    mesh.dp_comm, mesh.pp_comm, mesh.tp_comm   # zmpi Comms of this rank's groups
    mesh.prev_rank, mesh.next_rank         # pipeline neighbours (world ranks; None at the ends)

Rank order is DeepSpeed's `PipeModelDataParallelTopology` and Megatron-LM's: tensor fastest,
then data, then pipeline, so the ranks of one tensor group are neighbours (on a cluster they
share a node, where tensor parallelism's per-layer allreduces belong):

    world rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Each dimension has its own Comm, so every collective counts in its own dimension's counters.
A dimension that spans the whole world is the world Comm itself, and one of size 1 is this
rank alone (MPI_COMM_SELF): a plain data-parallel run (tp = pp = 1) communicates exactly as
it did before the mesh existed. Only groups that are neither are made with `Comm.split`; the
mesh frees them in `free()` (Engine.close() calls it).

Expert parallelism (`ep`, mixture-of-experts layers: docs/moe.md) is not a fourth factor of
the world but a split of the data-parallel ranks (DeepSpeed-MoE's): with ep dividing dp,

    mesh.experts.ep_comm    the ep consecutive data ranks that hold every expert between them
                            (E / ep each) and exchange tokens by all-to-all
    mesh.experts.edp_comm   the dp / ep data ranks that hold the same experts: the expert
                            parameters' data-parallel group (zmpi.parallel.expert.groups)

`mesh.experts` is None at ep 1, where every data rank holds every expert.
"""
from __future__ import annotations

from dataclasses import dataclass

from zmpi.words import count

DIMENSIONS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Coordinates:
    """Where world rank `rank` sits in a (dp, pp, tp) mesh, and its groups' colors."""

    dp_rank: int
    pp_rank: int
    tp_rank: int

    @classmethod
    def of(cls, rank: int, dp: int, pp: int, tp: int) -> Coordinates:
        return cls(dp_rank=(rank // tp) % dp, pp_rank=rank // (dp * tp), tp_rank=rank % tp)

    def group(self, dim: str, dp: int, pp: int, tp: int) -> int:
        """The color of this rank's `dim` group: equal for the ranks that differ only in
        their `dim` coordinate."""
        return {"dp": self.pp_rank * tp + self.tp_rank,
                "pp": self.dp_rank * tp + self.tp_rank,
                "tp": self.pp_rank * dp + self.dp_rank}[dim]


def mesh_sizes(size: int, tp: int = 1, pp: int = 1) -> tuple[int, int, int]:
    """(dp, pp, tp) for `size` ranks; ValueError unless tp * pp divides size."""
    for name, value in (("tp", tp), ("pp", pp)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if size % (tp * pp):
        raise ValueError(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the "
                         f"{count(size, 'rank')} into data-parallel replicas")
    return size // (tp * pp), pp, tp


@dataclass(frozen=True)
class NodeOrder:
    """A communicator's ranks ordered node by node (`node_order`): `position` is this rank's
    place in that order, `ranks` the communicator's ranks in it, `sizes` the ranks of each
    node (nodes in the order of their lowest rank). With ranks placed on nodes in blocks
    (`mpiexec -ppn`, Slurm's `--distribution=block`) the order is the ranks' own."""

    position: int
    ranks: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def is_rank_order(self) -> bool:
        return self.ranks == tuple(range(len(self.ranks)))

    def check_groups(self, size: int, key: str) -> None:
        """ConfigError naming `key` unless every group of `size` consecutive positions lies
        on one node or is made of whole nodes (the ranks per node, in order, and the
        placement flag in the message)."""
        from zmpi.config import ConfigError

        node_of = [n for n, ranks in enumerate(self.sizes) for _ in range(ranks)]
        for start in range(0, len(node_of), size):
            nodes = set(node_of[start:start + size])
            if len(nodes) > 1 and sum(self.sizes[n] for n in nodes) != size:
                raise ConfigError(key, f"groups of {count(size, 'rank')} would span nodes "
                                       "without holding them whole: the nodes hold "
                                       f"{', '.join(map(str, self.sizes))} ranks; give a "
                                       "group size that divides each node's ranks, or "
                                       "place the same number of ranks on every node "
                                       "(mpiexec -ppn, srun --ntasks-per-node)")


def node_order(comm) -> NodeOrder:
    """Collective over `comm` (a zmpi Comm): its ranks ordered node by node, from MPI's
    shared-memory split (MPI_COMM_TYPE_SHARED: the ranks that share a node). Groups that must
    stay inside a node (hybrid sharding's shard groups, hpZ's) are cut from this order, not
    from the ranks' numbers, which a launcher may deal out to the nodes round-robin."""
    from zmpi.comm import MPI

    local = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        node = local.allreduce(comm.rank, op=MPI.MIN)  # the node's lowest rank names it
    finally:
        local.Free()
    nodes = comm.allgather_object(node)
    ranks = tuple(sorted(range(comm.size), key=lambda r: (nodes[r], r)))
    leaders = sorted(set(nodes))
    return NodeOrder(position=ranks.index(comm.rank), ranks=ranks,
                     sizes=tuple(nodes.count(n) for n in leaders))


class Mesh:
    """dp x pp x tp over `comm` (the world): sizes, this rank's coordinates, its three groups
    as zmpi Comms and its pipeline neighbours. Constructing it is collective over `comm`."""

    def __init__(self, comm, tp: int = 1, pp: int = 1, ep: int = 1):
        from zmpi.parallel.expert import check_expert_layout, expert_groups

        self.comm = comm
        self.dp, self.pp, self.tp = mesh_sizes(comm.size, tp, pp)
        check_expert_layout(self.dp, ep)  # before any split: ValueError alike on every rank
        self.ep = ep
        here = Coordinates.of(comm.rank, self.dp, self.pp, self.tp)
        self.dp_rank, self.pp_rank, self.tp_rank = here.dp_rank, here.pp_rank, here.tp_rank
        self._made = []  # the split Comms this mesh owns
        for dim in DIMENSIONS:
            setattr(self, f"{dim}_comm", self._group(dim, here))
        step = self.dp * self.tp  # world ranks between neighbouring pipeline stages
        self.prev_rank = comm.rank - step if self.pp_rank > 0 else None
        self.next_rank = comm.rank + step if self.pp_rank < self.pp - 1 else None
        self.experts = expert_groups(self.dp_comm, ep) if ep > 1 else None

    def _group(self, dim: str, here: Coordinates):
        size = getattr(self, dim)
        if size == self.comm.size:
            return self.comm
        if size == 1:
            from zmpi.comm import MPI, Comm

            sub = Comm(MPI.COMM_SELF)
        else:
            sub = self.comm.split(here.group(dim, self.dp, self.pp, self.tp))
        self._made.append(sub)
        return sub

    def comms(self) -> dict:
        """{dimension: its Comm}, for the counters per dimension; at ep > 1 also "ep" and
        "edp", the expert groups (inside dp)."""
        dims = {dim: getattr(self, f"{dim}_comm") for dim in DIMENSIONS}
        return dims if self.experts is None else {**dims, **self.experts.comms()}

    def free(self) -> None:
        """Free the sub-communicators this mesh made (a collective over each)."""
        if self.experts is not None:
            self.experts.free()
        while self._made:
            self._made.pop().free()

    def describe(self) -> dict:
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        return sizes if self.ep == 1 else {**sizes, "ep": self.ep}

    def __repr__(self) -> str:
        ep = "" if self.ep == 1 else f", ep={self.ep}"
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}{ep}; rank {self.comm.rank} at "
                f"dp {self.dp_rank}, pp {self.pp_rank}, tp {self.tp_rank})")
