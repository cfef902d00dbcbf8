"""ZeRO++ (Wang et al., 2023): stage 3 with its three communication cuts, each a DeepSpeed key
of `zero_optimization` that acts with `"stage": 3` (docs/zeropp.md):

    zero_quantized_weights    qwZ: a unit's parameters travel as int8 with one float32 scale
                              per block of at most WEIGHT_BLOCK elements of one tensor
                              (quantize.py): each rank quantizes its shard, the bytes are
                              allgathered, every rank dequantizes them into the gathered
                              buffer. Forward and backward gathers; the master weights and
                              the parameter shards stay exact.
    zero_quantized_gradients  qgZ: a unit's gradient is reduce-scattered by all-to-all: each
                              rank quantizes its full gradient to int4 (a scale per block of
                              at most GRAD_BLOCK elements of one tensor) in one chunk per
                              destination rank, the chunks are exchanged, and each rank sums
                              in float32 the N chunks of its shard. With hpZ groups (1 < G <
                              N) it takes the paper's two hops: inside the group (each rank
                              gets and sums the chunks of the R = N/G ranks at its position in
                              every group), then, requantized, across the groups.
    zero_hpz_partition_size   hpZ, G: besides its 1/N primary shard, a rank keeps a secondary
                              shard, 1/G of each unit, partitioned over its group of G
                              ranks of one node (cut from the node split as hybrid.py's
                              groups: consecutive ranks where ranks are placed in blocks).
                              Each forward allgather over the world leaves it: the rank
                              copies its group position's slice of the gathered unit.
                              Backward gathers on the group only; the world allgather
                              leaves backward. It costs Psi / G storage-dtype elements per
                              rank, in the ledger as "param".

Traffic per rank and step, unit of P padded elements, s = 2 bytes (fp16), N ranks, b(P/N)
the wire bytes of one rank's shard quantized (quantize.row_nbytes: values, and a scale per
block; blocks are cut where each of the unit's tensors starts):

    forward allgather   (N-1)/N P s, or qwZ (N-1) b8(P/N)                         world
    backward allgather  as forward; hpZ (G-1)/G P s                                intra (G)
    reduce-scatter      (N-1)/N P s, or qgZ (N-1) b4(P/N); two hops:
                        (G-1) R b4(P/N) inside the group + (R-1) b4(P/N), R = N/G  intra, inter

Units that read another's weights gather it once per pass each, as in stage 3. Persistent
units (`stage3_param_persistence_threshold`) keep their exact allgather after the step, and
hold no secondary shard (they are never gathered in backward).
"""
from __future__ import annotations

import warnings
from collections import Counter

import numpy as np

from zmpi import backend
from zmpi.config import ConfigError
from zmpi.parallel.mesh import node_order
from zmpi.zero.quantize import dequantize, quantize, row_nbytes
from zmpi.zero.registry import register
from zmpi.zero.stage3 import Stage3

WEIGHT_BITS, WEIGHT_BLOCK = 8, 2048  # qwZ: int8, as the paper and DeepSpeed
GRAD_BITS, GRAD_BLOCK = 4, 64  # qgZ: int4, as the paper and DeepSpeed (docs/zeropp.md: the block)
_HPZ = "zero_optimization.zero_hpz_partition_size"


class Deferred:
    """A request followed by local work: `wait()` waits for `request`, then runs `then()`
    once; `then` may start a further collective and return its request, which wait() also
    completes (qgZ's second hop). `test()` drives the request and is True only once wait()
    has run everything. Collectives start only in the caller's hooks or in wait(), at the same
    point of the step on every rank, never in test()."""

    def __init__(self, request, then):
        self._request, self._then = request, then

    def start(self) -> None:
        self._request.start()

    def test(self) -> bool:
        done = self._request.test()
        return done and self._then is None

    def wait(self) -> None:
        while True:
            self._request.wait()
            if self._then is None:
                return
            then, self._then = self._then, None
            following = then()
            if following is None:
                return
            self._request = following


