"""zmpi plan: the candidates it enumerates, the model it builds them from (units, pipeline
stages, model states) checked against the real model and strategies, the time model's
formulas, the config it writes (zmpi train runs it), and the command's answers to bad input.
The predictions against what runs measure: tests/test_plan_validation.py."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import CLI, REPO_ROOT, launch_mpi

from zmpi.config import Config
from zmpi.memory import model_state_breakdown
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_unit_numels
from zmpi.parallel.pipeline.stage import PipelineStage
from zmpi.plan.hardware import PRESETS, Hardware
from zmpi.plan.layout import BUCKET_NUMEL, Job, Layout, layouts, to_config
from zmpi.plan.memory import stage_memory, stage_units
from zmpi.plan.search import model_flops_per_step, plan
from zmpi.plan.time import matmul_rate, offload_transfers, ring_allreduce, step_time

SMALL = Job(n_layer=4, d_model=64, n_head=4, vocab_size=65, seq_len=32, global_batch=8,
            nodes=1, gpus_per_node=4, precision="fp32")


def _unit_sizes(units):
    return [sum(int(p.data.size) for _, p in u.named_parameters()) for u in units]


def test_unit_numels_are_the_models():
    model = GPT(GPTConfig(65, 32, 3, 4, 64))
    assert gpt_unit_numels(3, 64, 65, 32) == _unit_sizes(model.units)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_units_are_the_pipeline_stages(pp):
    """Each stage's units (and the last stage's held copy of the embedding) as
    zmpi.parallel.pipeline builds them."""
    job = Job(4, 64, 4, 65, 32, 8, 1, pp)
    for stage in range(pp):
        built = PipelineStage(GPT(GPTConfig(65, 32, 4, 4, 64)), stage, pp)
        assert list(stage_units(job, pp, 1)[stage]) == _unit_sizes(built.units), (pp, stage)


def test_model_states_follow_the_zero_paper():
    """Without padding (Psi a multiple of dp) a single stage's model states are ZeRO's
    Fig. 1 breakdown, in fp16 with K = 12."""
    job = Job(2, 64, 4, 64, 32, 8, 1, 4, precision="fp16")
    psi = sum(gpt_unit_numels(2, 64, 64, 32))
    assert all(n % 4 == 0 for n in gpt_unit_numels(2, 64, 64, 32))
    for stage in range(4):
        layout = Layout(4, 1, 1, stage, "none", "none", False, 1, 2, "1f1b")
        got = stage_memory(job, layout, 0, on_gpu=True).model_state
        assert got == {"device": sum(model_state_breakdown(psi, 4, stage).values()),
                       "host": 0}


def test_gradients_in_flight_stay_under_the_bucket_limit():
    """ZeRO-2/3 keep every micro-step's unit gradients in flight until the step, up to the
    strategy's in_flight_limit (two buckets) and one more collective (a unit's gradient and its
    part), beside the gradient of the unit whose backward runs: with many micro-batches of a
    large model the peak stops growing with m, as the engine's does."""
    job = Job(4, 768, 12, 8192, 1024, 64, 1, 8, precision="fp16")
    limit = 2 * BUCKET_NUMEL * 2

    def beyond_activations(m):
        memory = stage_memory(job, Layout(8, 1, 1, 2, "none", "none", False, 1, m, "1f1b"),
                              0, on_gpu=True)
        return memory.device - memory.model_state["device"] - memory.activation["device"]
    few, many = beyond_activations(1), beyond_activations(8)
    unit = max(gpt_unit_numels(4, 768, 8192, 1024)) * 2
    assert few < limit < many <= limit + 3 * unit


def test_layouts_are_all_valid():
    seen = list(layouts(SMALL))
    assert len(seen) == len(set(seen)) > 100
    for layout in seen:
        assert layout.dp * layout.pp * layout.tp == SMALL.world_size
        assert layout.dp * layout.micro_batch * layout.micro_batches == SMALL.global_batch
        assert SMALL.n_head % layout.tp == 0
        assert layout.offload == "none" or layout.stage >= 1
        assert layout.offload != "optimizer+param" or layout.stage == 3
        assert not layout.sequence_parallel or layout.tp > 1
        config = Config.from_dict(to_config(SMALL, layout)).resolve_batch(layout.dp)
        assert config.tensor_parallel.autotp_size == layout.tp
        assert config.pipeline.stages == layout.pp
    assert {(x.dp, x.pp, x.tp) for x in seen} == {
        (dp, pp, tp) for dp in (1, 2, 4) for pp in (1, 2, 4) for tp in (1, 2, 4)
        if dp * pp * tp == 4}


