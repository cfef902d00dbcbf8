"""`zmpi plan --model llama`: the Llama's units, pipeline stages, activations, FLOPs and tensor
collectives in the planner (zmpi.plan, from models/llama.py's counts) against the model and
its counts, and the config it writes (zmpi train runs it); its bad inputs: tests/test_plan.py.
The tensor group's calls against a run: tests/test_activation_memory.py's Llama launch."""
import json
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import REPO_ROOT

from zmpi.models.llama import (
    Llama,
    LlamaConfig,
    llama_activation_bytes,
    llama_flops_per_token,
    llama_num_params,
)
from zmpi.parallel.pipeline.stage import PipelineStage
from zmpi.plan.hardware import PRESETS
from zmpi.plan.layout import Job, Layout, layouts, to_config
from zmpi.plan.memory import micro_batch_activation, stage_units
from zmpi.plan.search import model_flops_per_step, plan

SHAPE = {"n_layer": 4, "d_model": 64, "n_head": 4, "vocab_size": 65, "seq_len": 32,
         "global_batch": 8, "nodes": 1, "gpus_per_node": 4, "precision": "fp32"}


def _job(**kw):
    return Job(**{**SHAPE, "model": "llama", "n_kv_head": 2, "intermediate_size": 176, **kw})


def _config(job):
    return LlamaConfig(vocab_size=job.vocab_size, hidden_size=job.d_model,
                       intermediate_size=job.intermediate_size, num_hidden_layers=job.n_layer,
                       num_attention_heads=job.n_head, num_key_value_heads=job.n_kv_head,
                       max_position_embeddings=job.seq_len,
                       tie_word_embeddings=job.tie_word_embeddings, vocab_multiple=1)


@pytest.mark.parametrize("tied", (False, True), ids=("untied", "tied"))
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_stage_units_are_the_llamas_pipeline_stages(pp, tied):
    """Each stage's units as zmpi.parallel.pipeline builds them: an untied head holds its own
    rows (no copy of the embedding on the last stage), a tied one reads a held copy."""
    job = _job(tie_word_embeddings=tied)
    for stage in range(pp):
        built = PipelineStage(Llama(_config(job), seed=0), stage, pp)
        sizes = [sum(int(p.data.size) for _, p in u.named_parameters()) for u in built.units]
        assert list(stage_units(job, pp, 1)[stage]) == sizes, (pp, stage)
    assert sum(stage_units(job, 1, 1)[0]) == llama_num_params(_config(job))


def test_activations_flops_and_matrices_are_the_llamas():
    """The planner's activations are `llama_activation_bytes`, its model FLOPs three forwards
    of `llama_flops_per_token` a token, and a block's matrices on a tensor rank the matrix part
    of that count (q, o, gate, up, down over tp; the key/value heads it computes)."""
    job = _job()
    c = _config(job)
    for tp, sp, recompute in ((1, False, "none"), (2, True, "selective"), (4, True, "full")):
        got = micro_batch_activation(job, tp, sp, recompute, 2, on_gpu=True)
        want = llama_activation_bytes(c, 2, 4, tp, sequence_parallel=sp, recompute=recompute,
                                      block=job.seq_len)
        assert got == want, (tp, sp, recompute)
    tokens = job.global_batch * job.seq_len
    assert model_flops_per_step(job) == 3 * tokens * llama_flops_per_token(c, job.seq_len)
    attention = 2 * job.d_model * (job.seq_len + 1)
    blocks = llama_flops_per_token(c, job.seq_len) - 2 * job.d_model * job.vocab_size
    assert 2 * job.block_matmul(1) == blocks / job.n_layer - attention
    hd = job.d_model // job.n_head  # tp 4 > 2 key/value heads: one each, whole
    assert job.block_matmul(4) == (2 * 64 * 64 + 3 * 64 * 176) // 4 + 2 * 64 * hd


def test_layouts_split_the_key_value_heads_or_replicate_them():
    """tp 1, 2 (2 key/value heads split) and 4 (each replicated on 2 ranks) with 2 key/value
    heads; with 12 query heads and 4 key/value heads on 6 ranks not tp 3 or 6 (neither
    divides the other), though they divide the query heads."""
    assert {layout.tp for layout in layouts(_job())} == {1, 2, 4}
    assert {layout.tp for layout in layouts(_job(d_model=96, n_head=12, n_kv_head=4,
                                                 gpus_per_node=6, global_batch=6))} == {1, 2}


def test_llama_plan_fits_and_writes_a_llama(tmp_path):
    """The fastest layouts fit the device (90% of it), and the config names the Llama in
    transformers' names; `zmpi train --config` runs it on one rank."""
    job = _job(nodes=1, gpus_per_node=1)
    result = plan(job, PRESETS["cpu"], top=3)
    assert result.best and all(c.memory.device <= 0.9 * PRESETS["cpu"].device_memory
                               for c in result.best)
    out = tmp_path / "plan.json"
    flags = ["--model", "llama", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
             "--n-kv-head", "2", "--intermediate-size", "88", "--vocab", "65", "--seq-len",
             "16", "--global-batch", "2", "--nodes", "1", "--gpus-per-node", "1",
             "--precision", "fp32", "--hardware", "cpu", "--out", str(out)]
    r = subprocess.run([sys.executable, "-m", "zmpi.cli", "plan", *flags], capture_output=True,
                       text=True, timeout=120, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Llama (2 key/value heads, SwiGLU 88) 2 layers")
    config = json.loads(out.read_text())
    assert config["model"] == {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 88,
        "tie_word_embeddings": False, "vocab_size": 65, "seq_len": 16,
        "max_position_embeddings": 16}
    run = subprocess.run([sys.executable, "-m", "zmpi.cli", "train", "--config", str(out),
                          "--steps", "1", "--sample-tokens", "0", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "zmpi train: Llama" in run.stdout
    assert to_config(_job(), Layout(1, 1, 4, 1, "none", "none", False, 1, 8, "1f1b"))[
        "model"]["num_key_value_heads"] == 2


def test_a_gpt_job_is_unchanged():
    """The GPT's job: tied, 4 collectives a block, 12 d^2 a token of matrices."""
    job = Job(**SHAPE)
    assert job.tied and job.tensor_reductions_per_block == 4 and job.llama is None
    assert job.block_matmul(2) == 12 * 64 * 64 // 2
    assert np.isfinite(model_flops_per_step(job))
