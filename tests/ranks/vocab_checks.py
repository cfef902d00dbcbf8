"""Rank side of tests/test_vocab_parallel.py: the vocabulary-parallel embedding -> tied LM head
-> cross-entropy pipeline (zmpi.parallel.tensor.vocab) at tp = world size, in float64, against
the serial pipeline (embedding lookup, logits = h @ wte.T, CrossEntropyLoss) built from the
same seed; the allreduces each piece makes; at 2 ranks, a collective finite-difference check
of the loss w.r.t. each rank's logits slice.

    mpiexec -n 2 python tests/ranks/vocab_checks.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: gradcheck

from zmpi.nn import CrossEntropyLoss, embedding_lookup, normal_parameter  # noqa: E402
from zmpi.nn import functional as F  # noqa: E402
from zmpi.parallel.tensor.vocab import (  # noqa: E402
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)

V, C, B, T, SEED = 13, 5, 2, 3, 7  # 13 divides by no tp > 1: padded to 14 (tp 2), 16 (tp 4)
DLOSS = 0.7


def batch(ignore_index=None):
    """(ids, targets) (B, T), the same on every rank; with ignore_index, two targets ignored."""
    rng = np.random.default_rng(11)
    ids, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    targets[0, 0] = V - 1  # the last real id: on the rank that also holds padding
    if ignore_index is not None:
        targets[0, 1] = targets[1, 2] = ignore_index
    return ids, targets


CASES = {  # name: (ignore_index, normalizer)
    "plain": (None, None),
    "ignore": (-100, None),
    "normalizer": (-100, 2.5),
}


def serial(ignore_index, normalizer, dtype=np.float64):
    """The serial pipeline: loss, logits (B, T, V), dh (the LM head's input gradient) and
    wte.grad (V, C) (both uses of the tied table)."""
    ids, targets = batch(ignore_index)
    wte = normal_parameter(np.random.default_rng(SEED), (V, C), 0.02, dtype)
    h, cache = embedding_lookup(wte, ids)
    logits, _ = F.linear_forward(h, wte.data.T)
    ce = CrossEntropyLoss(ignore_index)
    loss = ce.forward(logits, targets, normalizer)
    dh, dWT, _ = F.linear_backward(ce.backward(DLOSS), (h, wte.data.T))
    wte.grad += dWT.T
    wte.grad += F.embedding_backward(dh, cache)
    return {"loss": loss, "h": h, "logits": logits, "dh": dh, "wte": wte.data,
            "wte_grad": wte.grad}


def record_allreduces(tp):
    """Record (op, elements) of every allreduce on `tp` in the returned list."""
    calls, allreduce = [], tp.allreduce

    def recording(buf, op="sum"):
        calls.append((op, int(buf.size)))
        return allreduce(buf, op)

    tp.allreduce = recording
    return calls


def parallel(tp, ignore_index, normalizer, dtype=np.float64):
    """The vocab-parallel pipeline on this rank: its results, and the allreduces (op, elements)
    and counters of each phase."""
    ids, targets = batch(ignore_index)
    emb = VocabParallelEmbedding(V, C, tp, np.random.default_rng(SEED), dtype)
    head = VocabParallelLMHead(emb)
    ce = VocabParallelCrossEntropy(tp, V, ignore_index)
    calls = record_allreduces(tp)
    phases = {}

    def phase(name, fn, *args):
        calls.clear()
        tp.reset_counters()
        out = fn(*args)
        phases[name] = {"allreduces": list(calls),  # and every op that moved at all:
                        "counters": {op: c for op, c in tp.counters_snapshot().items()
                                     if c["calls"]}}
        return out

    h = phase("embedding_forward", emb.forward, ids)
    logits = phase("head_forward", head.forward, h)
    loss = phase("ce_forward", ce.forward, logits, targets, normalizer)
    dlogits = phase("ce_backward", ce.backward, DLOSS)
    dh = phase("head_backward", head.backward, dlogits)
    phase("embedding_backward", emb.backward, dh)
    del tp.allreduce  # the instance attribute: back to the method
    return {"loss": loss, "h": h, "logits": logits, "dlogits": dlogits, "dh": dh,
            "weight": emb.weight.data, "weight_grad": emb.weight.grad, "start": emb.start,
            "rows": emb.rows, "real": emb.real_rows, "phases": phases}


def compare(par, ser):
    """max |difference| of each result against the serial one (this rank's rows/columns)."""
    start, real = par["start"], par["real"]
    rows = slice(start, start + real)
    return {
        "loss": abs(float(par["loss"]) - float(ser["loss"])),
        "loss_dtype": [str(par["loss"].dtype), str(ser["loss"].dtype)],
        "h": float(np.abs(par["h"] - ser["h"]).max()),
        "logits": float(np.abs(par["logits"][..., :real] - ser["logits"][..., rows]).max()),
        "dh": float(np.abs(par["dh"] - ser["dh"]).max()),
        "weight": float(np.abs(par["weight"][:real] - ser["wte"][rows]).max()),
        "weight_grad": float(np.abs(par["weight_grad"][:real] - ser["wte_grad"][rows]).max()),
        "grad_scale": float(np.abs(ser["wte_grad"]).max()),
        "pad_weight": float(np.abs(par["weight"][real:]).max(initial=0.0)),
        "pad_grad": float(np.abs(par["weight_grad"][real:]).max(initial=0.0)),
        "pad_dlogits": float(np.abs(par["dlogits"][..., real:]).max(initial=0.0)),
        "pad_rows": par["rows"] - real,
        "rows": par["rows"],
    }


def gradcheck_logits(tp, rng_seed=3):
    """Finite differences of the loss w.r.t. each rank's logits slice, collectively (each
    forward is collective, so every rank must call it the same number of times): for each rank
    k in turn, every rank runs the same check with the same directions and rank k's analytic
    gradient (broadcast); rank k perturbs its real logits slice, the others a scratch copy the
    loss never reads, so every rank sees the same change of the (replicated) loss. Returns the
    checked ranks."""
    import gradcheck

    ignore_index = -100
    ids, targets = batch(ignore_index)
    ce = VocabParallelCrossEntropy(tp, V, ignore_index)
    # logits of order 1 (the tied head's are ~1e-3: a flat softmax); padding columns too
    # (the loss must ignore them)
    logits = 2.0 * np.random.default_rng([5, tp.rank]).standard_normal((B, T, ce.rows))
    real = max(0, min(ce.rows, V - ce.start))  # real columns; the rest pad
    ce.forward(logits, targets)
    grad = ce.backward(1.0)
    scratch = np.zeros_like(logits)

    def f():
        return float(ce.forward(logits, targets))

    checked = []
    for k in range(tp.size):
        mine = tp.rank == k
        grad_k = tp.broadcast(grad.copy(), root=k)
        gradcheck.check(f, logits if mine else scratch, grad_k,
                        np.random.default_rng(rng_seed), name=f"logits of rank {k}")
        checked.append(k)
    ce.clear_cache()
    return {"checked": checked, "elements": int(logits.size),
            "pad_grad": float(np.abs(grad[..., real:]).max(initial=0.0))}


def main():
    from _report import report

    from zmpi.comm import Comm
    from zmpi.parallel.mesh import Mesh

    comm = Comm()
    mesh = Mesh(comm, tp=comm.size)
    tp = mesh.tp_comm
    out = {"tp": [tp.size, tp.rank], "cases": {}}
    for name, (ignore_index, normalizer) in CASES.items():
        par = parallel(tp, ignore_index, normalizer)
        out["cases"][name] = {"diff": compare(par, serial(ignore_index, normalizer)),
                              "phases": par["phases"]}
    out["gradcheck"] = gradcheck_logits(tp)
    mesh.free()
    report(out)


if __name__ == "__main__":
    main()