def test_time_model_formulas():
    hw = PRESETS["a100"]
    link = hw.intra_node
    assert ring_allreduce(link, 1e9, 1) == 0
    assert ring_allreduce(link, 1e9, 4) == pytest.approx(6 * link.latency + 1.5e9 / link.bandwidth)
    job = Job(8, 512, 8, 1000, 256, 64, 1, 8, "fp16")
    base = Layout(1, 8, 1, 0, "none", "none", False, 1, 64, "1f1b")
    t = step_time(job, base, hw)
    # 8 blocks + embedding + head over 8 stages: the slowest stage (the last) sets every
    # micro-batch time; once a step it also allreduces the tied embedding's gradient with the
    # first stage
    tied = ring_allreduce(link, stage_units(job, 8, 1)[-1][0] * job.param_bytes, 2)
    assert t.bubble == pytest.approx(7 / 64 * (t.compute + t.tensor + t.pipeline - tied))
    assert t.tensor == 0
    tp = step_time(job, Layout(1, 1, 8, 0, "none", "none", False, 1, 64, "1f1b"), hw)
    assert tp.tensor > 0 and tp.bubble == 0
    full = step_time(job, Layout(1, 8, 1, 0, "none", "full", False, 1, 64, "1f1b"), hw)
    assert full.compute > t.compute  # recompute costs a forward
    assert model_flops_per_step(job, recompute=True) > model_flops_per_step(job)
    # a fixed cost per block and micro-batch: 1 block on the slowest stage, 71 micro-batch times
    slower = step_time(job, base, Hardware.from_dict({**hw.to_dict(), "layer_overhead": 1e-3}))
    assert slower.total - t.total == pytest.approx(71 * 1e-3)


def test_bf16_matmuls_at_the_devices_bf16_rate():
    """On a GPU zmpi computes bf16 on tensor cores (CuPy >= 14): the A100's and H100's bf16
    rate, the fp16 one; the V100 has no bf16, its fp32 rate; a CPU computes it in fp32."""
    jobs = {p: Job(4, 64, 4, 65, 32, 16, 1, 4, p) for p in ("fp16", "bf16", "fp32")}
    for name, like in (("a100", "fp16"), ("h100", "fp16"), ("v100", "fp32"), ("cpu", "fp32")):
        hw = PRESETS[name]
        assert matmul_rate(jobs["bf16"], hw, 1) == matmul_rate(jobs[like], hw, 1), name
    assert matmul_rate(jobs["bf16"], PRESETS["a100"], 1) == 312e12 * 0.75


