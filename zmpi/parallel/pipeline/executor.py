"""Runs a pipeline stage's share of a training step: the schedule's forwards and backwards of
m micro-batches, with activations and their gradients sent point-to-point to the neighbouring
stages through the mesh's pipeline Comm (non-blocking sends, counted and watched like every
message).

    run = StageRunner(stage, mesh.pp_comm, "1f1b")
    loss_sum = run.train(micro_batches, normalizer, scale)   # 0.0 but on the last stage
    loss = run.evaluate(inputs, targets, normalizer)         # likewise

Stage s receives micro-batch i's input from stage s - 1 (stage 0 takes it from the batch),
runs its units forward, and sends the output to stage s + 1 (the last stage computes the
loss instead). Backward receives the gradient of that output from stage s + 1 (the last
stage starts from the loss), runs its units backward and sends the input's gradient back.
Between a micro-batch's forward and its backward its saved activations are set aside
(`Module.take_caches`), so several micro-batches are in flight: all m under GPipe, at most
p - s under 1F1B.

Shapes are agreed once a step: before the first activation a stage sends a small header (the
activation's dtype and shape); every micro-batch of a step has the same. A gradient travels
back in its activation's dtype and shape.
"""
from __future__ import annotations

import time

import numpy as np

from zmpi import backend
from zmpi.backend import array_module
from zmpi.parallel.pipeline.schedule import schedule

HEADER, ACTIVATION, GRADIENT = 1, 2, 3  # message tags
DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_DIMS = 6


def encode_header(a) -> np.ndarray:
    """(dtype code, ndim, shape...) of array `a` as int64[2 + MAX_DIMS]."""
    if a.ndim > MAX_DIMS or a.dtype.name not in DTYPES:
        raise ValueError(f"a pipeline stage's output must be a float array of at most "
                         f"{MAX_DIMS} dimensions, got {a.dtype.name} {a.shape}")
    header = np.zeros(2 + MAX_DIMS, np.int64)
    header[:2] = DTYPES.index(a.dtype.name), a.ndim
    header[2:2 + a.ndim] = a.shape
    return header


def decode_header(header: np.ndarray):
    """(dtype, shape) of a header."""
    code, ndim = int(header[0]), int(header[1])
    if DTYPES[code] == "bfloat16":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(DTYPES[code])
    return dtype, tuple(int(n) for n in header[2:2 + ndim])


class StageRunner:
    """Executes `schedule_name` on `stage` (a PipelineStage) over `comm` (the pipeline Comm:
    rank s is stage s). `spans` holds the last step's ops as (op, micro-batch, start, end) in
    time.perf_counter seconds, each from after its input arrived to after its output was
    handed to MPI: the compute the schedule's timeline models."""

    def __init__(self, stage, comm, schedule_name: str = "1f1b"):
        self.stage, self.comm, self.schedule = stage, comm, schedule_name
        self.prev = stage.stage - 1 if not stage.is_first else None
        self.next = stage.stage + 1 if not stage.is_last else None
        self.spans: list[tuple[str, int, float, float]] = []
        self._sends = []  # (request, buffer) until the step ends

    def train(self, micro_batches, normalizer, scale, before_op=None, after_op=None):
        """Forward and backward of every micro-batch in `micro_batches` (a list of (inputs,
        targets) device arrays) in the schedule's order. `scale`: the loss scale (dloss);
        `before_op(op, i)` and `after_op(op, i)` are called around each op (the engine sets
        the strategy's sync_gradients and keeps its phase clock). Returns the sum of the
        micro-batches' losses (a 0-d array) on the last stage, 0.0 elsewhere."""
        stage, m = self.stage, len(micro_batches)
        total, in_flight, self.spans = 0.0, {}, []
        sent = {}  # micro-batch -> the activation sent forward (shape and dtype of its grad)
        inbox = _Inbox(self.comm, self.prev)
        try:
            for op, i in schedule(self.schedule, stage.stage, stage.stages, m):
                if before_op is not None:
                    before_op(op, i)
                if op == "F":
                    x = micro_batches[i][0] if stage.is_first else inbox.activation()
                    start = time.perf_counter()
                    y = stage.forward(x)
                    if stage.is_last:
                        total = total + stage.loss_fn.forward(y, micro_batches[i][1],
                                                              normalizer)
                    else:
                        sent[i] = self._send_activation(y, first=i == 0)
                    in_flight[i] = stage.take_caches()
                else:
                    if stage.is_last:
                        start = time.perf_counter()
                        stage.restore_caches(in_flight.pop(i))
                        dy = stage.loss_fn.backward(scale)
                    else:
                        dy = self._receive(sent.pop(i), GRADIENT, self.next)
                        start = time.perf_counter()
                        stage.restore_caches(in_flight.pop(i))
                    dx = stage.backward(dy)
                    if not stage.is_first:
                        self._send(dx.astype(inbox.dtype, copy=False), self.prev, GRADIENT)
                self.spans.append((op, i, start, time.perf_counter()))
                if after_op is not None:
                    after_op(op, i)
        except BaseException:
            stage.clear_cache()  # drop what was set aside; the sends' buffers stay referenced
            for taken in in_flight.values():
                stage.restore_caches(taken)
                stage.clear_cache()
            raise
        self._finish_sends()
        return total

    def evaluate(self, inputs, targets, normalizer):
        """Forward of one batch through every stage; the loss (a float) on the last stage,
        0.0 elsewhere. Nothing is kept for backward."""
        stage = self.stage
        try:
            x = inputs if stage.is_first else _Inbox(self.comm, self.prev).activation()
            y = stage.forward(x)
            if stage.is_last:
                return float(stage.loss_fn.forward(y, targets, normalizer))
            self._send_activation(y, first=True)
            self._finish_sends()
            return 0.0
        finally:
            stage.clear_cache()

    # ---- messages ---------------------------------------------------------------------------
    def _send_activation(self, y, first: bool):
        if first:
            self._send(encode_header(y), self.next, HEADER)
        self._send(y, self.next, ACTIVATION)
        return y

    def _send(self, a, peer: int, tag: int) -> None:
        xp = array_module(a)
        a = xp.ascontiguousarray(a)
        self._sends.append((self.comm.isend(a, peer, tag), a))

    def _receive(self, like, tag: int, peer: int):
        xp = array_module(like)
        return self.comm.recv(xp.empty(like.shape, like.dtype), peer, tag)

    def _finish_sends(self) -> None:
        sends, self._sends = self._sends, []
        for request, _ in sends:
            request.wait()


class _Inbox:
    """The activations one step receives from the previous stage: the header first (once),
    then each micro-batch's array of the agreed dtype and shape."""

    def __init__(self, comm, prev):
        self.comm, self.prev = comm, prev
        self.dtype = self.shape = None

    def activation(self):
        if self.shape is None:
            header = self.comm.recv(np.empty(2 + MAX_DIMS, np.int64), self.prev, HEADER)
            self.dtype, self.shape = decode_header(header)
        return self.comm.recv(backend.xp.empty(self.shape, self.dtype), self.prev, ACTIVATION)
