"""zmpi against PyTorch on the same work, side by side in one run: step time, tokens/s, MFU.

    mpiexec -n 2 python experiments/bench_vs_torch.py --out results/vs_torch_n2
    make bench NP=2

For each stage the peer a user would pick instead, on CPU with the gloo backend:
stage 0 DistributedDataParallel, 1 ZeroRedundancyOptimizer (AdamW), 2 FSDP2 `fully_shard`
with reshard_after_forward=False, 3 the same with True. Both start from the same GPT-2
weights (zmpi's, copied into a torch mirror of the model) and train on the same batches with
AdamW in fp32; the first losses must agree (the same model). Timing: --warmup steps, then the
median of --steps, zmpi and PyTorch taking turns step by step (a drift of the machine's speed
hits both alike). MFU: model FLOPs per step (6 N + 12 L T d per token, the PaLM formula) over
the step time, against the single-thread SGEMM peak measured here at start-up (NumPy's BLAS,
a 1024^3 matmul). Communication: zmpi runs each stage twice, with overlap_comm off (every
collective waited for) and on; on the critical rank (the one busy longest, which never waits
for a slower one, see PhaseProfile.critical_path) the blocked time of the first is the
communication time and that of the second its exposed part. Timings are measurements of this
machine, never a test.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

from results import write_results
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

PEERS = {0: "DDP", 1: "ZeroRedundancyOptimizer", 2: "FSDP2 (no reshard)", 3: "FSDP2"}


def sgemm_peak(n=1024, repeats=5) -> float:
    """FLOP/s of a float32 n^3 matmul on this process's BLAS (best of `repeats`)."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_flops_per_token(cfg: GPTConfig, num_params: int) -> float:
    """6 N (non-embedding parameters, the tied head counted as a matmul) + 12 L T d."""
    non_embedding = num_params - cfg.seq_len * cfg.d_model
    return 6 * non_embedding + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model


def torch_gpt(cfg, weights):
    """A torch mirror of zmpi's GPT with its weights (Linear weights transposed)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = cfg.d_model
            self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
            self.fc, self.fc_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            heads = [t.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2) for t in (q, k, v)]
            y = nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            h = nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh")
            return x + self.fc_proj(h)

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               targets.reshape(-1))

    model = TorchGPT()
    last = cfg.n_layer + 1
    names = {"wte.weight": "units.0.wte", "wpe.weight": "units.0.wpe",
             "ln_f.weight": f"units.{last}.ln_f.weight", "ln_f.bias": f"units.{last}.ln_f.bias"}
    for i in range(cfg.n_layer):
        ours = f"units.{i + 1}."
        for theirs, mine in (("ln1", "ln1"), ("ln2", "ln2"), ("qkv", "attn.qkv"),
                             ("proj", "attn.proj"), ("fc", "mlp.fc"), ("fc_proj", "mlp.proj")):
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{theirs}.{kind}"] = f"{ours}{mine}.{kind}"
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = weights[names[name]]
            p.copy_(torch.from_numpy(w.T.copy() if w.ndim == 2 and "wte" not in name
                                     and "wpe" not in name else w))
    return model


def torch_setup(stage, model, lr, comm):
    """(wrapped model, optimizer) of the PyTorch peer of zmpi's stage."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    adam = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if stage == 0:
        model = DistributedDataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), **adam)
    if stage == 1:
        model = DistributedDataParallel(model)
        return model, ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.AdamW, **adam)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=stage == 3)
    fully_shard(model, reshard_after_forward=stage == 3)
    return model, torch.optim.AdamW(model.parameters(), **adam)


def torch_stepper(stage, model, lr, comm, batches):
    """step index -> mean loss over ranks: one training step of the PyTorch peer."""
    import torch
    import torch.distributed as dist

    peer, optimizer = torch_setup(stage, model, lr, comm)

    def step(i):
        x, y = (torch.from_numpy(b) for b in batches[i])
        optimizer.zero_grad(set_to_none=True)
        loss = peer(x, y)
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        return float(value) / comm.size

    return step


def time_steps(step_fns, warmup, steps):
    """Run each of `step_fns` (step index -> loss) `warmup` times, then `steps` times taking
    turns (step i of each before step i + 1 of any), so that a drift of the machine's speed
    hits them alike; per function, (median seconds of its timed steps, its losses)."""
    losses = [[fn(i) for i in range(warmup)] for fn in step_fns]
    times = [[] for _ in step_fns]
    for i in range(warmup, warmup + steps):
        for fn, seconds, losses_of in zip(step_fns, times, losses, strict=True):
            start = time.perf_counter()
            losses_of.append(fn(i))
            seconds.append(time.perf_counter() - start)
    return [(statistics.median(s), l) for s, l in zip(times, losses, strict=True)]


