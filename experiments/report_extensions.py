"""RESULTS.md's sections on ZeRO-Infinity's NVMe tier, 1-bit Adam, ZeRO++, block-sparse
attention, the model-state memory of published MoE and Llama models, mixture-of-experts
training and Llama against GPT-2 (a mixin of report.Report)."""
import os


class ExtensionSections:
    # ---- 10. ZeRO-Infinity's NVMe tier
    def nvme(self) -> None:
        self.add("## 10. ZeRO-Infinity's NVMe tier: the optimizer state on a drive", "",
                 "The paper: the optimizer state on NVMe, streamed through bounded host "
                 "buffers, with overlapped reads and writes. Here: CPU offload's bits, host "
                 "memory the pool, and the swap bandwidth beside `dd` on the same disk.", "")
        folder = self.results / "nvme"
        if self.rows(folder) is None:
            return self.missing("the NVMe tier", "make bench-nvme")
        self.add((folder / "table.md").read_text().strip(), "",
                 "Made by `make bench-nvme` (`python experiments/bench_nvme.py --out "
                 "results/nvme`); what the figures mean: [docs/offload.md](../docs/offload.md"
                 "#the-nvme-tier-zero-infinity).", "")
        params = self.results / "nvme_param"
        if self.rows(params) is not None:  # stage 3's parameter shards on the drive
            self.add("Stage 3's parameter shards on NVMe:", "",
                     (params / "table.md").read_text().strip(), "",
                     "Made by `make bench-nvme` (`python experiments/bench_nvme_param.py "
                     "--out results/nvme_param`); what the figures mean: "
                     "[docs/offload.md](../docs/offload.md#parameters-on-nvme).", "")

    # ---- 11. 1-bit Adam
    def onebit(self) -> None:
        self.add("## 11. 1-bit Adam: the momentum in one bit an element (Tang et al. 2021)", "",
                 "The paper: after a warm-up of plain Adam, v frozen and the momentum "
                 "exchanged at 1 bit an element with error feedback, 1/16 of an fp16 "
                 "allreduce, converging like Adam. Here: one GPT on 4 ranks, Adam against "
                 "1-bit Adam, the bytes each step sent counted by Comm:", "")
        folder = self.results / "onebit"
        if self.rows(folder) is None:
            return self.missing("1-bit Adam", "make bench-onebit")
        self.add((folder / "table.md").read_text().strip(), "",
                 f"![Adam and 1-bit Adam]({os.path.relpath(folder / 'loss.png', self.out.parent)})",
                 "", "Made by `make bench-onebit` (`mpiexec -n 4 python "
                 "experiments/bench_onebit.py --out results/onebit`); what is counted and why "
                 "beta2 matters: [docs/onebit.md](../docs/onebit.md#measured).", "")

    # ---- 12. ZeRO++
    def zeropp(self) -> None:
        self.add("## 12. ZeRO++: quantized gathers and reductions, hierarchical partitioning "
                 "(Wang et al. 2023)", "",
                 "The paper: int8 parameter allgathers (qwZ, 2x less than fp16), int4 "
                 "gradients reduced by all-to-all (qgZ, 4x less), a secondary parameter shard "
                 "per node so backward gathers inside it (hpZ), with the loss of the "
                 "unquantized run. Here: one GPT on 4 ranks (hpZ groups of 2), the bytes "
                 "each step sent counted by Comm per communicator:", "")
        folder = self.results / "zeropp"
        if self.rows(folder) is None:
            return self.missing("ZeRO++", "make bench-zeropp")
        self.add((folder / "table.md").read_text().strip(), "",
                 f"![ZeRO++ loss curves]({os.path.relpath(folder / 'loss.png', self.out.parent)})",
                 "", "Made by `make bench-zeropp` (`mpiexec -n 4 python "
                 "experiments/bench_zeropp.py --out results/zeropp`); the formulas and what "
                 "is counted: [docs/zeropp.md](../docs/zeropp.md#measured).", "")

    # ---- 13. Block-sparse attention
    def sparse(self) -> None:
        self.add("## 13. Block-sparse attention (DeepSpeed Sparse Attention)", "",
                 "DeepSpeed: block-sparse layouts (fixed, variable, BigBird, Longformer) let "
                 "BERT train on 10x / 16x longer sequences than dense attention on one 32 GB "
                 "V100, up to 6.3x faster. Here: the same layouts in a GPT (causal), the "
                 "longest sequence one step fits into a device budget, the step time against "
                 "T and the loss after the same steps, dense against each layout:", "")
        folder = self.results / "sparse_gpt"
        if self.rows(folder) is None:
            return self.missing("block-sparse attention", "make bench-sparse")
        self.add((folder / "table.md").read_text().strip(), "",
                 "Made by `make bench-sparse` (`python experiments/bench_sparse_gpt.py --out "
                 "results/sparse_gpt`); the layouts and what is counted: "
                 "[docs/sparse-attention.md](../docs/sparse-attention.md#measured).", "")

    # ---- 14. Model-state memory of published MoE and Llama models
    def published_memory(self) -> None:
        self.add("## 14. Model-state memory of published models: DeepSpeed-MoE and Llama", "",
                 "DeepSpeed-MoE (Rajbhandari et al. 2022): a 1.3B dense GPT with 128 experts in "
                 "every other layer (MoE-128) or a pyramid of 64 and 128 experts beside a "
                 "dense MLP (PR-MoE), its experts split over ep ranks. Here: their parameters "
                 "and model-state bytes per rank by ZeRO stage from `zmpi estimate --moe` at "
                 "the example script's 64 ranks and ep 64, dense states over dp and each "
                 "rank's experts over dp / ep, beside every rank holding every expert (ep 1); "
                 "and Llama-2 7B / Llama-3 8B at 64 ranks from `zmpi estimate --model llama` "
                 "against the ZeRO formula at the published parameter counts. Arithmetic, "
                 "no training run:", "")
        folder = self.results / "memory_published"
        if self.rows(folder, "moe") is None:
            return self.missing("the published models' memory",
                                "python experiments/memory_published.py")
        self.add((folder / "moe.md").read_text().strip(), "",
                 (folder / "llama.md").read_text().strip(), "",
                 "Made by `python experiments/memory_published.py --out "
                 "results/memory_published` (regenerated and compared by `make test`); the "
                 "shapes' sources and the per-stage expert formula: "
                 "[docs/moe.md](../docs/moe.md#expert-state-memory-of-published-models), "
                 "[docs/models.md](../docs/models.md#model-state-memory-at-64-ranks).", "")

    # ---- 15. Mixture of experts trained
    def moe_training(self) -> None:
        self.add("## 15. Mixture of experts: training, expert load and traffic against ep", "",
                 "Switch Transformer / GShard / DeepSpeed-MoE: at equal active parameters an "
                 "MoE model reaches a lower loss than its dense base in the same steps; the "
                 "load-balancing loss keeps the experts' load even so that fewer tokens are "
                 "dropped; expert parallelism exchanges the tokens by all-to-all. Here: a "
                 "small MoE GPT and its dense base on Tiny Shakespeare, the expert load and "
                 "drops per layer with and without the auxiliary loss, and the step time and "
                 "bytes per rank against ep at 2, 4 and 8 ranks:", "")
        folder = self.results / "moe_train"
        if self.rows(folder) is None:
            return self.missing("mixture-of-experts training", "make bench-moe")
        png = os.path.relpath(folder / "load.png", self.out.parent)
        self.add((folder / "table.md").read_text().strip(), "",
                 f"![Expert load and drops over training]({png})",
                 "", "Made by `make bench-moe` (`mpiexec -n N python experiments/moe_train.py "
                 "--scaling --out results/moe_train` for N = 2, 4, 8, then `python "
                 "experiments/moe_train.py --out results/moe_train`); what is counted and "
                 "what the figures say: [docs/moe.md](../docs/moe.md#measured).", "")

    # ---- 16. Llama against GPT-2
    def llama_gpt(self) -> None:
        self.add("## 16. Llama and GPT-2 of equal parameters", "",
                 "The Llama recipe (RMSNorm, rotary positions, SwiGLU, no biases; Touvron et "
                 "al. 2023) against GPT-2's (LayerNorm, learned positions, GELU, biases) at "
                 "equal parameters: the same data, seed, optimizer and steps on Tiny "
                 "Shakespeare, one rank:", "")
        folder = self.results / "llama_vs_gpt"
        if self.rows(folder) is None:
            return self.missing("Llama against GPT-2", "make bench-llama")
        self.add((folder / "table.md").read_text().strip(), "",
                 f"![Llama and GPT-2]({os.path.relpath(folder / 'loss.png', self.out.parent)})",
                 "", "Made by `make bench-llama` (`python experiments/llama_vs_gpt.py --out "
                 "results/llama_vs_gpt`); the models and how the widths are matched: "
                 "[docs/models.md](../docs/models.md#measured-llama-against-gpt-2).", "")
