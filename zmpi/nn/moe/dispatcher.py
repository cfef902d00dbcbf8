"""The token dispatcher: from the router's decisions to the experts' inputs and back.

`dispatch` permutes the kept (token, choice) assignments into expert-major rows (expert 0's
rows first; within an expert, by group then slot, the order of a capacity buffer), `combine`
adds each token's expert outputs, times their weights, back in token order. Both directions
are gathers (each row comes from one token, each token from at most k rows), so they are
deterministic and need no scatter-add on either backend.

This dispatcher is the single-process one: every expert is here. It is the seam expert
parallelism plugs into: zmpi.parallel.expert's dispatcher, with this interface, sends each
rank's rows of the experts another rank holds between `dispatch` and the experts (an
all-to-all of capacity buffers), and returns the outputs the same way before `combine`; the
router and the experts do not change.
"""

from typing import NamedTuple

from zmpi.backend import array_module


class Permutation(NamedTuple):
    """Where each expert row comes from and goes back to, for M kept assignments.

    row_token (M,): the token of each row; row_choice (M,): its flat index t * k + j into the
    routing's (N, k) arrays; row_of (N, k): each assignment's row, M (a zero row appended
    by the gathers) where dropped; counts: rows per expert, a host list (the experts slice
    their rows by it). A tuple, so that a layer's cache holding it counts its arrays.
    """

    row_token: object
    row_choice: object
    row_of: object
    counts: list


class TokenDispatcher:
    """Moves tokens between token order (N, C) and expert order (M, C) for one process."""

    def dispatch(self, x, routing):
        """x (N, C) -> (rows (M, C), Permutation)."""
        xp, (N, k) = array_module(x), routing.experts.shape
        E, G, cap = routing.num_experts, routing.groups, routing.capacity
        group = (xp.arange(N) // routing.group_size)[:, None]
        key = (routing.experts * G + group) * cap + routing.slot  # expert, group, slot
        key = xp.where(routing.kept, key, E * G * cap).ravel()  # dropped ones last
        counts = xp.bincount(routing.experts[routing.kept].ravel(), minlength=E)
        counts = [int(c) for c in counts.tolist()]  # one device -> host transfer
        M = sum(counts)
        row_choice = xp.argsort(key)[:M]
        row_of = xp.full(N * k, M, dtype=xp.int64)
        row_of[row_choice] = xp.arange(M)
        row_token = row_choice // k
        return x[row_token], Permutation(row_token, row_choice, row_of.reshape(N, k), counts)

    @staticmethod
    def _padded(rows):
        """rows (M, C) with a zero row appended: what a dropped assignment gathers."""
        xp = array_module(rows)
        return xp.concatenate([rows, xp.zeros((1, rows.shape[1]), rows.dtype)])

    def dispatch_backward(self, drows, perm):
        """drows (M, C) -> dx (N, C): each token's rows' gradients summed."""
        padded = self._padded(drows)
        dx = padded[perm.row_of[:, 0]]
        for j in range(1, perm.row_of.shape[1]):
            dx += padded[perm.row_of[:, j]]
        return dx

    def combine(self, out, perm, weights):
        """out (M, C) expert outputs -> y (N, C) = sum over a token's kept choices of weight *
        output; a token with every choice dropped gets 0 (the block's residual carries it)."""
        padded = self._padded(out)
        w = weights.astype(out.dtype, copy=False)
        y = padded[perm.row_of[:, 0]] * w[:, :1]
        for j in range(1, perm.row_of.shape[1]):
            y += padded[perm.row_of[:, j]] * w[:, j:j + 1]
        return y

    def combine_backward(self, dy, out, perm, weights):
        """dy (N, C) -> (dout (M, C), dweights (N, k), 0 where dropped)."""
        w = weights.astype(dy.dtype, copy=False).ravel()[perm.row_choice]
        dout = dy[perm.row_token] * w[:, None]
        padded = self._padded(out)
        dweights = (padded[perm.row_of] * dy[:, None, :]).sum(axis=2)  # (N, k)
        return dout, dweights
