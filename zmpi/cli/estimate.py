"""`zmpi estimate`: model-state memory and traffic per rank from the ZeRO formulas
(zmpi.memory.estimate_rows), for a parameter count or a GPT shape; with --tp, over the
data-parallel ranks of each tensor rank's share, plus Megatron's tensor-parallel traffic (with
--sequence-parallel, Korthikanti et al.'s reduce-scatters and allgathers); with --micro-batch,
the activation memory per rank (zmpi.models.gpt_counts.gpt_activation_bytes) beside Korthikanti et
al.'s count (docs/activation-memory.md); with --moe, a GPT shape's MoE blocks counted in Psi
(each tensor rank's share under --tp), and at the section's ep_size above 1 their experts'
states per rank over the ranks holding the same experts (zmpi.memory.expert_groups; placed on
the device or the host as the dense states with the offload flags; docs/moe.md), with
--micro-batch (tp 1) their activations and the all-to-all (models/moe_counts.py); with
--model llama, a Llama's (models/llama.py)."""
from __future__ import annotations

import json
import math

from zmpi.memory import estimate_rows
from zmpi.models.gpt_counts import (
    gpt_activation_bytes,
    gpt_expert_numel,
    gpt_num_params,
    korthikanti_activation_bytes,
)
from zmpi.models.llama import (
    TENSOR_REDUCTIONS_PER_BLOCK,
    llama_activation_bytes,
    llama_num_params,
)
from zmpi.models.moe_counts import moe_alltoall
from zmpi.nn.attention import attention_block

# The activations' itemsize by --precision on a GPU: fp16 and bf16 compute in their 16-bit
# type there (zmpi.backend.compute_dtype; on the NumPy backend both compute in fp32)
ACTIVATION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