def _share(exposed: float, comm_s: float) -> str:
    """The exposed share, or '-' where there is (next to) no communication to expose."""
    return "-" if comm_s < 1e-3 else f"{100 * exposed:.0f}%"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--profile", action="store_true", help="zmpi's phase profile per stage")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    comm = Comm()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(comm.bcast_object(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    cfg = GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.d_model)
    peak = comm.allreduce_scalar(sgemm_peak(), op="min")
    data = SyntheticSource(cfg.vocab_size, cfg.seq_len, args.micro_batch * comm.size,
                           comm.rank, comm.size, seed=3)
    batches = [data.sample(i) for i in range(args.warmup + args.steps)]
    tokens = args.micro_batch * comm.size * cfg.seq_len
    rows = []
    for stage in args.stages:
        timed = {}
        # blocking: every collective waited for; at stage 3 also overlapped without prefetch,
        # to measure what prefetching the next unit hides; then overlapped, the run reported,
        # taking turns step by step with the PyTorch peer
        variants = ["blocking"] + (["no_prefetch"] if stage == 3 else []) + ["overlap"]
        for variant in variants:
            model = GPT(cfg, seed=0)
            weights = {n: p.data.copy() for n, p in model.named_parameters()}
            zero = {"stage": stage, "overlap_comm": variant != "blocking",
                    "prefetch": variant != "no_prefetch"}
            engine = Engine(model, {"train_micro_batch_size_per_gpu": args.micro_batch,
                                    "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
                                    "zero_optimization": zero}, comm)
            steps = [lambda i, e=engine: e.train_step(*batches[i])]
            if variant == "overlap":
                steps.append(torch_stepper(stage, torch_gpt(cfg, weights), args.lr, comm,
                                           batches))
            (step_s, losses), *peer = time_steps(steps, args.warmup, args.steps)
            timed[variant] = (step_s, *engine.phases.critical_path(comm)[1:])
            if variant == "overlap":
                our_losses, ((theirs, their_losses),) = losses, peer
                profile = engine.phases.table(comm) if args.profile else None
            engine.close()
        ours = timed["overlap"][0]
        no_prefetch = timed.get("no_prefetch", (None, None))
        if abs(our_losses[0] - their_losses[0]) > 1e-4 * abs(their_losses[0]):
            raise SystemExit(f"stage {stage}: first losses differ (zmpi {our_losses[0]:.6f}, "
                             f"torch {their_losses[0]:.6f}): not the same model")
        flops = model_flops_per_token(cfg, engine.num_params) * tokens / comm.size
        rows.append({"stage": stage, "peer": PEERS[stage], "zmpi_step_s": ours,
                     "torch_step_s": theirs, "ratio": ours / theirs,
                     "zmpi_tokens_per_s": tokens / ours, "torch_tokens_per_s": tokens / theirs,
                     "zmpi_mfu": flops / ours / peak, "torch_mfu": flops / theirs / peak,
                     "zmpi_blocking_step_s": timed["blocking"][0],
                     "comm_s": timed["blocking"][1], "exposed_comm_s": timed["overlap"][1],
                     "exposed": timed["overlap"][1] / max(timed["blocking"][1], 1e-12),
                     "imbalance_s": timed["overlap"][2],
                     "no_prefetch_step_s": no_prefetch[0],
                     "no_prefetch_exposed_comm_s": no_prefetch[1],
                     "first_loss": our_losses[0], "profile": profile})
        if comm.rank == 0 and profile:
            print(f"stage {stage}\n{profile}", flush=True)
    # gloo's teardown races when one rank destroys its group (rank 0 hosts the TCP store)
    # while another still uses it ("terminate called without an active exception")
    comm.barrier()
    dist.destroy_process_group()
    comm.barrier()
    if comm.rank != 0:
        return
    md = [f"GPT d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, vocab "
          f"{cfg.vocab_size}, seq {cfg.seq_len}, micro-batch {args.micro_batch} per rank, fp32, "
          f"{comm.size} ranks x 1 thread; median of {args.steps} steps after {args.warmup}; "
          f"SGEMM peak {peak / 1e9:.1f} GFLOP/s per rank",
          "", "| stage | PyTorch peer | zmpi s/step | PyTorch s/step | zmpi / PyTorch | "
          "zmpi tokens/s | zmpi MFU | PyTorch MFU | comm s/step | exposed | imbalance s/step |",
          "|---" * 11 + "|"]
    for r in rows:
        md.append(f"| {r['stage']} | {r['peer']} | {r['zmpi_step_s']:.3f} | "
                  f"{r['torch_step_s']:.3f} | {r['ratio']:.2f} | {r['zmpi_tokens_per_s']:,.0f} | "
                  f"{100 * r['zmpi_mfu']:.0f}% | {100 * r['torch_mfu']:.0f}% | "
                  f"{r['comm_s']:.3f} | {_share(r['exposed'], r['comm_s'])} | "
                  f"{r['imbalance_s']:.3f} |")
    md += ["", "zmpi runs with overlap_comm on. comm s/step: the time the critical rank (the one "
           "busy longest) is blocked in MPI per step with overlap_comm off (all communication "
           "waited for); exposed: the time it is still blocked with overlap on, as a share of "
           "that; imbalance: what the other ranks wait beyond that for its compute (overlap on)."]
    for r in rows:
        if r["no_prefetch_step_s"] is not None:
            md += ["", f"Stage 3 prefetch (the next unit's allgather starts before this unit "
                   f"computes): {r['zmpi_step_s']:.3f} s/step with it, "
                   f"{r['no_prefetch_step_s']:.3f} without; exposed communication "
                   f"{1e3 * r['exposed_comm_s']:.1f} ms/step with it, "
                   f"{1e3 * r['no_prefetch_exposed_comm_s']:.1f} without."]
    print("\n".join(md))
    if args.out:
        write_results(args.out, rows, md, comm, argv=sys.argv, model=vars(cfg),
                      sgemm_peak_flops=peak, torch_version=torch.__version__)


if __name__ == "__main__":
    main()