@register("zeropp")
class ZeroPP(Stage3):
    zeropp = True

    @classmethod
    def process_groups(cls, comm, zero_config):
        size, offload = zero_config.zero_hpz_partition_size or 1, zero_config.offload_param
        if comm.size % size:
            raise ConfigError(_HPZ, f"{size} does not divide the {comm.size} data-parallel "
                                    "ranks into equal groups")
        if size > 1 and offload.enabled:  # refused before any buffer or file is made
            raise ConfigError(_HPZ, "hpZ keeps a secondary shard on the device, which "
                                    "offload_param is to keep free; use one of them")
        if zero_config.zero_quantized_weights and offload.nvme:  # at any world size
            raise ConfigError("zero_optimization.zero_quantized_weights",
                              'qwZ quantizes the shard in place of the allgather, which '
                              'offload_param "device": "nvme" reads from a file; use "cpu"')
        return super().process_groups(comm, zero_config)

    @classmethod
    def suite_configs(cls, world_size):
        """hpZ alone (the same bits as stage 3) and all three (within the suite's stated
        tolerance), over pairs of ranks where that makes more than one group (qgZ then takes
        two hops), else over all of them."""
        size = 2 if world_size > 2 and world_size % 2 == 0 else world_size
        return [{"zero_hpz_partition_size": size},
                {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                 "zero_hpz_partition_size": size}]

    @staticmethod
    def hpz_size(zero_config, order) -> int:
        """hpZ's group size: `zero_hpz_partition_size`, or where it is not given, the ranks
        of a node where the data-parallel ranks (`order`: their node_order, None for one
        rank) span nodes of equal size placed in blocks, the paper's setting (backward's
        gathers stay inside a node); else 1, no hpZ (on one node the group would be the
        world, costing memory only; offload_param keeps the device free of its copy; with
        round-robin placement ask for it by name)."""
        given = zero_config.zero_hpz_partition_size
        if given is not None:
            return given
        if order is None or zero_config.offload_param.enabled or len(order.sizes) == 1 \
                or len(set(order.sizes)) > 1 or not order.is_rank_order:
            return 1
        return order.sizes[0]

    def __init__(self, ctx):
        super().__init__(ctx)
        order = node_order(self.comm) \
            if self.world_size > 1 and self.config.zero_hpz_partition_size != 1 else None
        cfg, size = self.config, self.hpz_size(self.config, order)
        # one rank sends nothing: quantizing would only round (as 1-bit Adam, which skips it)
        self.qwz, self.qgz = (cfg.zero_quantized_weights and self.world_size > 1,
                              cfg.zero_quantized_gradients and self.world_size > 1)
        if size == self.world_size > 1 and self.rank == 0:
            warnings.warn(f"zmpi config: {_HPZ}: {size}, every rank of the group: backward "
                          "gathers over the same ranks and bytes, and the secondary shard "
                          "only costs memory (hpZ pays with groups smaller than the world, "
                          "a node's ranks)", stacklevel=2)
        two_hops = self.qgz and 1 < size < self.world_size
        self.intra = self.inter = None
        if size > 1:  # the groups of one node, whatever the placement (hybrid.py)
            order.check_groups(size, _HPZ)
            if two_hops and not order.is_rank_order:  # its all-to-alls are in rank order
                raise ConfigError(_HPZ, "qgZ's two hops need the ranks placed on the nodes "
                                        "in blocks (consecutive ranks on one node: mpiexec "
                                        "-ppn, srun --distribution=block), not round-robin")
            at = order.position
            self.intra = self.comm.split(at // size, key=at)
            self.inter = self.comm.split(at % size, key=at) if two_hops else None
        # qgZ's all-to-alls: (group kind, shards each destination gets)
        self._hops = [("intra", self.world_size // size), ("inter", 1)] if two_hops \
            else [("world", 1)]
        self._secondary_at, end = {}, 0  # u -> its slice of the secondary shard
        for u, unit in enumerate(self.layout.units):
            if size > 1 and u not in self._persistent:
                self._secondary_at[u] = slice(end, end + unit.padded_numel // size)
                end = self._secondary_at[u].stop
        self.secondary = self.alloc(end, self.dtype, "param", "secondary") if end else None
        self._cuts = [self._tensor_cuts(unit) for unit in self.layout.units]
        self._fresh = set()  # units whose secondary shard holds the current parameters
        self._backward = False  # gathers now are backward's (or recompute's)

    @staticmethod
    def _tensor_cuts(unit) -> tuple[int, ...]:
        """Where a tensor of the unit begins (or its padding), in any rank's shard: where the
        quantizer cuts a shard-long row, so that no scale spans two tensors."""
        n = unit.shard_numel
        starts = {slot.offset for slot in unit.slots} | {unit.numel}
        return tuple(sorted({0} | {b % n for b in starts if b < unit.padded_numel}))

    def _bucket_cuts(self, units) -> tuple[int, ...]:
        """_tensor_cuts of a bucket's shard: its units' shards one after the other."""
        cuts, start = [], 0
        for u in units:
            cuts += [start + c for c in self._cuts[u]]
            start += self.layout.units[u].shard_numel
        return tuple(cuts)

    def comms(self):
        groups = {"world": self.comm, "intra": self.intra, "inter": self.inter}
        return {kind: comm for kind, comm in groups.items() if comm is not None}

    # ---- hooks: which pass gathers ------------------------------------------------------
    def before_forward(self, u):
        self._backward = False
        super().before_forward(u)

    def before_recompute(self, u):
        self._backward = True
        super().before_recompute(u)

    def before_backward(self, u):
        self._backward = True
        super().before_backward(u)

    def publish_params(self):
        self._fresh.clear()
        super().publish_params()

    def set_state_shard(self, state, shard):
        self._fresh.clear()
        super().set_state_shard(state, shard)

    # ---- the gathers and the reduction ----------------------------------------------------
    def iallgather_unit(self, u, buf):
        if u in self._secondary_at and self._backward and u in self._fresh:
            return self.intra.iallgather(self.secondary[self._secondary_at[u]], buf)
        if self.qwz and u not in self._persistent:
            request = self._quantized_allgather(self.params_shard[self.layout.shard_slice(u)],
                                                buf, self._cuts[u])
        else:
            request = self.iallgather_shard(u, buf)
        if u not in self._secondary_at:
            return request

        def keep_secondary():  # this rank's slice of its group's partition of the unit
            m = buf.shape[0] // self.intra.size
            backend.copy_(self.secondary[self._secondary_at[u]],
                          buf[self.intra.rank * m:(self.intra.rank + 1) * m])
            self._fresh.add(u)

        return Deferred(request, keep_secondary)

    def _quantized_allgather(self, shard, buf, cuts) -> Deferred:
        """qwZ: buf (N n) <- every rank's `shard` (n), sent as int8 with block scales."""
        n, ranks = shard.shape[0], self.world_size
        row = row_nbytes(n, WEIGHT_BITS, WEIGHT_BLOCK, cuts)
        send = self.alloc(row, np.uint8, "comm_buffer", "qwz_send",
                          "host" if self.offload_param else "device", zero=False)
        quantize(shard.reshape(1, n), WEIGHT_BITS, WEIGHT_BLOCK, cuts, send.reshape(1, row))
        recv = self.alloc(ranks * row, np.uint8, "comm_buffer", "qwz_recv", zero=False)

        def dequantize_into():
            buf.reshape(ranks, n)[...] = dequantize(recv.reshape(ranks, row), n, WEIGHT_BITS,
                                                    WEIGHT_BLOCK, cuts)
            self.ledger.release(send)
            self.ledger.release(recv)

        return Deferred(self.comm.iallgather(send, recv), dequantize_into)

    def ireduce_scatter(self, units, full, part):
        if not self.qgz:
            return super().ireduce_scatter(units, full, part)
        return self._quantized_hop(full, part, self._bucket_cuts(units), 0)

    def _quantized_hop(self, x, part, cuts, hop: int) -> Deferred:
        """qgZ hop `hop`: x holds the shards (of part's length n) this rank still sums for, in
        rank order; each rank of the hop's comm gets its `outer` shards (int4, rows of n cut
        at `cuts`), sums what it received and passes the sum to the next hop, or writes it
        into `part` after the last."""
        kind, outer = self._hops[hop]
        comm, n = self.comms()[kind], part.shape[0]
        ranks = comm.size
        rows = x.reshape(outer, ranks, n).swapaxes(0, 1).reshape(ranks * outer, n)
        row = row_nbytes(n, GRAD_BITS, GRAD_BLOCK, cuts)
        send = self.alloc(ranks * outer * row, np.uint8, "comm_buffer", "qgz_send", zero=False)
        quantize(rows, GRAD_BITS, GRAD_BLOCK, cuts, send.reshape(ranks * outer, row))
        recv = self.alloc(ranks * outer * row, np.uint8, "comm_buffer", "qgz_recv", zero=False)

        def reduce():
            last = hop + 1 == len(self._hops)
            with np.errstate(invalid="ignore", over="ignore"):  # an fp16 overflow stays inf
                got = dequantize(recv.reshape(ranks * outer, row), n, GRAD_BITS, GRAD_BLOCK,
                                 cuts)
                total = got.reshape(ranks, outer * n).sum(axis=0)
                if last:
                    part[...] = total
            self.ledger.release(send)
            self.ledger.release(recv)
            return None if last else self._quantized_hop(total, part, cuts, hop + 1)

        return Deferred(comm.ialltoall(send, recv), reduce)

    # ---- declarations -------------------------------------------------------------------
    def expected_model_state(self):
        held = super().expected_model_state()
        if self.secondary is not None:
            held["device"]["param"] += self.secondary.nbytes
        return held

    def expected_traffic(self):
        """Bytes sent per step (module docstring), per group kind."""
        reads = Counter(w for u in range(len(self.units)) for w in self.needs(u))
        comms = self.comms()
        sent = dict.fromkeys(comms, 0)
        for w, unit in enumerate(self.layout.units):
            numel = unit.padded_numel
            n, cuts = unit.shard_numel, self._cuts[w]
            world = (self.world_size - 1) * row_nbytes(n, WEIGHT_BITS, WEIGHT_BLOCK, cuts) \
                if self.qwz else self.ring_bytes(numel)
            if w in self._persistent:  # one exact allgather after the step
                sent["world"] += self.ring_bytes(numel)
            elif w in self._secondary_at:  # forward over the world, backward in the group
                sent["world"] += reads[w] * world
                sent["intra"] += reads[w] * self.ring_bytes(numel, comm=self.intra)
            else:
                sent["world"] += 2 * reads[w] * world
            if not self.qgz:
                sent["world"] += self.ring_bytes(numel)
                continue
            for kind, outer in self._hops:  # each hop sends all but its own `outer` rows
                sent[kind] += (comms[kind].size - 1) * outer * row_nbytes(n, GRAD_BITS,
                                                                          GRAD_BLOCK, cuts)
        return sent