class Refused(SystemExit):
    """A bad `zmpi estimate` input, in one line (str): the command prints it and exits with
    code 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return f"zmpi estimate: {self.message}"


SHAPE_DEFAULTS = {"d_model": 768, "vocab_size": 50257, "seq_len": 1024}  # GPT-2 small's


def check_inputs(args) -> None:
    """Refused unless the numbers can mean a model and a run: --params a finite whole count
    >= 1, or a GPT shape of integers >= 1 (within zmpi plan's limits; its other flags filled
    from SHAPE_DEFAULTS), never both; --world-size, --tp and the byte counts >= 1."""
    from zmpi.plan.layout import JOB_LIMITS

    shape = [f"--{k.replace('_', '-')}" for k in SHAPE_DEFAULTS if getattr(args, k) is not None]
    if (args.params is None) == (args.n_layer is None):
        raise Refused("give --params, or a GPT shape (--n-layer, --d-model, --vocab-size, "
                      "--seq-len)")
    if args.params is not None:
        if shape:
            raise Refused(f"{', '.join(shape)}: a GPT shape's, which --params replaces: give "
                          "the shape with --n-layer, or --params alone")
        if not (math.isfinite(args.params) and args.params >= 1 and args.params.is_integer()):
            raise Refused(f"--params must be a whole number >= 1, got {args.params!r}")
    else:
        for key, default in SHAPE_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        for key in ("n_layer", *SHAPE_DEFAULTS):
            value, most = getattr(args, key), JOB_LIMITS[key]
            if not 1 <= value <= most:
                raise Refused(f"--{key.replace('_', '-')} must be in 1..{most:,}, got {value}")
    if args.params is not None and args.vocab_multiple != 1:
        raise Refused("--vocab-multiple pads a GPT shape's vocabulary: give the shape with "
                      "--n-layer, not --params")
    for flag, value in (("--world-size", args.world_size), ("--tp", args.tp),
                        ("--vocab-multiple", args.vocab_multiple),
                        ("--param-bytes", args.param_bytes),
                        ("--optimizer-bytes", args.optimizer_bytes)):
        if value is not None and value < 1:
            raise Refused(f"{flag} must be >= 1, got {value}")


def moe_section(args):
    """--moe as a MoEConfig for the GPT shape (None without it): an expert count E, or a `moe`
    config section as JSON (docs/moe.md). Under --tp each tensor rank's share of the MoE
    blocks is counted (`moe_block_numel`: every expert split as the dense MLP, the router
    whole); with offload flags the expert states are placed as the dense ones (the engine
    offloads both strategies). Refused with --params, at ep_size above 1 where it does not
    divide the data-parallel size (--world-size / --tp), with --micro-batch at --tp above 1
    (the MoE blocks' activations and all-to-all are counted at tp 1 only), or where the
    section does not fit the shape."""
    from zmpi.config import ConfigError, MoEConfig

    flag = getattr(args, "moe", None)
    if flag is None:
        return None
    for given, why in ((args.params is not None, "needs a GPT shape (--n-layer), not --params"),
                       (args.tp > 1 and args.micro_batch is not None,
                        "--micro-batch counts the MoE blocks' activations and all-to-all at "
                        "--tp 1 only: leave out --micro-batch, or give --tp 1")):
        if given:
            raise Refused(f"--moe {flag}: {why}")
    try:
        moe = MoEConfig.from_dict(moe_flag(flag))
        moe.layer_experts(args.n_layer)
    except ConfigError as e:
        raise Refused(f"--moe {flag}: {e}") from None
    if not moe.enabled:
        raise Refused(f"--moe {flag}: give num_experts")
    dp = args.world_size // args.tp  # (--tp divides --world-size: estimate checks first)
    if moe.ep_size > 1 and dp % moe.ep_size:
        raise Refused(f"--moe {flag}: ep_size {moe.ep_size} does not divide the data-parallel "
                      f"size {dp} (--world-size" + (" / --tp)" if args.tp > 1 else ")"))
    return moe


def moe_flag(flag: str) -> dict:
    """--moe E|JSON (zmpi estimate's and zmpi plan's) as a `moe` section: {"num_experts": E},
    or the JSON object; a ConfigError where the JSON is not one."""
    from zmpi.config import parse_json

    text = flag.strip()
    return parse_json(text, "--moe") if text.startswith("{") else \
        {"num_experts": int(text) if text.isdigit() else text}


def llama_shape(args):
    """The LlamaConfig of --model llama's shape (None for a GPT's): --n-layer, --d-model,
    --n-head (required), --n-kv-head, --intermediate-size, --tie-word-embeddings,
    --vocab-size. Refused with --params and --moe (a Llama has no MoE blocks), or a shape the
    model refuses; the Llama-only flags are refused for a GPT."""
    from zmpi.models.llama import LlamaConfig

    llama_only = [flag for flag, given in (
        ("--n-kv-head", args.n_kv_head is not None),
        ("--intermediate-size", args.intermediate_size is not None),
        ("--tie-word-embeddings", args.tie_word_embeddings)) if given]
    if args.model != "llama":
        if llama_only:
            raise Refused(f"{', '.join(llama_only)}: a Llama's; add --model llama")
        return None
    for given, why in ((args.params is not None, "needs a shape (--n-layer), not --params"),
                       (args.n_head is None, "needs --n-head (its key/value width)"),
                       (getattr(args, "moe", None) is not None, "a Llama has no MoE blocks")):
        if given:
            raise Refused(f"--model llama: {why}")
    try:
        return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.d_model,
                           intermediate_size=args.intermediate_size,
                           num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                           num_key_value_heads=args.n_kv_head,
                           max_position_embeddings=args.seq_len,
                           tie_word_embeddings=args.tie_word_embeddings)
    except ValueError as e:
        raise Refused(f"--model llama: {e}") from None


def estimate(args) -> None:
    """Print the ZeRO paper's per-rank model-state memory and traffic for each stage (or
    --stage); with offload flags, device and host memory (ZeRO-Offload); with --micro-batch,
    the activations per rank (`activation_memory`); --json for a machine-readable answer.
    A bad input is Refused."""
    check_inputs(args)
    tp = args.tp
    if args.world_size % tp:  # (tp >= 1: check_inputs)
        raise Refused(f"--tp {tp} does not divide --world-size "
                      f"{args.world_size} into data-parallel replicas")
    if args.micro_batch is not None and (args.n_layer is None or args.micro_batch < 1):
        raise Refused("--micro-batch needs a GPT shape and is >= 1")
    llama = llama_shape(args)
    moe = moe_section(args)
    if llama is not None:  # what one rank allocates (key/value heads whole where kv < tp)
        if args.n_head % tp or (llama.num_key_value_heads % tp and
                                tp % llama.num_key_value_heads):
            raise Refused(f"--tp {tp} must divide --n-head {args.n_head}, and divide or be a "
                          f"multiple of the key/value heads {llama.num_key_value_heads}")
        psi = llama_num_params(llama, tp, args.vocab_multiple)
    else:
        psi = args.params / tp if args.params is not None else gpt_num_params(
            args.n_layer, args.d_model, args.vocab_size, args.seq_len, tp, args.vocab_multiple,
            moe)
    ep = moe.ep_size if moe is not None else 1
    experts = gpt_expert_numel(args.n_layer, args.d_model, moe, tp) if ep > 1 else 0
    dp = args.world_size // tp
    pb = args.param_bytes if args.param_bytes is not None else \
        (4 if args.precision == "fp32" else 2)
    k = args.optimizer_bytes if args.optimizer_bytes is not None else 12
    stages = range(4) if args.stage is None else [args.stage]
    rows = estimate_rows(psi, dp, stages, pb, k, args.offload_optimizer, args.offload_param,
                         experts, ep)
    if args.sequence_parallel and (tp == 1 or args.micro_batch is None):
        raise Refused("--sequence-parallel needs --tp above 1 and "
                      "--micro-batch")
    per_block = 4 if llama is None else TENSOR_REDUCTIONS_PER_BLOCK
    tensor = tensor_traffic(args, per_block) if tp > 1 and args.micro_batch else None
    ops = tensor_ops(args, per_block) if tensor is not None else None
    activation = activation_memory(args, moe, llama)
    alltoall = None if moe is None or ep == 1 or args.micro_batch is None else moe_alltoall(
        args.n_layer, args.d_model, args.seq_len, args.micro_batch, moe,
        args.recompute or "none")
    if args.json:
        print(json.dumps({"params": psi, "expert_params": experts, "ep": ep,
                          "world_size": args.world_size, "tp": tp, "dp": dp,
                          "param_bytes": pb, "optimizer_bytes": k,
                          "offload_optimizer": args.offload_optimizer,
                          "offload_param": args.offload_param, "stages": rows,
                          "tensor_traffic_elements": tensor, "tensor_traffic_ops": ops,
                          "activation": activation, "alltoall": alltoall}, indent=2))
        return
    offload = args.offload_optimizer or args.offload_param
    print(f"Psi = {psi:.4g} parameters" + (f" per tensor rank (tp = {tp})" if tp > 1 else "")
          + f", N = {dp} {'data-parallel ' if tp > 1 else ''}ranks, {pb}-byte params and "
          f"grads, K = {k}" + (f"; offload: optimizer {'on' if args.offload_optimizer else 'off'}"
                               f", params {'on' if args.offload_param else 'off'}"
                               if offload else "")
          + (f"; experts {experts:.4g} of them, over ep = {ep} ranks and ZeRO over the "
             f"{dp // ep} holding the same" if ep > 1 else ""))
    if tensor is not None and not args.sequence_parallel:
        print(f"tensor-parallel traffic per step and micro-batch: {tensor:.4g} elements "
              f"allreduced (({per_block} L + 2) B T C + 3 B T), each rank sending 2 (T-1)/T of "
              "them")
    elif tensor is not None:
        print(f"tensor-parallel traffic per step and micro-batch, sequence parallel: "
              f"{ops['reduce_scatter']:.4g} elements reduce-scattered and as many allgathered "
              f"(({per_block} L + 2) B T C each, every rank sending (T-1)/T of them), "
              f"{ops['allreduce']:.4g} allreduced (3 B T, the cross-entropy)")
    if alltoall is not None:
        print_alltoall(alltoall, ep, ACTIVATION_BYTES[args.precision])
    if activation is not None:
        print_activations(activation, args)
    if not offload:
        print(f"{'stage':>5} {'GB per rank':>12} {'traffic per step (elements)':>28}")
        for r in rows:
            print(f"{r['stage']:>5} {r['device_gb']:>12.1f} {r['traffic_elements']:>28.3g}")
        return
    print(f"{'stage':>5} {'device GB':>10} {'host GB':>9} {'traffic per step (elements)':>28}")
    for r in rows:
        if "error" in r:
            print(f"{r['stage']:>5} {'-':>10} {'-':>9} {'':>28}  ({r['error']})")
        else:
            print(f"{r['stage']:>5} {r['device_gb']:>10.1f} {r['host_gb']:>9.1f} "
                  f"{r['traffic_elements']:>28.3g}")


def tensor_traffic(args, per_block: int = 4) -> int:
    """Elements allreduced over the tensor-parallel group per micro-step (forward and backward)
    by zmpi's GPT: 4 of B T C per block (f and g of attention and MLP; a Llama's
    `TENSOR_REDUCTIONS_PER_BLOCK`, 7, given as per_block), 1 each for the
    vocabulary-parallel embedding and the LM head's input gradient, and 3 of B T for the
    cross-entropy (max, sum of exponentials, target logit). Full recompute's second forward
    is not counted."""
    return sum(tensor_ops(args, per_block, sequence_parallel=False).values())


def tensor_ops(args, per_block: int = 4, sequence_parallel=None) -> dict[str, int]:
    """`tensor_traffic` by collective, {op: elements of the calls' buffers} as the counters
    count them: without sequence parallelism (None: --sequence-parallel's) all of it
    allreduced; with it the blocks', embedding's and LM head's (per_block L + 2) B T C
    reduce-scattered and as many allgathered (the same bytes sent per rank), the
    cross-entropy's 3 B T allreduced. (The sequence-parallel parameters' gradient sum, once a
    step, is not activations and not counted here.)"""
    positions = args.micro_batch * args.seq_len
    blocks = (per_block * args.n_layer + 2) * positions * args.d_model
    if sequence_parallel is None:
        sequence_parallel = args.sequence_parallel
    if not sequence_parallel:
        return {"allreduce": blocks + 3 * positions}
    return {"allreduce": 3 * positions, "reduce_scatter": blocks, "allgather": blocks}


def activation_memory(args, moe=None, llama=None) -> dict | None:
    """With --micro-batch: the activations one rank keeps for backward (bytes), by
    zmpi.models.gpt_counts.gpt_activation_bytes ("zmpi"; the MoE blocks of `moe`, the --moe section,
    at their bound: every capacity slot filled) and Korthikanti et al.'s Table 2
    ("korthikanti", a dense GPT's), with the heads, recompute policy and activation itemsize
    they are for; None without --micro-batch. llama: the LlamaConfig of --model llama, counted
    by zmpi.models.llama.llama_activation_bytes. A flag that cannot act is a SystemExit naming
    it."""
    given = [flag for flag, value in (
        ("--n-head", args.n_head is not None and getattr(args, "model", "gpt") != "llama"),
        ("--recompute", args.recompute is not None),
        ("--sparse-attention", args.sparse_attention is not None),
        ("--partition-activations", args.partition_activations),
        ("--cpu-checkpointing", args.cpu_checkpointing)) if value]
    if args.micro_batch is None:
        if given:
            raise Refused("without --micro-batch there is no activation "
                          f"memory for {', '.join(given)} to act on")
        return None
    tp, recompute = args.tp, args.recompute or "none"
    if (args.partition_activations or args.cpu_checkpointing) and recompute != "full":
        raise Refused("--partition-activations and --cpu-checkpointing act "
                      "on the inputs full recompute keeps: add --recompute full")
    if args.partition_activations and (tp == 1 or args.sequence_parallel):
        raise Refused("--partition-activations splits the kept inputs over "
                      "the tensor ranks: it needs --tp above 1, without --sequence-parallel "
                      "(whose kept inputs are each rank's share already)")
    n_head = args.n_head if args.n_head is not None else max(args.d_model // 64, tp)
    if n_head < 1 or args.d_model % n_head or n_head % tp:
        raise Refused(f"{n_head} heads"
                      + ("" if args.n_head is not None else " (the default)")
                      + f" must divide --d-model {args.d_model} and be a multiple of --tp "
                      f"{tp}: give --n-head")
    if args.sequence_parallel and args.seq_len % tp:
        raise Refused(f"--seq-len {args.seq_len} is not a multiple of --tp "
                      f"{tp}, as sequence parallelism needs")
    sparsity = _sparsity(args.sparse_attention, n_head, args.seq_len)
    act_bytes = ACTIVATION_BYTES[args.precision]
    block = attention_block(args.seq_len, args.micro_batch * n_head // tp, on_device=True)
    shape = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": n_head,
             "seq_len": args.seq_len, "micro_batch": args.micro_batch, "tp": tp,
             "sequence_parallel": args.sequence_parallel, "recompute": recompute}
    options = {"act_bytes": act_bytes, "vocab_multiple": args.vocab_multiple,
               "partition": args.partition_activations, "cpu": args.cpu_checkpointing,
               "block": block, "sparsity": sparsity}
    if llama is None:
        zmpi = gpt_activation_bytes(vocab_size=args.vocab_size, moe=moe, **options, **shape)
    else:
        zmpi = llama_activation_bytes(llama, args.micro_batch, tp=tp, recompute=recompute,
                                      sequence_parallel=args.sequence_parallel, **options)
    return {"n_head": n_head, "recompute": recompute, "act_bytes": act_bytes,
            "sparse_attention": None if sparsity is None else args.sparse_attention,
            "partition": args.partition_activations, "cpu": args.cpu_checkpointing,
            "zmpi": zmpi, "korthikanti": korthikanti_activation_bytes(**shape)}


def _sparsity(flag, n_head: int, seq_len: int):
    """--sparse-attention's layout config for n_head heads (None without the flag), its
    layout checked at seq_len; Refused (one line) if it cannot be made."""
    from zmpi.config import ConfigError
    from zmpi.config.sparse import sparse_attention_flag
    from zmpi.nn.sparsity import model_layout

    if flag is None:
        return None
    try:
        sparsity = sparse_attention_flag(flag).sparsity(n_head)
        model_layout(sparsity, seq_len)
    except (ConfigError, ValueError) as e:
        raise Refused(f"--sparse-attention {flag}: {e}") from None
    return sparsity


def print_alltoall(a2a: dict, ep: int, act_bytes: int) -> None:
    """The line of `moe_alltoall` in the text output."""
    bound = " at most (dropless: capacity counted as its bound, a sequence)" \
        if a2a["upper_bound"] else ""
    print(f"expert-parallel all-to-all per step and micro-batch, over ep = {ep} ranks: "
          f"{a2a['calls']} calls of capacity buffers, {a2a['elements']:.4g} elements "
          f"({_size(a2a['elements'] * act_bytes)}){bound}, each rank sending {ep - 1}/{ep} "
          f"of them" + (f"; {a2a['scalar_calls']} allreduce_scalar of the capacity"
                        if a2a["scalar_calls"] else ""))


def print_activations(act: dict, args) -> None:
    """The lines of `activation_memory` in the text output."""
    z, k = act["zmpi"], act["korthikanti"]
    sbh = args.micro_batch * args.seq_len * args.d_model
    kept = " and ".join(w for w, on in (("partitioned", act["partition"]),
                                        ("on the host", act["cpu"])) if on)
    print(f"activations per rank: micro-batch {args.micro_batch} x {args.seq_len} tokens, "
          f"{act['n_head']} heads, {act['act_bytes']}-byte activations ({args.precision}), "
          f"recompute {act['recompute']}{', kept inputs ' + kept if kept else ''}"
          + (f", sparse attention {act['sparse_attention']}" if act["sparse_attention"] else "")
          + " (docs/activation-memory.md)")
    layer = f"s b h ({z['A']:.4g} + {z['B']:.4g} a s / h) = {_size(z['layer'])}"
    if act["recompute"] != "full":
        print(f"  per layer {layer}; Korthikanti et al.: s b h ({k['A']:.4g} + {k['B']:.4g} "
              f"a s / h) = {_size(k['layer'])}")
    else:
        print(f"  kept per layer s b h x {z['kept_per_layer'] / sbh:.4g} = "
              f"{_size(z['kept_per_layer'])}; Korthikanti et al.: s b h x {k['A']:.4g} = "
              f"{_size(k['layer'])}; kept in all (token ids too) {_size(z['kept'])}")
        print(f"  working set: one block {layer}, or the LM head and loss "
              f"{_size(z['head'] + z['loss'])}")
    moe = [size for size in z["blocks"] if size != z["layer"]]
    if moe:
        print(f"  MoE blocks: {len(moe)} of {args.n_layer}, "
              f"{' or '.join(_size(size) for size in sorted(set(moe)))} each in place of a "
              "layer (every capacity slot filled: a bound; models/moe_counts.py)")
    print(f"  embedding {_size(z['embedding'])}, LM head {_size(z['head'])}, loss "
          f"{_size(z['loss'])}")
    host = f" and {_size(z['host'])} on the host" if z["host"] else ""
    print(f"  peak {_size(z['device'])} on the device{host}, at {z['peak_at']}; Korthikanti "
          f"et al.'s {args.n_layer} layers: {_size(k['total'])}")


def _size(nbytes: float) -> str:
    """Bytes in GB, MB or kB (powers of 1000, as the model-state table's GB), 4 digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.4g} B"
