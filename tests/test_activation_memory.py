"""Activation memory per rank by formula (zmpi.models.gpt_counts.gpt_activation_bytes,
Korthikanti et al. 2022's count adapted to zmpi's layers: docs/activation-memory.md) against the
ledger's measurement, `peak("activation")`, byte for byte: fp32 and fp64 in this process, the
fp16 and bf16 an Engine uses on the host (activations in fp32), fp16 on a device (the CuPy stand-in:
2-byte activations), every recompute policy, T within one attention block and across blocks
(a multiple of the block and not), kept inputs on the host; tensor and sequence parallelism
and partitioned kept inputs on 2 ranks (tests/ranks/activation_memory_checks.py, one launch).
And `zmpi estimate --micro-batch`, which prints it beside Korthikanti et al.'s figure, as
docs/activation-memory.md shows it.

Every check is exact: the formula counts each array the layers cache, by shape and dtype, as
the ledger does (each owning buffer once)."""
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import RANKS_DIR, REPO_ROOT, run_mpi

from zmpi.cli import main
from zmpi.engine import Engine
from zmpi.memory import MemoryLedger
from zmpi.models.gpt import GPT, GPTConfig, default_vocab_multiple
from zmpi.models.gpt_counts import gpt_activation_bytes, korthikanti_activation_bytes
from zmpi.nn.attention import ATTENTION_BLOCK, attention_block
from zmpi.nn.checkpointing import InputStore
from zmpi.nn.module import activations_counted_in

POLICIES = ("none", "selective", "full")
SHAPE = {"vocab_size": 11, "n_layer": 2, "n_head": 2, "d_model": 8}
# (T, B): one attention block; two, T not a multiple of the block; two whole blocks
SIZES = ((16, 2), (ATTENTION_BLOCK + 16, 3), (2 * ATTENTION_BLOCK, 1))
SIZE_IDS = ("one_block", "blocks", "whole_blocks")


def batch(T, B):
    """Token ids and targets, (B, T) int64 each, in arrays of their own."""
    rng = np.random.default_rng(1)
    V = SHAPE["vocab_size"]
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def measure(T, B, policy, dtype=np.float32, store=None, **shape):
    """The ledger of one forward and backward of a bare GPT, and the activations it held at
    the end of the forward (the loss's included)."""
    model = GPT(GPTConfig(seq_len=T, **{**SHAPE, **shape}), seed=0, dtype=dtype)
    model.set_recompute(policy, saved_inputs=store)
    ledger = MemoryLedger()
    with activations_counted_in(ledger):
        model.forward_loss(*batch(T, B))
        after_forward = ledger.current("activation")
        model.backward_loss()
    assert ledger.current("activation") == 0  # everything kept was consumed
    return ledger, after_forward


