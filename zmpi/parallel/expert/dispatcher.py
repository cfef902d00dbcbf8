"""The expert-parallel token dispatcher: the MoE layer's rows sent to the rank that holds their
expert with all-to-all, and the experts' outputs sent back (GShard, DeepSpeed-MoE).

Over an expert-parallel Comm `ep` of P ranks, rank j holds the experts j E/P .. (j+1) E/P - 1
(E_l = E / P of them) and routes its own tokens: G routing groups, each expert keeping at most
`capacity` assignments of a group. Its kept rows (zmpi.nn.moe.TokenDispatcher's order: expert,
group, slot) are placed in a capacity buffer

    send (E, G, capacity, C)   row (e, g, s): the assignment in slot s of expert e in group g;
                               zeros where the slot is empty (fewer assignments than capacity)

whose blocks of E_l experts go one to each rank by one all-to-all. Rank j then holds, for each
of its E_l experts, the P ranks' buffers, (E_l, P, G, capacity, C), and runs its experts on
every row of them, empty slots included (their zeros' outputs are never read, and their
gradients are exactly zero); the outputs go back by the reverse all-to-all into the sender's
buffer order, and the layer's combine reads each kept assignment's row there. Backward is the
same two exchanges in reverse: the outputs' gradients to the experts, the rows' gradients back.

Traffic per MoE layer per rank and step, on `ep`'s counters: 4 all-to-alls (2 forward:
dispatch, combine; 2 backward), each of E x G x capacity x C elements, of which the share
(P-1)/P leaves the rank ('alltoall' bytes and sent, zmpi.comm.wire). With drop_tokens the
capacity is the layer's (the same on every rank: it depends on the group size only); dropless,
it is the largest number of assignments any expert received from any group of any rank of `ep`
(one allreduce_scalar of the max per forward, as DeepSpeed does), so the buffers stay equal.

Contract (as for every collective): every rank of `ep` routes the same number of tokens with
the same routing options. The router, the combine weights and every dense part of the layer
stay on the token's rank; only the experts' rows travel.
"""

from typing import NamedTuple

from zmpi.backend import array_module, compute_dtype
from zmpi.nn.moe.dispatcher import Permutation, TokenDispatcher
from zmpi.parallel.expert.groups import check_experts


class ExpertPermutation(NamedTuple):
    """What one forward of the expert-parallel dispatcher keeps for the rest of the layer.

    tokens: the token side's Permutation (TokenDispatcher's, over this rank's M kept rows);
    position (M,): each kept row's place in the (E G capacity) capacity buffer;
    returned (M, C): the experts' outputs of this rank's kept rows, written by `combine` (what
    `combine_backward` needs for the weights' gradient), in the activations' compute dtype;
    block: G capacity, the rows of one expert in one rank's buffer;
    counts: rows per local expert, E_l x [P block] (what the local Experts split by).
    A tuple, so that the layer's cache holding it counts its arrays.
    """

    tokens: Permutation
    position: object
    returned: object
    block: int
    counts: list