def test_time_model_mpi_terms_on_a_cpu():
    """MPI's float16 sums cost a data-parallel fp16 job its reduced bytes at
    half_reduction_rate (the ranks' core share of it); ranks beyond the cores send over the
    oversubscribed link, or else at their share of the link's bandwidth."""
    cpu = {**PRESETS["cpu"].to_dict(), "cores_per_node": 4}  # a core per rank: no overlap
    job = Job(4, 64, 4, 65, 32, 16, 1, 4, "fp16")
    dp = Layout(4, 1, 1, 2, "none", "none", False, 1, 4, "1f1b")
    base = step_time(job, dp, Hardware.from_dict(cpu))
    summed = step_time(job, dp, Hardware.from_dict({**cpu, "half_reduction_rate": 1e8}))
    units = stage_units(job, 1, 1)[0]
    nbytes = sum(-(-n // 4) * 4 for n in units) * 2  # padded fp16 gradients
    assert summed.data - base.data == pytest.approx(4 * 0.75 * nbytes / 1e8)  # m = 4 sums
    bf16 = Job(4, 64, 4, 65, 32, 16, 1, 4, "bf16")
    assert step_time(bf16, dp, Hardware.from_dict({**cpu, "half_reduction_rate": 1e8})) == \
        step_time(bf16, dp, Hardware.from_dict(cpu))
    two_cores = {**cpu, "cores_per_node": 2, "devices_per_node": 2}
    tp = Layout(1, 1, 4, 0, "none", "none", False, 4, 4, "1f1b")
    shared = step_time(job, tp, Hardware.from_dict(two_cores))
    slow = {"bandwidth": 1e8, "latency": 1e-3}
    crowded = step_time(job, tp, Hardware.from_dict({**two_cores, "oversubscribed": slow}))
    # there each call waits once for its descheduled peers: per micro-batch 4 blocks x 4
    # allreduces + the embedding's and the head's (ring passes twice that) + the loss's 3
    act, loss = 4 * 32 * 64 * job.act_bytes(False), 3 * 4 * 32 * 4
    assert crowded.tensor == pytest.approx(4 * (0.75 * (36 * act + 2 * loss) / 1e8 + 21e-3))
    assert crowded.tensor > 5 * shared.tensor
    alone = step_time(job, tp, Hardware.from_dict({**cpu, "oversubscribed": slow}))
    assert alone == step_time(job, tp, Hardware.from_dict(cpu))  # a core each: not crowded


def test_time_model_engine_terms_on_a_cpu():
    """ZeRO-2/3's per-unit work costs each micro-batch its units' overhead, and fp16 storage
    on a CPU its parameters at half_storage_rate (a third more under full recompute), each at
    the ranks' core share; neither on a GPU, nor at ZeRO-0/1, nor fp16 storage in fp32."""
    cpu = {**PRESETS["cpu"].to_dict(), "cores_per_node": 2, "devices_per_node": 4}
    engine = {**cpu, "stage2_unit_overhead": 2e-4, "stage3_unit_overhead": 5e-4,
              "half_storage_rate": 1e8}
    job = Job(4, 64, 4, 65, 32, 16, 1, 4, "fp16")
    units = stage_units(job, 2, 1)  # each pipeline stage's units (parameter counts)
    for stage, per_unit in ((0, 0), (1, 0), (2, 2e-4), (3, 5e-4)):
        for recompute, share in (("none", 1), ("full", 4 / 3)):
            layout = Layout(2, 2, 1, stage, "none", recompute, False, 2, 4, "1f1b")
            base, more = (step_time(job, layout, Hardware.from_dict(d)) for d in (cpu, engine))
            per_micro = [len(u) * per_unit * 2 + sum(u) / 1e8 * 2 * share for u in units]
            # m + p - 1 = 5 micro-batch times of the slowest stage; 4 ranks on 2 cores: x 2
            assert more.compute + more.bubble - base.compute - base.bubble == \
                pytest.approx(5 * max(per_micro))
            assert more.data == base.data and more.optimizer == base.optimizer
    fp32 = Job(4, 64, 4, 65, 32, 16, 1, 4, "fp32")
    layout = Layout(2, 2, 1, 0, "none", "none", False, 2, 4, "1f1b")
    assert step_time(fp32, layout, Hardware.from_dict(engine)) == \
        step_time(fp32, layout, Hardware.from_dict(cpu))
    gpu = PRESETS["a100"].to_dict()
    gpu_job = Job(4, 64, 4, 65, 32, 16, 1, 8, "fp16")
    with pytest.raises(ValueError, match="half_storage_rate act only on a CPU"):
        Hardware.from_dict({**gpu, "half_storage_rate": 1e8})  # a GPU stores fp16 natively
    assert step_time(gpu_job, layout, Hardware.from_dict(gpu)).total > 0


def test_offload_transfers_are_the_engines(monkeypatch):
    """The gradient shards the model copies down and adds on the host per step are what a
    one-rank Engine does with optimizer offload: per unit, one copy at stage 1 (the whole
    shard in one bucket), m copies and m - 1 adds at stages 2-3."""
    import numpy as np
    from mpi4py import MPI

    import zmpi.zero.collectives as collectives
    from zmpi.comm import Comm
    from zmpi.engine import Engine

    counts = {"copy": 0, "add": 0}
    real_copy, real_add = collectives.HostCopy, collectives._add_

    def counted(name, call):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return call(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(collectives, "HostCopy", counted("copy", real_copy))
    monkeypatch.setattr(collectives, "_add_", counted("add", real_add))
    job = Job(2, 32, 2, 65, 16, 12, 1, 1, "fp16")
    units = len(stage_units(job, 1, 1)[0])
    tokens = np.random.default_rng(0).integers(0, 65, (12, 17))
    for stage, offload in ((1, "optimizer"), (2, "optimizer"), (3, "optimizer+param")):
        layout = Layout(1, 1, 1, stage, offload, "none", False, 4, 3, "1f1b")
        config = to_config(job, layout)
        del config["model"]
        engine = Engine(GPT(GPTConfig(65, 16, 2, 2, 32), seed=0), config, Comm(MPI.COMM_SELF))
        for _ in range(2):  # the second step: every unit's part written once before
            counts.update(copy=0, add=0)
            engine.train_step(tokens[:, :-1].copy(), tokens[:, 1:].copy())
        engine.close()
        down, _, adds = offload_transfers(layout)
        assert counts == ({"copy": 1, "add": 0} if stage == 1 else
                          {"copy": down * units, "add": adds * units}), (stage, counts)


def test_time_model_offload_traffic():
    """Offload's host traffic in seconds: on a CPU rank every copy (a shard each,
    offload_transfers) and every host add at host_add_rate, beside the host Adam at
    host_adam_rate x devices / ranks of the node; on a GPU only the last unit's gradient copy
    and add and the update's copy, unless the rest outlasts the backward."""
    def optimizer(job, layout, hw):
        return step_time(job, layout, hw).optimizer
    cpu = Hardware.from_dict({**PRESETS["cpu"].to_dict(), "cores_per_node": 2,
                              "devices_per_node": 2, "host_add_rate": 3e8})
    job = Job(4, 64, 4, 65, 32, 16, 1, 2, "fp16")
    shard = sum(-(-n // 2) for n in stage_units(job, 1, 1)[0])  # elements per rank
    copy, add = cpu.host_device.seconds(2 * shard), shard / 3e8
    adam = shard / cpu.host_adam_rate
    for stage, offload, copies, adds in ((1, "optimizer", 2, 0), (2, "optimizer", 5, 3),
                                         (3, "optimizer", 5, 3),
                                         (3, "optimizer+param", 4 + 8, 3)):
        layout = Layout(2, 1, 1, stage, offload, "none", False, 2, 4, "1f1b")
        assert optimizer(job, layout, cpu) == pytest.approx(adam + copies * copy + adds * add)
    gpu = PRESETS["v100"]
    big = Job(24, 2048, 16, 50257, 1024, 512, 1, 1, "fp16")  # one rank: the node's host Adam
    layout = Layout(1, 1, 1, 2, "optimizer", "none", False, 32, 16, "1f1b")
    units = stage_units(big, 1, 1)[0]
    n = sum(units)
    copy, add = gpu.host_device.seconds(2 * n), n / (gpu.host_adam_rate * 28 / 6)
    adam = n / (gpu.host_adam_rate * 16)
    # 16 copies down, 15 adds, 1 up: hidden but the last unit's copy and add, and the update
    assert optimizer(big, layout, gpu) == pytest.approx(adam + (copy + add) / len(units) + copy)
    slow_host = Hardware.from_dict({**gpu.to_dict(), "host_add_rate": 1e6})
    assert optimizer(big, layout, slow_host) > 14 * n / 1e6  # adds beyond the backward


def test_plan_keeps_what_fits_fastest_first():
    job = Job(24, 2304, 24, 51200, 2048, 512, 4, 8)
    result = plan(job, PRESETS["a100"], top=5)
    assert result.considered == result.fitting + sum(result.rejected.values())
    times = [c.time.total for c in result.best]
    assert times == sorted(times) and len(times) == 5
    for c in result.best:
        assert c.memory.device <= 0.9 * PRESETS["a100"].device_memory
    tight = plan(job, PRESETS["a100"], device_memory=20e9, top=3)
    assert tight.fitting < result.fitting
    assert all(c.memory.device <= 18e9 for c in tight.best)


def _plan(*flags, timeout=120):
    return subprocess.run([sys.executable, "-m", "zmpi.cli", "plan", *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


SMALL_FLAGS = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--vocab", "65",
               "--seq-len", "16", "--global-batch", "4", "--nodes", "1", "--gpus-per-node",
               "2", "--precision", "fp32", "--hardware", "cpu"]


def test_the_plan_runs_as_is(tmp_path):
    """The config `zmpi plan` writes trains under `zmpi train --config` unchanged: the model
    of its `model` section, on the layout it chose. The plan itself runs under mpiexec, as
    docs/plan.md's calibration (`mpiexec -n 2 zmpi plan --hardware this`) does: rank 0 alone
    prints it and writes the file (every rank did)."""
    out = tmp_path / "plan.json"
    r = launch_mpi(CLI, 2, ["plan", *SMALL_FLAGS, "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.describe()
    assert r.stdout.count("layouts considered") == 1 and r.stdout.count(f"--config {out}") == 1
    config = json.loads(out.read_text())
    assert config["model"] == {"n_layer": 2, "d_model": 32, "n_head": 2, "vocab_size": 65,
                               "seq_len": 16}
    run = launch_mpi(CLI, 2, ["train", "--config", str(out), "--steps", "2",
                              "--sample-tokens", "0", "--out", str(tmp_path / "run")],
                     timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    saved = json.loads((tmp_path / "run" / "run.json").read_text())
    assert saved["config"]["model"] == config["model"]
    assert saved["config"]["zero_optimization"]["stage"] == config["zero_optimization"]["stage"]


def test_plan_json_and_bad_inputs(tmp_path):
    r = _plan(*SMALL_FLAGS, "--json", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["candidates"] and answer["fitting"] >= len(answer["candidates"])
    (tmp_path / "hw.json").write_text(json.dumps(PRESETS["cpu"].to_dict()))
    for flags, message in (
            (["--n-head", "3"], "does not divide"),
            (["--hardware", "tpu9"], "tpu9"),
            (["--device-memory", "lots"], "--device-memory"),
            (["--nodes", "0"], "nodes"),
            (["--n-layer", "5000"], "n_layer 5,000 is beyond what the planner takes"),
            (["--n-head", "1", "--n-layer", "1", "--gpus-per-node", "4", "--global-batch", "3"],
             "no layout of 4 ranks splits the global batch 3"),
            (["--hardware", "a100", "--gpus-per-node", "16"],
             "the a100 hardware has 8 devices per node"),
            (["--out", str(tmp_path)], "a directory; give a file name"),
            (["--out", str(tmp_path / "no" / "p.json")], "no directory"),
            (["--save-hardware", str(tmp_path / "x.json")], "name one file"),
            (["--hardware", str(tmp_path / "hw.json"), "--save-hardware",
              str(tmp_path / "hw.json"), "--out", str(tmp_path / "p.json")],
             "is the --hardware file it would replace")):
        given = {f for f in flags if f.startswith("--")}
        pairs = zip(SMALL_FLAGS[::2], SMALL_FLAGS[1::2], strict=True)
        base = [item for flag, value in pairs if flag not in given for item in (flag, value)]
        out = [] if "--out" in given else ["--out", str(tmp_path / "x.json")]
        r = _plan(*base, *flags, *out)
        assert r.returncode == 2 and message in r.stderr, (flags, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert json.loads((tmp_path / "hw.json").read_text()) == PRESETS["cpu"].to_dict()
    r = _plan(*SMALL_FLAGS, "--device-memory", "1kB", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 1 and "no layout fits" in r.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--n-kv-head", "2"], "n_kv_head: a Llama's; give model llama"),
    (["--model", "llama", "--n-kv-head", "3"], "num_key_value_heads=3 does not divide "
     "num_attention_heads=4"),
    (["--moe", '{"num_experts": 4, "ep_size": 2}'], "moe.ep_size: the planner searches it"),
    (["--moe", "4", "--model", "llama"], "moe: MoE blocks are a GPT's"),
    (["--moe", "{"], "--moe {: "),
])
def test_bad_llama_and_moe_plans_are_one_line(flags, message):
    r = _plan("--n-layer", "2", "--d-model", "32", "--n-head", "4", "--vocab", "65",
              "--seq-len", "16", "--global-batch", "2", "--nodes", "1", "--gpus-per-node", "1",
              "--hardware", "cpu", *flags, timeout=60)
    [line] = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.startswith(f"zmpi plan: {message}"), line


def test_the_table_counts_in_the_right_number(capsys):
    """'1 layers', '1 heads', '1 ranks', '1 need more' were printed as such."""
    from zmpi.cli.plan import _print_table
    from zmpi.plan.search import Plan

    _print_table(Job(1, 32, 1, 65, 16, 4, 1, 1, "fp32"), PRESETS["cpu"],
                 Plan([], 2, 1, {"device memory": 1, "host memory": 0}), None, 0.1)
    out = capsys.readouterr().out
    assert out.startswith("GPT 1 layer, d 32, 1 head, ") and " 1 x 1 = 1 rank of cpu " in out
    assert "2 layouts considered in 0.1 s, 1 fit (1 needs more device memory)" in out


def test_a_step_time_that_is_not_finite_is_refused_not_ranked(tmp_path):
    """A hardware file with an absurd figure ("layer_overhead": 1e308) printed nan step
    times, ranked the layouts on them and wrote plan.json, exit 0: now the file is refused
    (its figures bounded, docs/plan.md), and plan() refuses a prediction that is not finite
    from a Hardware made without the bounds."""
    hw = dataclasses.replace(PRESETS["cpu"], layer_overhead=1e308)
    with pytest.raises(ValueError, match=r"the predicted step time of .* on cpu is (inf|nan)"):
        plan(Job(2, 32, 2, 65, 16, 4, 1, 2, "fp32"), hw)
    (tmp_path / "hw.json").write_text(json.dumps(hw.to_dict()))
    r = _plan(*SMALL_FLAGS[:-1], str(tmp_path / "hw.json"), "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.splitlines() == [f"zmpi plan: hardware file {tmp_path / 'hw.json'}: "
                                     "hardware: layer_overhead 1e+308 is outside the plausible "
                                     "range 0 to 10 s"]
    assert not (tmp_path / "p.json").exists()


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, tmpfs):
    """--out / --save-hardware on a device (a link to /dev/full: a write through it was a
    traceback at the end, exit 1), a FIFO or a read-only mount: one line, exit 2, before
    the hardware is read (a measurement would come first) or anything is written. A disk
    that fills by the end: one line, exit 1, the file as it was (no partial file)."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "full").symlink_to("/dev/full")
    read_only, full = tmpfs("ro,size=64k"), tmpfs("size=4k")
    (full / "filler").write_bytes(b"x" * 4096)
    for flag, path, message in (
            ("--out", tmp_path / "full", "(a link to /dev/full): a character device, not a "
             "regular file"),
            ("--save-hardware", tmp_path / "fifo", "a FIFO, not a regular file"),
            ("--out", read_only / "p.json", f"cannot write in {read_only}: Read-only file "
             "system"),
            ("--save-hardware", read_only / "hw.json", "Read-only file system")):
        out = [] if flag == "--out" else ["--out", str(tmp_path / "p.json")]
        r = _plan(*SMALL_FLAGS[:-1], str(tmp_path / "missing.json"), flag, str(path), *out)
        assert r.returncode == 2 and message in r.stderr, (flag, path, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stderr
    assert not (tmp_path / "p.json").exists()
    assert (tmp_path / "full").resolve() == Path("/dev/full")
    for flag in ("--out", "--save-hardware"):
        out = [] if flag == "--out" else ["--out", str(tmp_path / "p.json")]
        r = _plan(*SMALL_FLAGS, flag, str(full / "x.json"), *out)
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip().splitlines()[-1] == \
            f"zmpi plan: {full / 'x.json'}: not written: No space left on device"
        assert "Traceback" not in r.stderr and sorted(p.name for p in full.iterdir()) == \
            ["filler"]


def test_oversubscribed_efficiency_slows_only_ranks_beyond_the_cores():
    """A rank of a CPU whose ranks outnumber its cores computes at cores / ranks of its rate
    times oversubscribed_efficiency; ranks with a core each are not affected; the field is a
    fraction in (0, 1]."""
    cpu = {**PRESETS["cpu"].to_dict(), "cores_per_node": 2, "devices_per_node": 4}
    job = Job(4, 64, 4, 65, 32, 16, 1, 4, "fp32")
    dp = Layout(4, 1, 1, 0, "none", "none", False, 1, 4, "1f1b")
    full = step_time(job, dp, Hardware.from_dict(cpu))
    slower = step_time(job, dp, Hardware.from_dict({**cpu, "oversubscribed_efficiency": 0.8}))
    assert slower.compute == pytest.approx(full.compute / 0.8)
    alone = {**cpu, "cores_per_node": 4}
    assert step_time(job, dp, Hardware.from_dict({**alone, "oversubscribed_efficiency": 0.8})) \
        == step_time(job, dp, Hardware.from_dict(alone))
    with pytest.raises(ValueError, match="oversubscribed_efficiency"):
        Hardware.from_dict({**cpu, "oversubscribed_efficiency": 1.5})


def test_a_long_search_reports_progress_even_when_nothing_fits():
    """Every 20,000 layouts considered, fitting or not (the count used to be checked only
    after a layout that fit)."""
    from zmpi.plan.search import plan

    job = Job(128, 25600, 160, 51200, 2048, 3072, 384, 8, "fp16")  # 37,272 layouts
    said = []
    result = plan(job, PRESETS["a100"], device_memory=1e9, progress=said.append)
    assert result.fitting == 0 and said == ["20000 layouts considered, 0 fit"]