def formula(T, B, policy, act_bytes=4, **kw):
    return gpt_activation_bytes(SHAPE["n_layer"], SHAPE["d_model"], SHAPE["n_head"],
                                SHAPE["vocab_size"], T, B, act_bytes, recompute=policy, **kw)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("T,B", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("dtype", (np.float32, np.float64), ids=("fp32", "fp64"))
def test_the_formula_is_the_ledgers_peak(dtype, T, B, policy):
    """The peak, and what is held at the end of the forward: everything without full
    recompute; with it the kept inputs and the LM head's and loss's caches."""
    ledger, after_forward = measure(T, B, policy, dtype)
    want = formula(T, B, policy, np.dtype(dtype).itemsize)
    assert ledger.peak("activation") == want["device"]
    assert after_forward == (want["device"] if policy != "full"
                             else want["kept"] + want["head"] + want["loss"])


@pytest.mark.parametrize("policy", ("none", "selective"))
@pytest.mark.parametrize("T,B", SIZES, ids=SIZE_IDS)
def test_a_layer_more_adds_one_layer_term(T, B, policy):
    """The per-layer term alone: one block more adds `layer` = s b h (A + B a s / h), whose
    B term is the probabilities (the activations' dtype) over the lower-triangular blocks of
    the s x s matrix."""
    one, _ = measure(T, B, policy, n_layer=1)
    two, _ = measure(T, B, policy, n_layer=2)
    want = formula(T, B, policy)
    assert two.peak("activation") - one.peak("activation") == want["layer"]
    s, b, h, a = T, B, SHAPE["d_model"], SHAPE["n_head"]
    assert s * b * h * (want["A"] + want["B"] * a * s / h) == pytest.approx(want["layer"])
    assert want["A"] == pytest.approx(80 + 8 / h)  # fp32: 20 x 4 bytes, LayerNorms' rstd
    rows = sum((min(i + ATTENTION_BLOCK, s) - i) * min(i + ATTENTION_BLOCK, s)
               for i in range(0, s, ATTENTION_BLOCK))
    assert want["B"] == (0 if policy == "selective" else 4 * rows / s**2)


@pytest.mark.parametrize("T,B", SIZES[:2], ids=SIZE_IDS[:2])
def test_kept_inputs_on_the_host_leave_the_device(T, B):
    """cpu_checkpointing: the kept inputs are the host's peak, the device's is one unit's
    working set."""
    ledger, _ = measure(T, B, "full", store=InputStore(to_host=True))
    want = formula(T, B, "full", cpu=True)
    assert ledger.peak("activation", "device") == want["device"]
    assert ledger.peak("activation", "host") == want["host"] == want["kept"] > 0
    assert want["device"] == max(want["layer"], want["head"] + want["loss"])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("precision", ("fp16", "bf16"))
def test_the_engines_half_precision_on_the_host_keeps_fp32_activations(precision, policy):
    """fp16 and bf16 store parameters in 2 bytes; on the NumPy backend every layer computes
    and caches in float32 (zmpi.backend.compute_dtype): the fp32 formula."""
    T, B = SIZES[1]
    engine = Engine(GPT(GPTConfig(seq_len=T, **SHAPE), seed=0), {
        "train_micro_batch_size_per_gpu": B, precision: {"enabled": True},
        "activation_checkpointing": {"recompute": policy}})
    engine.train_step(*batch(T, B))
    assert engine.memory.peak("activation") == formula(T, B, policy, 4)["device"]
    engine.close()


STANDIN_RUN = """
import json, sys
import numpy as np
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
T, B, shape = json.loads(sys.argv[1])
comm, peaks = Comm(), {}
for precision in ("fp16", "fp32"):
    for policy in ("none", "selective", "full"):
        engine = Engine(GPT(GPTConfig(seq_len=T, **shape), seed=0), {
            "train_micro_batch_size_per_gpu": B, "fp16": {"enabled": precision == "fp16"},
            "activation_checkpointing": {"recompute": policy}}, comm)
        rng = np.random.default_rng(1)
        engine.train_step(rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T)))
        peaks[f"{precision} {policy}"] = engine.memory.peak("activation")
        engine.close()
print(json.dumps(peaks))
"""


@pytest.mark.parametrize("T,B", SIZES[:2], ids=SIZE_IDS[:2])
def test_fp16_on_a_device_keeps_2_byte_activations(T, B):
    """On a device fp16 computes in fp16: the activations are 2 bytes, the LayerNorm
    statistics, GELU's tanh and the loss's log-sum-exp float32, the probabilities 2 bytes, the
    attention in one block of all T rows and the logits over the vocabulary padded to 128
    (a GPU's). Run on the CuPy
    stand-in (tests/standin), the Engine's ledger as on a GPU; fp32 there as a control."""
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'tests' / 'standin'}:{REPO_ROOT}",
           "ZMPI_BACKEND": "cupy", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", STANDIN_RUN, json.dumps([T, B, SHAPE])],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peaks = json.loads(out.stdout)
    block = attention_block(T, B * SHAPE["n_head"], on_device=True)  # the GPU's blocks
    for precision, act_bytes in (("fp16", 2), ("fp32", 4)):
        for policy in POLICIES:
            want = formula(T, B, policy, act_bytes, block=block,
                           vocab_multiple=default_vocab_multiple(on_gpu=True))["device"]
            assert peaks[f"{precision} {policy}"] == want, (precision, policy)


