"""What `zmpi plan` chooses between: a `Layout` (the process mesh, the ZeRO stage, offload,
recompute, micro-batching and schedule) for a `Job` (a GPT shape, a global batch, a cluster),
every candidate layout of a job (`layouts`), and the DeepSpeed-style config that runs one
(`to_config`, what `zmpi train --config` reads).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

PRECISIONS = ("fp16", "bf16", "fp32")
OFFLOADS = ("none", "optimizer", "optimizer+param")
RECOMPUTES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
BUCKET_NUMEL = 50_000_000  # reduce_ and allgather_bucket_size of a plan's config (elements)
JOB_LIMITS = {  # the most of each a Job takes: far beyond any model trained
    "n_layer": 1024, "d_model": 1 << 20, "n_head": 1 << 16, "vocab_size": 1 << 24,
    "seq_len": 1 << 24, "global_batch": 1 << 32, "nodes": 1 << 20, "gpus_per_node": 1 << 12}


@dataclass(frozen=True)
class Job:
    """The model and the run: a GPT (n_layer blocks of width d_model with n_head heads, a
    vocabulary of vocab_size, sequences of seq_len), global_batch sequences per optimizer
    step, on nodes x gpus_per_node ranks, in `precision` (parameter and gradient storage;
    fp16 and bf16 compute in their type on a GPU and in fp32 on a CPU, as zmpi.backend does).
    sparse_attention: None (dense attention), or a DeepSpeed sparse_attention section as JSON
    text (hashable): the activations count its layout's kept blocks (the step time still
    prices attention as dense, an upper bound). vocab_multiple: the vocabulary padded to a
    multiple of it x tp, as zmpi allocates it (`zmpi plan` gives 128 on a GPU, 1 on a CPU:
    models/gpt.py's default_vocab_multiple): the embedding's parameters, the LM head's GEMM and
    its logits count Vp."""

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    global_batch: int
    nodes: int
    gpus_per_node: int
    precision: str = "fp16"
    sparse_attention: str | None = None
    vocab_multiple: int = 1

    def __post_init__(self):
        for name, most in JOB_LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            if value > most:
                raise ValueError(f"{name} {value:,} is beyond what the planner takes (at most "
                                 f"{most:,}, far beyond any model trained)")
        if self.d_model % self.n_head:
            raise ValueError(f"n_head {self.n_head} does not divide d_model {self.d_model}")
        if type(self.vocab_multiple) is not int or self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be an integer >= 1, got "
                             f"{self.vocab_multiple!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.sparse_attention is not None:
            from zmpi.nn.sparsity import model_layout

            model_layout(self.sparsity, self.seq_len)  # ValueError if it cannot be made

    @property
    def sparsity(self):
        """The zmpi.nn.sparsity SparsityConfig of sparse_attention (None: dense attention)."""
        if self.sparse_attention is None:
            return None
        from zmpi.config.sparse import sparse_attention_flag

        return sparse_attention_flag(self.sparse_attention).sparsity(self.n_head)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def param_bytes(self) -> int:
        """Bytes per stored parameter and gradient."""
        return 4 if self.precision == "fp32" else 2

    def act_bytes(self, on_gpu: bool) -> int:
        """The activations' itemsize: fp16 and bf16 compute in their type on a GPU only."""
        return 2 if self.precision in ("fp16", "bf16") and on_gpu else 4


@dataclass(frozen=True)
class Layout:
    """One way to run a Job: dp x pp x tp ranks (tensor fastest, then data, then pipeline, as
    zmpi.parallel.mesh orders them), ZeRO `stage`, `offload` (none, the optimizer, or the
    optimizer and the parameters), activation `recompute`, sequence parallelism (tp > 1),
    `micro_batch` sequences per rank per micro-step, `micro_batches` m per optimizer step
    (gradient accumulation, and the pipeline's micro-batches), the pipeline `schedule`."""

    dp: int
    pp: int
    tp: int
    stage: int
    offload: str
    recompute: str
    sequence_parallel: bool
    micro_batch: int
    micro_batches: int
    schedule: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line: 'dp 4 pp 2 tp 8, stage 1, offload none, recompute full, sp, b 1 x m 16
        (1f1b)'."""
        sp = ", sp" if self.sequence_parallel else ""
        schedule = f" ({self.schedule})" if self.pp > 1 else ""
        return (f"dp {self.dp} pp {self.pp} tp {self.tp}, stage {self.stage}, offload "
                f"{self.offload}, recompute {self.recompute}{sp}, b {self.micro_batch} x m "
                f"{self.micro_batches}{schedule}")


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (pairs up to sqrt(n): a batch of 2e9 is quick)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def stage_offloads(stage: int) -> list[str]:
    """The OFFLOADS a ZeRO stage takes: none at stage 0 (nothing is sharded), the parameters
    only at stage 3 (only it shards them)."""
    return [o for o in OFFLOADS if not (o != "none" and stage == 0)
            and not (o == "optimizer+param" and stage != 3)]


def layouts(job: Job, max_tp: int | None = None):
    """Every Layout zmpi can run `job` with (a generator): tp divides the heads (at most
    `max_tp`, default a node's GPUs: tensor parallelism stays inside a node), pp at most the
    model's units, dp x pp x tp the world; the global batch splits into dp x micro_batch x
    micro_batches; parameter offload with stage 3 only, optimizer offload from stage 1;
    sequence parallelism where tp > 1 divides seq_len; GPipe only with pipelines."""
    world = job.world_size
    max_tp = job.gpus_per_node if max_tp is None else max_tp
    for tp in _divisors(world):
        if tp > max_tp or job.n_head % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > job.n_layer + 2:
                continue
            dp = world // (tp * pp)
            if job.global_batch % dp:
                continue
            per_rank = job.global_batch // dp
            for micro_batch in _divisors(per_rank):
                m = per_rank // micro_batch
                for stage in range(4):
                    for offload in stage_offloads(stage):
                        for recompute in RECOMPUTES:
                            for sp in ((False, True) if tp > 1 and job.seq_len % tp == 0
                                       else (False,)):
                                for schedule in SCHEDULES if pp > 1 else SCHEDULES[:1]:
                                    yield Layout(dp, pp, tp, stage, offload, recompute, sp,
                                                 micro_batch, m, schedule)


def to_config(job: Job, layout: Layout) -> dict:
    """The DeepSpeed-style config `zmpi train --config` runs `layout` of `job` with, launched
    on job.world_size ranks; zmpi's own `model` section carries the GPT shape."""
    config = {
        "train_batch_size": job.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.micro_batches,
        "zero_optimization": {"stage": layout.stage, "overlap_comm": True,
                              "reduce_bucket_size": BUCKET_NUMEL,
                              "allgather_bucket_size": BUCKET_NUMEL},
        "tensor_parallel": {"autotp_size": layout.tp,
                            "sequence_parallel": layout.sequence_parallel},
        "pipeline": {"stages": layout.pp, "schedule": layout.schedule},
        "activation_checkpointing": {"recompute": layout.recompute},
        "model": {"n_layer": job.n_layer, "d_model": job.d_model, "n_head": job.n_head,
                  "vocab_size": job.vocab_size, "seq_len": job.seq_len},
    }
    if job.precision != "fp32":
        config[job.precision] = {"enabled": True}
    if job.sparse_attention is not None:
        config["sparse_attention"] = json.loads(job.sparse_attention)
    if layout.offload != "none":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if layout.offload == "optimizer+param":
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return config
