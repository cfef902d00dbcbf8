"""Sequence parallelism (Korthikanti et al. 2022) over the tensor-parallel group: one 2-rank
and one 4-rank launch of tests/ranks/sp_checks.py ((dp, tp) = (1, 2); (2, 2) and (1, 4)), a
`zmpi train --tp 2 --sequence-parallel` run and its refusal of a --seq-len tp does not divide,
and, in this process, the config key and the operators at one rank.

Bounds, against the unsplit model trained in one process (5 AdamW steps, clipping at stages 1
and 3): fp64 1e-9 of each tensor's move (measured 5.7e-13); fp32 the tensor-parallel suite's
1e-4 of the model's move and 1e-3 of a tensor's (measured 8.9e-6 and 1.9e-4). fp16 and bf16,
against the same data-parallel run without tensor parallelism: fp16 1e-3 of the model's move
(measured 7.2e-5); bf16 2e-3 (measured 8.4e-4): the gradients of the sequence-parallel
parameters are stored per rank in bfloat16 before their sum over the tensor ranks, one
rounding more than without sequence parallelism.
"""
import json

import numpy as np
import pytest
from mpi_util import CLI, RANKS_DIR, launch_mpi, run_mpi

N_LAYER, STEPS, BATCH, T, C = 2, 5, 8, 8, 16  # as tests/ranks/sp_checks.py
SEQUENCE_ELEMENTS = N_LAYER * 4 * C + T * C + 2 * C  # ln1, ln2 per block; wpe; ln_f
OPS_B, OPS_S, OPS_C = 2, 8, 6  # the operators' (B, S, C) in sp_checks.py


@pytest.fixture(scope="module")
def two():
    return run_mpi(RANKS_DIR / "sp_checks.py", 2, timeout=120)


@pytest.fixture(scope="module")
def four():
    return run_mpi(RANKS_DIR / "sp_checks.py", 4, timeout=240)


def per_tp(two, four):
    """(launch size, tp, report of one rank) for every rank of both launches."""
    for reports in (two, four):
        for r in reports:
            for t, got in r["tp"].items():
                yield len(reports), int(t), got