@pytest.mark.mpi
def test_tensor_and_sequence_parallel_ranks_match_the_formula():
    """tp 2, with and without sequence parallelism, every policy, kept inputs partitioned
    and/or on the host, at T within one block and across two; the last run through the
    Engine's config keys. Both ranks hold the same bytes."""
    reports = run_mpi(RANKS_DIR / "activation_memory_checks.py", 2, timeout=180)
    assert reports[0]["runs"] == reports[1]["runs"]
    runs = reports[0]["runs"]
    assert len(runs) == 2 * (2 * 3 + 4) + 1 and runs[-1]["engine"]
    for run in runs:
        want = gpt_activation_bytes(2, 16, 4, 13, run["T"], run["B"], 4, tp=2,
                                    sequence_parallel=run["sequence_parallel"],
                                    recompute=run["recompute"], partition=run["partition"],
                                    cpu=run["cpu"])
        assert (run["device"], run["host"]) == (want["device"], want["host"]), run


def test_korthikantis_table():
    """Table 2 of Korthikanti et al.: per layer s b h (34 + 5 a s / h) bytes; with tensor
    parallelism 10 + 24 / t and 5 / t; with sequence parallelism 34 / t; selective drops the
    probabilities; full recompute keeps 2 s b h."""
    def k(**kw):
        out = korthikanti_activation_bytes(24, 1024, 16, 2048, 4, **kw)
        return out["A"], out["B"]

    assert k() == (34, 5)
    assert k(tp=8) == (10 + 3, 5 / 8)
    assert k(tp=8, sequence_parallel=True) == (34 / 8, 5 / 8)
    assert k(tp=8, recompute="selective") == (13, 0)
    assert k(recompute="full") == (2, 0) and k(tp=8, sequence_parallel=True,
                                               recompute="full") == (2 / 8, 0)
    full = korthikanti_activation_bytes(24, 1024, 16, 2048, 4)
    assert full["layer"] == 2048 * 4 * 1024 * (34 + 5 * 16 * 2048 / 1024)
    assert full["total"] == 24 * full["layer"]


def test_the_formula_refuses_what_cannot_be_built():
    for kw, match in (({"recompute": "some"}, "recompute 'some'"),
                      ({"cpu": True}, "full recompute keeps"),
                      ({"tp": 4}, "n_head=2 must divide"),
                      ({"tp": 2, "sequence_parallel": True, "recompute": "full",
                        "partition": True}, "already each rank's share")):
        with pytest.raises(ValueError, match=match):
            gpt_activation_bytes(2, 8, 2, 11, 16, 2, **kw)
    with pytest.raises(ValueError, match="seq_len=15 is not divisible by tp=2"):
        gpt_activation_bytes(2, 8, 2, 11, 15, 2, tp=2, sequence_parallel=True)


# ---- zmpi estimate -------------------------------------------------------------------------

GPT2 = ["--n-layer", "12", "--world-size", "8"]  # GPT-2 small: d 768, V 50257, T 1024