class ExpertParallelDispatcher:
    """zmpi.nn.moe.TokenDispatcher's interface, with the experts spread over the Comm `ep`:
    `dispatch` returns the rows of this rank's E / ep.size experts gathered from every rank of
    `ep`, and `combine` takes those experts' outputs (see the module's doc).

    num_experts: the layer's E (ep.size must divide it); drop_tokens: the router's (False:
    the capacity buffers are sized by the busiest expert of the group).
    """

    def __init__(self, ep, num_experts: int, drop_tokens: bool = True):
        self.local_experts = check_experts(num_experts, ep.size)
        self.ep, self.num_experts, self.drop_tokens = ep, num_experts, drop_tokens
        self.tokens = TokenDispatcher()

    # -- the two exchanges --------------------------------------------------------------------
    def _to_experts(self, buf):
        """All-to-all of this rank's capacity buffer (E, B, C), B = G capacity, to the ranks
        holding each expert: -> (E_l P B, C), local-expert major, then source rank."""
        xp, P, (_, B, C) = array_module(buf), self.ep.size, buf.shape
        recv = xp.empty_like(buf)
        self.ep.alltoall(buf, recv)
        rows = recv.reshape(P, self.local_experts, B, C).transpose(1, 0, 2, 3)
        return xp.ascontiguousarray(rows).reshape(-1, C)

    def _to_tokens(self, rows, block: int):
        """The reverse of `_to_experts`: rows (E_l P B, C) of the local experts -> this rank's
        capacity buffer (E, B, C), each row back at the place it was sent from."""
        xp, P, C = array_module(rows), self.ep.size, rows.shape[-1]
        send = rows.reshape(self.local_experts, P, block, C).transpose(1, 0, 2, 3)
        send = xp.ascontiguousarray(send).reshape(self.num_experts, block, C)
        recv = xp.empty_like(send)
        self.ep.alltoall(send, recv)
        return recv

    def _buffer(self, compact, perm: ExpertPermutation, block: int):
        """The capacity buffer (E, block, C) holding the M `compact` rows at their places,
        zeros elsewhere."""
        xp, C = array_module(compact), compact.shape[1]
        buf = xp.zeros((self.num_experts * block, C), dtype=compact.dtype)
        buf[perm.position] = compact
        return buf.reshape(self.num_experts, block, C)

    def _capacity(self, routing) -> int:
        """The capacity the buffers are sized by: the layer's, or dropless the largest over
        `ep` (the same on every rank either way)."""
        if self.drop_tokens or self.ep.size == 1:
            return routing.capacity
        return int(self.ep.allreduce_scalar(routing.capacity, "max"))

    # -- TokenDispatcher's interface ----------------------------------------------------------
    def dispatch(self, x, routing):
        """x (N, C) -> (rows (E_l P G capacity, C) for the local experts, ExpertPermutation)."""
        if routing.num_experts != self.num_experts:
            raise ValueError(f"routing over {routing.num_experts} experts, but this dispatcher "
                             f"spreads {self.num_experts} over ep={self.ep.size}")
        xp = array_module(x)
        compact, tokens = self.tokens.dispatch(x, routing)
        G, capacity = routing.groups, self._capacity(routing)
        choice = tokens.row_choice
        group = tokens.row_token // routing.group_size
        expert, slot = routing.experts.ravel()[choice], routing.slot.ravel()[choice]
        position = (expert * G + group) * capacity + slot
        block = G * capacity
        perm = ExpertPermutation(tokens, position, xp.empty(compact.shape, compute_dtype(x)),
                                 block, [self.ep.size * block] * self.local_experts)
        return self._to_experts(self._buffer(compact, perm, block)), perm

    def combine(self, out, perm: ExpertPermutation, weights):
        """out (E_l P G capacity, C), the local experts' outputs -> y (N, C) of this rank's
        tokens (TokenDispatcher.combine of the rows sent back)."""
        if out.dtype != perm.returned.dtype:
            raise ValueError(f"the experts' outputs are {out.dtype} but the activations compute "
                             f"in {perm.returned.dtype}: expert parallelism needs them alike")
        back = self._to_tokens(out, perm.block).reshape(-1, out.shape[1])
        perm.returned[...] = back[perm.position]
        return self.tokens.combine(perm.returned, perm.tokens, weights)

    def combine_backward(self, dy, out, perm: ExpertPermutation, weights):
        """dy (N, C) -> (dout (E_l P G capacity, C) for the local experts, dweights (N, k)).
        `out` (the local experts' outputs) is not needed: the weights' gradient reads the
        outputs this rank's rows got back (`perm.returned`)."""
        dcompact, dweights = self.tokens.combine_backward(dy, perm.returned, perm.tokens,
                                                          weights)
        return self._to_experts(self._buffer(dcompact, perm, perm.block)), dweights

    def dispatch_backward(self, drows, perm: ExpertPermutation):
        """drows (E_l P G capacity, C), the local experts' input gradients -> dx (N, C)."""
        back = self._to_tokens(drows, perm.block).reshape(-1, drows.shape[1])
        return self.tokens.dispatch_backward(back[perm.position], perm.tokens)
