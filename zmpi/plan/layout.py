"""What `zmpi plan` chooses between: a `Layout` (the process mesh, the ZeRO stage, offload,
recompute, micro-batching and schedule) for a `Job` (a GPT shape, a global batch, a cluster),
every candidate layout of a job (`layouts`), and the DeepSpeed-style config that runs one
(`to_config`, what `zmpi train --config` reads).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass

MODELS = ("gpt", "llama")
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
    its logits count Vp. model: "gpt", or "llama" (models/llama.py: n_layer blocks of
    d_model with n_head query heads and n_kv_head key/value heads (None: n_head), a SwiGLU of
    intermediate_size units (None: LlamaConfig's default), an untied head unless
    tie_word_embeddings); the Llama-only fields are refused for a GPT. moe: a GPT's `moe`
    section as JSON text (hashable; docs/moe.md) without ep_size, which the planner searches
    (`layouts`); None: no MoE blocks."""

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
    model: str = "gpt"
    n_kv_head: int | None = None
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    moe: str | None = None

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
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r}: use one of {', '.join(MODELS)}")
        if self.model == "gpt":
            given = [key for key in ("n_kv_head", "intermediate_size", "tie_word_embeddings")
                     if getattr(self, key) not in (None, False)]
            if given:
                raise ValueError(f"{', '.join(given)}: a Llama's; give model llama")
        else:
            self.llama  # noqa: B018 (LlamaConfig's ValueError, one line, if it cannot be)
        if self.moe is not None:
            if self.model != "gpt":
                raise ValueError("moe: MoE blocks are a GPT's")
            self.moe_section.layer_experts(self.n_layer)  # ConfigError (a ValueError) if not
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
    def llama(self):
        """The LlamaConfig of a Llama job (None for a GPT's)."""
        return None if self.model == "gpt" else _llama_config(self)

    @property
    def moe_section(self):
        """The MoEConfig of `moe` (None without it); a ConfigError naming the key where the
        section is no MoE section, or gives ep_size (the planner chooses it)."""
        return None if self.moe is None else _moe_config(self.moe)

    def expert_parallel_sizes(self, dp: int) -> list[int]:
        """The expert-parallel degrees a layout of dp data-parallel ranks may take: [1]
        without MoE blocks, else the divisors of dp that divide every layer's expert count."""
        if self.moe is None:
            return [1]
        counts = self.moe_section.layer_experts(self.n_layer).values()
        return [e for e in _divisors(dp) if all(c % e == 0 for c in counts)]

    @property
    def tied(self) -> bool:
        """Whether the LM head reads the token embedding (the GPT's always does): a
        pipeline's last stage then holds a copy of it, and stage 3 gathers it for the head."""
        return self.model == "gpt" or self.tie_word_embeddings

    @property
    def tensor_reductions_per_block(self) -> int:
        """A block's b s h collectives over the tensor group per micro-batch, forward and
        backward: the GPT's 4, the Llama's TENSOR_REDUCTIONS_PER_BLOCK (7)."""
        from zmpi.models.llama import TENSOR_REDUCTIONS_PER_BLOCK

        return 4 if self.model == "gpt" else TENSOR_REDUCTIONS_PER_BLOCK

    def block_matmul(self, tp: int) -> int:
        """Multiply-adds per token of one block's matrices on one of tp tensor ranks: the
        GPT's 12 d^2 / tp; the Llama's (2 d^2 + 3 d intermediate_size) / tp and the key/value
        heads it computes (n_kv_head / tp, or one where tp is a multiple of n_kv_head)."""
        d = self.d_model
        if self.model == "gpt":
            return 12 * d * d // tp
        c = self.llama
        kv = max(c.num_key_value_heads // tp, 1) * (d // self.n_head)
        return (2 * d * d + 3 * d * c.intermediate_size) // tp + 2 * d * kv

    def heads_split(self, tp: int) -> bool:
        """Whether tp tensor ranks split the model's heads: tp divides n_head and, for a
        Llama, divides n_kv_head or is a multiple of it."""
        if self.n_head % tp:
            return False
        kv = self.llama.num_key_value_heads if self.model == "llama" else tp
        return kv % tp == 0 or tp % kv == 0

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
    (gradient accumulation, and the pipeline's micro-batches), the pipeline `schedule`, and
    with MoE blocks the expert-parallel degree `ep` (dividing dp)."""

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
    ep: int = 1

    def to_dict(self) -> dict:
        """The fields; `ep` only above 1 (a layout without MoE blocks has none)."""
        out = asdict(self)
        if self.ep == 1:
            del out["ep"]
        return out

    def describe(self) -> str:
        """One line: 'dp 4 pp 2 tp 8, stage 1, offload none, recompute full, sp, b 1 x m 16
        (1f1b)'."""
        sp = ", sp" if self.sequence_parallel else ""
        schedule = f" ({self.schedule})" if self.pp > 1 else ""
        ep = f" ep {self.ep}" if self.ep > 1 else ""
        return (f"dp {self.dp} pp {self.pp} tp {self.tp}{ep}, stage {self.stage}, offload "
                f"{self.offload}, recompute {self.recompute}{sp}, b {self.micro_batch} x m "
                f"{self.micro_batches}{schedule}")


@functools.lru_cache(maxsize=64)
def _moe_config(text: str):
    from zmpi.config import ConfigError, MoEConfig

    section = MoEConfig.from_dict(json.loads(text))
    if section.ep_size != 1:
        raise ConfigError("moe.ep_size", "the planner searches it: leave it out")
    if not section.enabled:
        raise ConfigError("moe.num_experts", "give num_experts")
    return section


@functools.lru_cache(maxsize=64)
def _llama_config(job: Job):
    from zmpi.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=job.vocab_size, hidden_size=job.d_model,
                       intermediate_size=job.intermediate_size, num_hidden_layers=job.n_layer,
                       num_attention_heads=job.n_head, num_key_value_heads=job.n_kv_head,
                       max_position_embeddings=job.seq_len,
                       tie_word_embeddings=job.tie_word_embeddings,
                       vocab_multiple=job.vocab_multiple)


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
    sequence parallelism where tp > 1 divides seq_len; GPipe only with pipelines. With MoE
    blocks: tp 1 and pp 1 (the planner does not count MoE blocks split over tensor ranks or
    stages yet), every expert-parallel degree `Job.expert_parallel_sizes` allows, offload
    only at ep 1."""
    world = job.world_size
    max_tp = job.gpus_per_node if max_tp is None else max_tp
    for tp in _divisors(world):
        if tp > max_tp or not job.heads_split(tp) or (job.moe is not None and tp > 1):
            continue
        for pp in _divisors(world // tp):
            if pp > job.n_layer + 2 or (job.moe is not None and pp > 1):
                continue
            dp = world // (tp * pp)
            if job.global_batch % dp:
                continue
            per_rank = job.global_batch // dp
            for micro_batch, ep in ((b, e) for b in _divisors(per_rank)
                                    for e in job.expert_parallel_sizes(dp)):
                m = per_rank // micro_batch
                for stage in range(4):
                    for offload in stage_offloads(stage)[:1 if ep > 1 else None]:
                        for recompute in RECOMPUTES:
                            for sp in ((False, True) if tp > 1 and job.seq_len % tp == 0
                                       else (False,)):
                                for schedule in SCHEDULES if pp > 1 else SCHEDULES[:1]:
                                    yield Layout(dp, pp, tp, stage, offload, recompute, sp,
                                                 micro_batch, m, schedule, ep)


def to_config(job: Job, layout: Layout) -> dict:
    """The DeepSpeed-style config `zmpi train --config` runs `layout` of `job` with, launched
    on job.world_size ranks; zmpi's own `model` section carries the GPT shape (a Llama's in
    its LlamaConfig names)."""
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
    if job.model == "llama":  # transformers' names (docs/models.md)
        c = job.llama
        config["model"] = {"model_type": "llama", "num_hidden_layers": job.n_layer,
                           "hidden_size": job.d_model, "num_attention_heads": job.n_head,
                           "num_key_value_heads": c.num_key_value_heads,
                           "intermediate_size": c.intermediate_size,
                           "tie_word_embeddings": job.tie_word_embeddings,
                           "vocab_size": job.vocab_size, "seq_len": job.seq_len,
                           "max_position_embeddings": job.seq_len}
    if job.precision != "fp32":
        config[job.precision] = {"enabled": True}
    if job.sparse_attention is not None:
        config["sparse_attention"] = json.loads(job.sparse_attention)
    if job.moe is not None:
        config["moe"] = {**json.loads(job.moe), "ep_size": layout.ep}
    if layout.offload != "none":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if layout.offload == "optimizer+param":
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return config