def estimate_json(capsys, *args):
    main(["estimate", *GPT2, *args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_zmpi_estimate_prints_activations_beside_korthikanti():
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", *GPT2,
                          "--micro-batch", "4", "--recompute", "selective"],
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
    want = gpt_activation_bytes(12, 768, 12, 50257, 1024, 4, 2, recompute="selective",
                                block=attention_block(1024, 4 * 12, on_device=True))
    assert ("activations per rank: micro-batch 4 x 1024 tokens, 12 heads, 2-byte "
            "activations (fp16), recompute selective") in out
    assert (f"per layer s b h ({want['A']:.4g} + 0 a s / h) = {want['layer'] / 1e6:.4g} MB; "
            "Korthikanti et al.: s b h (34 + 0 a s / h)") in out
    assert f"peak {want['device'] / 1e9:.4g} GB on the device, at the end of the loss's" in out


@pytest.mark.parametrize("args,kw", (
    ([], {}),
    (["--precision", "fp32", "--recompute", "full"], {"act_bytes": 4, "recompute": "full"}),
    (["--tp", "2", "--sequence-parallel", "--recompute", "full", "--cpu-checkpointing"],
     {"tp": 2, "sequence_parallel": True, "recompute": "full", "cpu": True}),
    (["--tp", "4", "--n-head", "8", "--recompute", "full", "--partition-activations"],
     {"tp": 4, "n_head": 8, "recompute": "full", "partition": True}),
), ids=("fp16", "fp32_full", "sp_cpu", "partition"))
def test_zmpi_estimate_json_is_the_formula(capsys, args, kw):
    got = estimate_json(capsys, "--micro-batch", "2", *args)["activation"]
    kw = {"n_head": 12, "act_bytes": 2, **kw}
    block = attention_block(1024, 2 * kw["n_head"] // kw.get("tp", 1), on_device=True)
    want = gpt_activation_bytes(12, 768, vocab_size=50257, seq_len=1024, micro_batch=2,
                                block=block, **kw)  # the GPU's attention blocks
    assert got["zmpi"] == json.loads(json.dumps(want)) and got["n_head"] == kw["n_head"]
    assert got["korthikanti"] == korthikanti_activation_bytes(
        12, 768, kw["n_head"], 1024, 2, kw.get("tp", 1), kw.get("sequence_parallel", False),
        kw.get("recompute", "none"))
    assert estimate_json(capsys)["activation"] is None  # no --micro-batch


def test_zmpi_estimate_refuses_activation_flags_that_cannot_act(capsys):
    for args, match in (
            (["--recompute", "full"], "without --micro-batch there is no activation memory "
                                      "for --recompute to act on"),
            (["--n-head", "12", "--cpu-checkpointing"], "for --n-head, --cpu-checkpointing to"),
            (["--micro-batch", "2", "--cpu-checkpointing"], "add --recompute full"),
            (["--micro-batch", "2", "--recompute", "full", "--partition-activations"],
             "needs --tp above 1"),
            (["--micro-batch", "2", "--n-head", "5"], "5 heads must divide --d-model 768"),
            (["--micro-batch", "2", "--d-model", "18", "--tp", "4"],
             r"4 heads \(the default\) must divide --d-model 18 and be a multiple of --tp 4: "
             "give --n-head"),
            (["--micro-batch", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "9"],
             "--seq-len 9 is not a multiple of --tp 2")):
        with pytest.raises(SystemExit) as exit_info:
            main(["estimate", *GPT2, *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and re.search(match, err), (args, err)
        assert err.startswith("zmpi estimate: ") and len(err.splitlines()) == 1


def test_the_docs_examples_print_what_is_pasted():
    """docs/activation-memory.md: each `python -m zmpi.cli estimate` block, run, prints the
    output block after it."""
    text = (REPO_ROOT / "docs" / "activation-memory.md").read_text()
    examples = re.findall(r"^```bash\n(python -m zmpi\.cli estimate .*?)```\n\n```\n(.*?)```",
                          text, re.S | re.M)
    assert len(examples) == 2
    for command, pasted in examples:
        args = shlex.split(command.replace("\\\n", " "))
        out = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True,
                             check=True, cwd=REPO_ROOT).stdout
        assert out == pasted, command


# -- the Llama (models/llama.py's llama_activation_bytes: the same count with its block) ----

def _llama(n_kv_head, T, **shape):
    from zmpi.models.llama import LlamaConfig

    return LlamaConfig(**{"vocab_size": 11, "hidden_size": 16, "intermediate_size": 40,
                          "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": n_kv_head, "max_position_embeddings": T,
                          **shape})


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("T,B", SIZES[:2], ids=SIZE_IDS[:2])
@pytest.mark.parametrize("n_kv_head", (4, 2, 1), ids=("mha", "gqa", "mqa"))
@pytest.mark.parametrize("dtype", (np.float32, np.float64), ids=("fp32", "fp64"))
def test_llama_formula_is_the_ledgers_peak(dtype, n_kv_head, T, B, policy):
    """RMSNorms' statistics, q and the n_kv_head key/value heads (rotated), SwiGLU's three
    hidden-width arrays, no position table: byte for byte, multi-head, grouped and multi-query,
    every policy, within one attention block and across two."""
    from zmpi.models.llama import Llama, llama_activation_bytes

    config = _llama(n_kv_head, T)
    model = Llama(config, seed=0, dtype=dtype)
    model.set_recompute(policy)
    ids, targets = batch(T, B)
    ledger = MemoryLedger()
    with activations_counted_in(ledger):
        model.forward_loss(ids, targets)
        model.backward_loss()
    want = llama_activation_bytes(config, B, np.dtype(dtype).itemsize, recompute=policy)
    assert ledger.peak("activation") == want["device"]


@pytest.mark.mpi
def test_llama_tensor_and_sequence_parallel_ranks_match_the_formula():
    """tp 2, key/value heads split (2) and replicated (1: each rank computes the one its query
    heads read), with and without sequence parallelism (q, k, v, gate and up each keep the
    sequence they gathered), every policy: the ledger's peak is `llama_activation_bytes`, and
    the tensor group's counters are `zmpi estimate --model llama`'s (7 L + 2) B T C + 3 B T
    (allreduced; sequence parallel: reduce-scattered and allgathered, the cross-entropy's
    allreduced), without full recompute (whose second forward is not counted, as the GPT's),
    and their calls `zmpi plan`'s (zmpi.plan.collectives.stage_calls; full recompute too)."""
    from zmpi.cli.estimate import tensor_ops
    from zmpi.models.llama import TENSOR_REDUCTIONS_PER_BLOCK, llama_activation_bytes
    from zmpi.plan.collectives import stage_calls
    from zmpi.plan.layout import Job, Layout

    reports = run_mpi(RANKS_DIR / "llama_accounting_checks.py", 2, timeout=180)
    runs = reports[0]["runs"]
    assert len(runs) == 12 and [r["device"] for r in reports[1]["runs"]] == \
        [r["device"] for r in runs]
    for run in runs:
        config = _llama(run["n_kv_head"], 16, vocab_size=13)
        want = llama_activation_bytes(config, 2, 4, 2, recompute=run["recompute"],
                                      sequence_parallel=run["sequence_parallel"])
        assert run["device"] == want["device"], run
        if not run["sequence_parallel"]:  # zmpi plan's count of the calls (one micro-batch)
            job = Job(2, 16, 4, 13, 16, 2, 1, 2, "fp32", model="llama",
                      n_kv_head=run["n_kv_head"], intermediate_size=40)
            layout = Layout(1, 1, 2, 0, "none", run["recompute"], False, 2, 1, "1f1b")
            assert stage_calls(job, layout, 0)["tp"] == sum(
                c["calls"] for c in run["traffic"].values()), run
        if run["recompute"] == "full":
            continue
        args = type("Args", (), {"micro_batch": 2, "seq_len": 16, "n_layer": 2, "d_model": 16,
                                 "sequence_parallel": run["sequence_parallel"]})
        ops = tensor_ops(args, TENSOR_REDUCTIONS_PER_BLOCK)
        got = {op: c["bytes"] // 4 for op, c in run["traffic"].items() if c["calls"]}
        assert got == ops, run


def test_zmpi_estimate_counts_a_llamas_activations_and_tensor_traffic(capsys):
    """`zmpi estimate --model llama --micro-batch`: `llama_activation_bytes` under "activation",
    and the tensor traffic of 7 B T C per block ((7 L + 2) B T C + 3 B T), in the JSON and the
    text."""
    from zmpi.models.llama import LlamaConfig, llama_activation_bytes

    flags = ["estimate", "--model", "llama", "--n-layer", "4", "--d-model", "64", "--n-head",
             "4", "--n-kv-head", "2", "--intermediate-size", "176", "--vocab-size", "100",
             "--seq-len", "32", "--world-size", "4", "--tp", "2", "--micro-batch", "2",
             "--precision", "fp32", "--recompute", "selective"]
    main([*flags, "--json"])
    got = json.loads(capsys.readouterr().out)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32)
    want = llama_activation_bytes(config, 2, 4, 2, recompute="selective",
                                  block=attention_block(32, 2 * 4 // 2, on_device=True))
    assert got["activation"]["zmpi"] == want
    assert got["tensor_traffic_elements"] == (7 * 4 + 2) * 2 * 32 * 64 + 3 * 2 * 32
    main(flags)
    assert "allreduced ((7 L + 2) B T C + 3 B T)" in capsys.readouterr().out