@pytest.mark.mpi
def test_the_operators_are_their_definitions(two, four):
    seen = set()
    for size, t, got in per_tp(two, four):
        seen.add((size, t))
        ops = got["operators"]
        for key in ("gather_forward", "gather_backward", "scatter_forward", "scatter_backward"):
            assert ops[key] <= 1e-15, (size, t, key, ops[key])
        assert ops["scatter_shape"] == [OPS_B, OPS_S // t, OPS_C]
        assert ops["gather_forward_contiguous"] and ops["fp16_dtypes"] == ["float32", "float32"]
        full = OPS_B * OPS_S * OPS_C * 8  # one collective each way, of the whole (B, S, C)
        for name in ("gather_counters", "scatter_counters"):
            counted = {op: c for op, c in ops[name].items() if c["calls"]}
            assert counted == {op: {"calls": 1, "bytes": full, "sent": full * (t - 1) // t}
                               for op in ("allgather", "reduce_scatter")}, (name, counted)
        assert ops["refusal"] == (f"sequence length {4 * t + 1} is not divisible by the "
                                  f"tensor-parallel size {t}: sequence parallelism gives every "
                                  "rank an equal share of the positions")
    assert seen == {(2, 2), (4, 2), (4, 4)}


@pytest.mark.mpi
def test_the_sequence_parallel_mlp_is_the_serial_one_and_passes_finite_differences(two, four):
    for _, t, got in per_tp(two, four):
        mlp = got["mlp"]
        for key in ("y", "dx", "fc.weight.grad", "proj.weight.grad", "proj.bias.grad"):
            assert mlp[key] <= 1e-14, (t, key, mlp[key])
        if t == 2:  # float64 central differences, every rank its own directions
            assert mlp["gradcheck"] == ["x", "fc.weight", "fc.bias", "proj.weight", "proj.bias"]


@pytest.mark.mpi
def test_training_with_sequence_parallelism_matches_the_unsplit_model(two, four):
    for size, t, got in per_tp(two, four):
        runs = got["runs"]
        assert len(runs) == 4 * 2 + 2 * 2  # stages 0-3 x fp64, fp32; 1 and 3 x fp16, bf16
        for name, run in runs.items():
            assert run["shapes_match"] and run["dp"] * t == size, name
            precision = name[-4:]
            if precision == "fp64":
                assert run["tensor_move"] <= 1e-9 and run["loss_diff"] <= 1e-12, (name, run)
                assert run["tensor_move_vs_tp"] <= 1e-9, (name, run)  # and the non-SP run
            elif precision == "fp32":
                assert run["model_move"] <= 1e-4 and run["tensor_move"] <= 1e-3, (name, run)
                assert run["loss_diff"] <= 1e-6, (name, run)
            else:
                bound = 1e-3 if precision == "fp16" else 2e-3
                assert run["model_move"] <= bound, (name, run)


@pytest.mark.mpi
def test_tensor_traffic_is_reduce_scatter_and_allgather(two, four):
    """Per step, N = B x T positions of the replica: 4 L + 2 reduce-scatters and as many
    allgathers of N x C (each layer's g-bar and g forward and backward; the embedding's
    reduce-scatter and its backward; the LM head's allgather and its backward) in place of as
    many allreduces; 3 allreduces of N (the cross-entropy) and 1 of this rank's share of the
    sequence-parallel gradients (storage dtype)."""
    for _, t, got in per_tp(two, four):
        for name, run in got["runs"].items():
            n = BATCH // run["dp"] * T
            tr, without = run["traffic"], run["traffic_without"]
            blocks = (4 * N_LAYER + 2) * n * C * run["itemsize"] * STEPS
            for op in ("reduce_scatter", "allgather"):
                assert tr[op]["calls"] == (4 * N_LAYER + 2) * STEPS, (name, op)
                assert tr[op]["bytes"] == blocks, (name, op)
                assert tr[op]["sent"] == blocks * (t - 1) // t, (name, op)
            # what each rank sends equals the allreduces' it replaces
            assert without["allreduce"]["calls"] == (4 * N_LAYER + 2 + 3) * STEPS
            assert tr["reduce_scatter"]["sent"] + tr["allgather"]["sent"] == \
                2 * blocks * (t - 1) // t
            if name.endswith("stage0_fp64") or name.endswith("stage0_fp32"):
                assert run["sequence_elements"] == SEQUENCE_ELEMENTS, name  # not sharded
            else:
                assert run["sequence_elements_all"] == SEQUENCE_ELEMENTS, name  # over dp
            assert run["without_elements"] == 0
            assert tr["allreduce"]["calls"] == 4 * STEPS, name
            assert tr["allreduce"]["bytes"] == (3 * n * run["itemsize"] + run[
                "sequence_elements"] * run["storage_itemsize"]) * STEPS, name


@pytest.mark.mpi
def test_zmpi_estimate_sequence_parallel_predicts_the_counted_traffic(two, four):
    """`zmpi estimate --tp T --micro-batch B --sequence-parallel --json`: its elements per
    collective x itemsize x steps are the counted bytes (the allreduce's, less the
    sequence-parallel gradients' sum)."""
    import subprocess
    import sys

    from mpi_util import REPO_ROOT

    seen = set()
    for _, t, got in per_tp(two, four):
        for name, run in got["runs"].items():
            key = (t, run["dp"], run["itemsize"])
            if key in seen:
                continue
            seen.add(key)
            out = subprocess.run(
                [sys.executable, "-m", "zmpi.cli", "estimate", "--n-layer", str(N_LAYER),
                 "--d-model", str(C), "--vocab-size", "13", "--seq-len", str(T),
                 "--world-size", str(run["dp"] * t), "--tp", str(t), "--micro-batch",
                 str(BATCH // run["dp"]), "--sequence-parallel", "--json"],
                capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
            ops = json.loads(out)["tensor_traffic_ops"]
            tr, scale = run["traffic"], run["itemsize"] * STEPS
            assert ops["reduce_scatter"] * scale == tr["reduce_scatter"]["bytes"], name
            assert ops["allgather"] * scale == tr["allgather"]["bytes"], name
            assert ops["allreduce"] * scale == tr["allreduce"]["bytes"] - run[
                "sequence_elements"] * run["storage_itemsize"] * STEPS, name
    assert seen


@pytest.mark.mpi
def test_activation_memory_of_the_sequence_sharded_layers_drops_by_tp(two, four):
    for _, t, got in per_tp(two, four):
        mem = got["memory"]
        without, with_ = mem["without"], mem["with"]
        assert with_["layernorm"] * t == without["layernorm"], mem  # (B, T/t, C) each
        assert with_["rest"] == without["rest"], mem  # the gathered inputs of the regions
        assert with_["embedding"] == without["embedding"], mem  # the token ids
        for kept in (without, with_):
            assert kept["ledger"] == kept["total"], mem  # the engine's ledger counts the same


@pytest.mark.mpi
def test_generation_is_the_same_with_sequence_parallelism(two, four):
    for _, _, got in per_tp(two, four):
        without, with_ = got["generated"]
        assert with_ == without and len(with_[0]) == 3 + 7


@pytest.mark.mpi
def test_bad_inputs_give_one_clear_error(two, four):
    for _, t, got in per_tp(two, four):
        e = got["errors"]
        odd = (f"sequence length {t + 1} is not divisible by the tensor-parallel size {t}: "
               "sequence parallelism gives every rank an equal share of the positions")
        assert e["loss"] == e["check_batch"] == e["train_step"] == odd
        assert e["model_False"] == (
            f"tensor_parallel.sequence_parallel: the config turns sequence parallelism on (tp "
            f"{t}) but the model was built without it; build it as GPT(config, "
            "tp=mesh.tp_comm, sequence_parallel=True)")
        assert e["model_True"] == (
            "tensor_parallel.sequence_parallel: the config leaves sequence parallelism off but "
            "the model was built with it; build it as GPT(config, tp=mesh.tp_comm, "
            "sequence_parallel=False)")


TRAIN = ["train", "--tp", "2", "--sequence-parallel", "--steps", "4", "--n-layer", "1",
         "--d-model", "16", "--n-head", "2", "--batch", "4", "--sample-tokens", "5"]


@pytest.mark.mpi
def test_train_with_tp_2_and_sequence_parallelism(tmp_path):
    result = launch_mpi(CLI, 2, timeout=120, args=[*TRAIN, "--seq-len", "8", "--out",
                                                   tmp_path])
    assert result.returncode == 0, result.describe()
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["engine"]["mesh"] == {"dp": 1, "pp": 1, "tp": 2}
    assert meta["config"]["tensor_parallel"] == {"autotp_size": 2, "sequence_parallel": True}
    # the tensor traffic line counts the reduce-scatters and allgathers (it counted only the
    # allreduces: 0.001 MiB a step here): per step 4 L + 2 of each over N = 4 x 8 positions
    # of C = 16 fp32, a rank sending half; 4 allreduces: 3 of N (the cross-entropy) and the
    # 224 sequence-parallel gradients (ln1, ln2, wpe, ln_f), a rank sending all of each
    n, c = 4 * 8, 16
    per_step = (2 * (4 * 1 + 2) * n * c * 4 // 2 + (3 * n + 224) * 4) / 2**20
    line = next(line for line in result.stdout.splitlines() if "tensor-parallel" in line)
    said = float(line.split("tensor-parallel ")[1].split("(")[1].split()[0])
    assert said == round(per_step, 3), (line, per_step)


@pytest.mark.mpi
def test_train_refuses_a_seq_len_tp_does_not_divide(tmp_path):
    result = launch_mpi(CLI, 2, timeout=60, args=[*TRAIN, "--seq-len", "7", "--out", tmp_path])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.describe()
    assert result.ranks_stderr() == [
        "zmpi train: --seq-len 7 is not divisible by the tensor-parallel size 2: sequence "
        "parallelism gives every tensor rank an equal share of the positions"]


# ---- in this process


def test_the_config_key():
    from zmpi.config import Config, ConfigError

    on = Config.from_dict({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}})
    assert on.tensor_parallel.sequence_parallel and on.notes() == []
    assert Config().tensor_parallel.sequence_parallel is False
    alone = Config.from_dict({"tensor_parallel": {"sequence_parallel": True}})
    assert alone.notes() == ["tensor_parallel.sequence_parallel: no effect at autotp_size 1 "
                             "(there is no tensor group to split the sequence over)"]
    for bad in (1, "true", None):
        with pytest.raises(ConfigError, match="^tensor_parallel.sequence_parallel: expected "
                                              "bool, got "):
            Config.from_dict({"tensor_parallel": {"sequence_parallel": bad}})


def test_at_one_rank_sequence_parallelism_changes_nothing():
    """tp = 1 (or no tp): the flag is a no-op, the model is the serial GPT bit for bit, and
    the engine takes it under a config that asks for sequence parallelism (with a note)."""
    from zmpi.comm import MPI, Comm
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(13, 8, 1, 2, 8)
    solo = Comm(MPI.COMM_SELF)
    x = np.random.default_rng(0).integers(0, 13, (2, 7))  # 7: any length
    plain, model = GPT(cfg, dtype=np.float64), GPT(cfg, dtype=np.float64, tp=solo,
                                                   sequence_parallel=True)
    assert model.sequence_parallel is False
    assert model.loss(x, x) == plain.loss(x, x)
    with pytest.raises(TypeError, match="sequence_parallel must be True or False, got 1"):
        GPT(cfg, sequence_parallel=1)
    with pytest.warns(UserWarning, match="sequence_parallel: no effect at autotp_size 1"):
        engine = Engine(model, {"train_micro_batch_size_per_gpu": 2,
                                "tensor_parallel": {"sequence_parallel": True}}, solo)
    engine.close()


def test_the_operators_at_one_rank_are_identities():
    from zmpi.comm import MPI, Comm
    from zmpi.parallel.tensor.regions import (
        GatherFromSequenceRegion,
        ReduceScatterToSequenceRegion,
    )

    solo = Comm(MPI.COMM_SELF)
    x = np.arange(12.0).reshape(1, 3, 4)
    for region in (GatherFromSequenceRegion(solo), ReduceScatterToSequenceRegion(solo)):
        assert region.forward(x) is x and region.backward(x) is x
        with pytest.raises(RuntimeError, match="without a preceding forward"):
            region.backward(x)
    assert all(c["calls"] == 0 for c in solo.counters_snapshot().values())
