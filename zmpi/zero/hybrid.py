"""Hybrid sharding: ZeRO inside groups of G ranks, plain data parallelism across the groups.

PyTorch FSDP's HYBRID_SHARD (HSDP) and _HYBRID_SHARD_ZERO2; MiCS (Zhang et al., VLDB'22) and
ZeRO++'s hpZ (Wang et al., 2023) partition within a node for the same reason: the collectives
of ZeRO-3 run on every layer, so keep them on the fast links of one node and let only one
gradient allreduce per step cross the slow network.

The N ranks form N/G *shard groups* of G ranks of one node (or of G/n whole nodes of n ranks)
and G *replica groups* (the ranks at the same position in every shard group), both made with
`Comm.split`. The groups are cut from the ranks ordered node by node (MPI's shared-memory
split, zmpi.parallel.mesh.node_order), not from the ranks' numbers: with ranks placed on nodes
in blocks (`mpiexec -ppn`) a shard group is G consecutive ranks, and with round-robin placement
it is still one node's (consecutive ranks would span every node, and ZeRO-3's collectives with
them). A group size that would split a node's ranks between groups that span nodes (nodes of
3 and 1 ranks in groups of 2) is refused, naming the placement flag. Config:
`"zero_optimization": {"strategy": "hybrid", "shard_group_size": G}`; without
`shard_group_size`, G is the number of ranks on a node.

    hybrid        ZeRO-3 inside the group: params, grads, master and Adam states 1/G per rank
    hybrid_zero2  ZeRO-2 inside the group: params whole, everything else 1/G per rank

Everything runs as in the stage, on the shard group (the layout is built for G ranks), and
one collective is added: at the step each rank allreduces its reduced gradient shard with its
replicas, so every replica of a shard updates it with the gradient summed over all N ranks.
Traffic per rank and step (ring model, Psi the padded model, R = N/G):

    shard group     3 Psi (G-1)/G (hybrid; 2 Psi (G-1)/G for hybrid_zero2), inside a node
    replica group   2 (Psi/G) (R-1)/R, across nodes

ZeRO-3 over all N ranks sends 3 Psi (N-1)/N, most of it across nodes; the price of hybrid
sharding is memory: model states shrink by G, not by N. G = 1 is data parallelism (DDP) and
G = N is ZeRO-3 (ZeRO-2). A checkpoint holds G shards, written by the first replica group.
"""
from zmpi.config import ConfigError
from zmpi.parallel.mesh import node_order
from zmpi.words import count
from zmpi.zero.registry import register
from zmpi.zero.stage2 import Stage2
from zmpi.zero.stage3 import Stage3

_KEY = "zero_optimization.shard_group_size"


class HybridSharding:
    """The hybrid policy over a ZeRO stage (a mixin: put it before the stage's class)."""

    @classmethod
    def process_groups(cls, comm, zero_config):
        size = zero_config.shard_group_size or comm.local_size
        low, high = (comm.allreduce_scalar(size, op) for op in ("min", "max"))
        if low != high:  # every rank sees the same values, so every rank raises
            raise ConfigError(_KEY, f"the ranks disagree on the group size ({low:g} to "
                                    f"{high:g} ranks per node); set it explicitly")
        if comm.size % size:
            raise ConfigError(_KEY, f"{size} does not divide the {count(comm.size, 'rank')} "
                                    "into equal shard groups")
        order = node_order(comm)
        order.check_groups(size, _KEY)
        at = order.position
        return comm.split(at // size, key=at), comm.split(at % size, key=at)

    @classmethod
    def suite_configs(cls, world_size):  # every group size: 1 is DDP, world_size is ZeRO-3
        return [{"shard_group_size": g} for g in range(1, world_size + 1) if world_size % g == 0]

    def before_step(self):
        super().before_step()
        self.replica.allreduce(self.grads_shard)  # the one collective across groups

    def expected_traffic(self):
        (inside,) = super().expected_traffic().values()
        return {"shard": inside,
                "replica": self.ring_bytes(self.layout.shard_numel, 2, self.replica)}


@register("hybrid")
class Hybrid(HybridSharding, Stage3):
    pass


@register("hybrid_zero2")
class HybridZero2(HybridSharding, Stage2):
    pass
