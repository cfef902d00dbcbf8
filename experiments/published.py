"""Published large-model training results, as data, for checking `zmpi plan` predictions.

Plain data: no imports, no code. Every number says where it comes from. A number that could
not be confirmed from a source we could read is None, with a comment saying so. "read off
Fig. N, approximate" marks a value measured by eye from a bar chart (about +-1 TFLOP/s);
everything else is printed in the source as a number.

Sources
-------
[MEG21] Deepak Narayanan, Mohammad Shoeybi, Jared Casper, Patrick LeGresley, Mostofa Patwary,
    Vijay Korthikanti, Dmitri Vainbrand, Prethvi Kashinkunti, Julie Bernauer, Bryan Catanzaro,
    Amar Phanishayee, Matei Zaharia. "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM". SC '21 (International Conference for High Performance
    Computing, Networking, Storage and Analysis), 2021. arXiv:2104.04473.
    Used: Table 1 (weak scaling), Table 2 (PTD-P vs ZeRO-3), Sec. 5 (hardware), Sec. 5.1
    (settings, eq. 2 and eq. 3), Sec. 5.9 (bandwidth), Appendix (FLOP count).
    Read from the paper's text (all of Table 1, Table 2, Sec. 5, the Appendix). Table 1 was also
    checked against the table image in NVIDIA/Megatron-LM's README (images/cases_april2021.png at
    commit 2d767f4886, 2022-01-26). That image has every Table 1 number except the attention heads,
    and it gives t*p as a single "model-parallel size" column. All rows agree.
[MEG19] Mohammad Shoeybi, Mostofa Patwary, Raul Puri, Patrick LeGresley, Jared Casper, Bryan
    Catanzaro. "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
    Parallelism". arXiv:1909.08053 (v4), 2019-2020.
    Used: abstract, Sec. 4.2 (mixed precision, activation checkpointing), Sec. 5 (hardware),
    Sec. 5.1 and Table 1 (the single-GPU baseline). Read from the paper's text (a public
    transcription of v4). It states no FLOP-counting formula.
[ZERO20] Samyam Rajbhandari, Jeff Rasley, Olatunji Ruwase, Yuxiong He. "ZeRO: Memory
    Optimizations Toward Training Trillion Parameter Models". SC '20, 2020. arXiv:1910.02054.
    Used: Sec. 1 ("Speed"), Sec. 6.1, Sec. 10.1-10.4 (numbered Sec. X.A-D in the SC'20 version),
    Table 4 (arXiv v3; Table IV in SC'20), and the SC'20 Artifact Description appendix:
    its hardware list and its Table 1 ("Model parameters and batch sizes to reproduce results
    in Figure 2"). We read both versions' text. We did not see the figure images.
[ZOFF21] Jie Ren, Samyam Rajbhandari, Reza Yazdani Aminabadi, Olatunji Ruwase, Shuangyan Yang,
    Minjia Zhang, Dong Li, Yuxiong He. "ZeRO-Offload: Democratizing Billion-Scale Model
    Training". USENIX ATC '21, pages 551-564, 2021. arXiv:2101.06840.
    Used: abstract (Microsoft Research publication page); Table 2 (hardware), Table 3 (model
    configurations), Fig. 7 (largest model), Fig. 8 (single-GPU throughput) and Fig. 10
    (one DGX-2). The tables and figures were read from images of the paper's tables and
    figures in a public translation (Elvin-Ma/ai_papers, zero/images/zero-offload-*.jpg at
    commit 75574b0e). Sec. 6 text was read in that translation.
"""

# ---------------------------------------------------------------------------------------------
# [MEG21] Table 1: "Weak-scaling throughput for GPT models ranging from 1 billion to 1 trillion
# parameters." Every number in "rows" is printed in Table 1. Consistency we checked: eq. (2)
# with V=51200, s=2048 gives the params column to 0.1B on every row. tflops_per_gpu / 312
# gives peak_percent. tflops_per_gpu * gpus gives pflops_aggregate within rounding.
# ---------------------------------------------------------------------------------------------
MEGATRON_2021_TABLE1 = {
    "source": "[MEG21] Table 1",
    "columns": {
        "params_billion": "Number of parameters (billion)",
        "heads": "Attention heads",
        "hidden": "Hidden size",
        "layers": "Number of layers",
        "t": "Tensor model-parallel size",
        "p": "Pipeline model-parallel size",
        "gpus": "Number of GPUs",
        "batch": "Batch size (global, sequences)",
        "tflops_per_gpu": "Achieved teraFLOP/s per GPU",
        "peak_percent": "Percentage of theoretical peak FLOP/s (of 312 TFLOP/s)",
        "pflops_aggregate": "Achieved aggregate petaFLOP/s",
    },
    "rows": [
        {"params_billion": 1.7, "heads": 24, "hidden": 2304, "layers": 24, "t": 1, "p": 1,
         "gpus": 32, "batch": 512, "tflops_per_gpu": 137, "peak_percent": 44,
         "pflops_aggregate": 4.4},
        {"params_billion": 3.6, "heads": 32, "hidden": 3072, "layers": 30, "t": 2, "p": 1,
         "gpus": 64, "batch": 512, "tflops_per_gpu": 138, "peak_percent": 44,
         "pflops_aggregate": 8.8},
        {"params_billion": 7.5, "heads": 32, "hidden": 4096, "layers": 36, "t": 4, "p": 1,
         "gpus": 128, "batch": 512, "tflops_per_gpu": 142, "peak_percent": 46,
         "pflops_aggregate": 18.2},
        {"params_billion": 18.4, "heads": 48, "hidden": 6144, "layers": 40, "t": 8, "p": 1,
         "gpus": 256, "batch": 1024, "tflops_per_gpu": 135, "peak_percent": 43,
         "pflops_aggregate": 34.6},
        {"params_billion": 39.1, "heads": 64, "hidden": 8192, "layers": 48, "t": 8, "p": 2,
         "gpus": 512, "batch": 1536, "tflops_per_gpu": 138, "peak_percent": 44,
         "pflops_aggregate": 70.8},
        {"params_billion": 76.1, "heads": 80, "hidden": 10240, "layers": 60, "t": 8, "p": 4,
         "gpus": 1024, "batch": 1792, "tflops_per_gpu": 140, "peak_percent": 45,
         "pflops_aggregate": 143.8},
        {"params_billion": 145.6, "heads": 96, "hidden": 12288, "layers": 80, "t": 8, "p": 8,
         "gpus": 1536, "batch": 2304, "tflops_per_gpu": 148, "peak_percent": 47,
         "pflops_aggregate": 227.1},
        {"params_billion": 310.1, "heads": 128, "hidden": 16384, "layers": 96, "t": 8, "p": 16,
         "gpus": 1920, "batch": 2160, "tflops_per_gpu": 155, "peak_percent": 50,
         "pflops_aggregate": 297.4},
        {"params_billion": 529.6, "heads": 128, "hidden": 20480, "layers": 105, "t": 8, "p": 35,
         "gpus": 2520, "batch": 2520, "tflops_per_gpu": 163, "peak_percent": 52,
         "pflops_aggregate": 410.2},
        {"params_billion": 1008.0, "heads": 160, "hidden": 25600, "layers": 128, "t": 8, "p": 64,
         "gpus": 3072, "batch": 3072, "tflops_per_gpu": 163, "peak_percent": 52,
         "pflops_aggregate": 502.0},
    ],
    # Sec. 5.1: "All models use a vocabulary size (denoted by V) of 51,200 (multiple of 1024)
    # and a sequence length (s) of 2048."
    "seq_len": 2048,
    "vocab": 51200,
    # Not stated for the Table 1 rows. Sec. 5.5 / Fig. 16 find micro-batch 2 best for a 91B
    # model at (t,p)=(8,8), and say the best value is "model-dependent".
    "micro_batch": None,
    # Sec. 5.1: "we use the interleaved pipeline schedule with the scatter/gather optimization
    # enabled".
    "interleaved_schedule": True,
    "scatter_gather_optimization": True,
    # Model chunks per device (v) of the interleaved schedule: not stated for Table 1.
    "interleave_chunks": None,
    # Appendix: "we are using activation recomputation, which requires an additional forward
    # pass before the backward pass". Sec. 5.1: eq. (3) "assumes activation recomputation".
    "activation_recomputation": True,
    # Sec. 5 intro: "All of our results are run with mixed precision".
    "precision": "mixed precision (16-bit compute; peak quoted for 16-bit)",
    # Sec. 5.1 eq. (3); Appendix. Confirmed: per layer forward = 24*B*s*h^2 + 4*B*s^2*h;
    # times 4 (forward + 2x backward + recompute forward) = 96*B*s*h^2*(1 + s/(6h)); plus the
    # logit layer 6*B*s*h*V (forward 2BshV + backward 4BshV, not recomputed)
    # = 96*B*s*l*h^2 * V/(16*l*h). "A lower bound for the true FLOP count"; "We count a FLOP as
    # a floating-point operation regardless of precision." The reported TFLOP/s are this F
    # divided by the measured end-to-end iteration time.
    "flops_per_iteration": "F = 96*B*s*l*h**2 * (1 + s/(6*h) + V/(16*l*h))",
    # Sec. 5.1 eq. (2).
    "params_formula": "P = 12*l*h**2 * (1 + 13/(12*h) + (V + s)/(12*l*h))",
    # Sec. 5.1 eq. (4), with T tokens, n GPUs, X per-GPU FLOP/s.
    "training_time_formula": "time ~= 8*T*P/(n*X)",
    # Sec. 5.1: "throughput is measured for end-to-end training, i.e., includes all operations
    # including data loading, optimizer steps, communication, and logging."
    "throughput_is_end_to_end": True,
    "hardware": {
        # Sec. 5 intro, unless noted.
        "cluster": "NVIDIA Selene",
        "gpu": "NVIDIA A100 80GB",
        "gpus_per_node": 8,
        "node": "DGX A100",  # Sec. 5.1: "3072 A100 GPUs (384 DGX A100 nodes)"
        "intra_node": "NVLink and NVSwitch",
        # "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs for application communication,
        # with an additional two HCAs per node for dedicated storage"
        "inter_node": "8 x 200 Gb/s HDR InfiniBand HCAs per node (+2 for storage)",
        "inter_node_gbit_per_node": 8 * 200,
        "topology": "three-level (leaf, spine, core) fat tree, 850 switches",
        "peak_tflops_16bit": 312,
    },
    # Sec. 5.9, measured on the 1T model with 3072 GPUs (effective bisection bandwidth).
    "measured_bisection_bandwidth_1t": {
        "pipeline_p2p_GBps": 892,
        "data_parallel_allreduce_TBps": 12.9,
    },
    # Sec. 5.1 worked example: GPT-3 175B on 1024 A100s with batch 1536 reaches 140 TFLOP/s per GPU
    # (34 days for 300B tokens). 1T on 3072 GPUs at 163 TFLOP/s: 84 days for 450B tokens.
    "gpt3_175b_1024_gpus_tflops_per_gpu": 140,
}

# ---------------------------------------------------------------------------------------------
# [MEG19] The single-V100 baseline of Megatron-LM 2019: the software the ZeRO paper ran on
# ("Megatron-LM (Sept 2019)", [ZERO20] AE appendix) measured on one V100 alone.
# ---------------------------------------------------------------------------------------------
MEGATRON_2019_BASELINE = {
    "source": "[MEG19] abstract, Sec. 4.2, Sec. 5, Sec. 5.1, Table 1",
    # Table 1, first row: hidden 1536, 16 heads, 40 layers, 1.2B parameters, 1 model-parallel
    # GPU. Sec. 5.1: "The configuration with 1.2 billion parameters fits on a single GPU".
    "params_billion": 1.2,
    "layers": 40,
    "hidden": 1536,
    "heads": 16,
    # Sec. 5.1: the vocabulary padded from 50,257 to 51,200; Sec. 4.2: sequences of 1024.
    "vocab": 51200,
    "seq_len": 1024,
    # Sec. 5.1: "For the model parallel scaling, a fixed batch size of 8 is used across all
    # configurations"; the baseline is that configuration on one GPU.
    "batch": 8,
    # Sec. 4.2: "we utilize activation checkpointing (Chen et al., 2016) after every
    # transformer layer"; mixed precision with dynamic loss scaling on the Tensor Cores.
    "activation_checkpointing": True,
    "precision": "fp16 mixed precision",
    # Sec. 5.1: "it achieves 39 TeraFLOPS during the overall training process, which is 30% of
    # the theoretical peak FLOPS for a single GPU in a DGX-2H server" (abstract: the same).
    "tflops_per_gpu": 39,
    "peak_percent": 30,
    "flops_formula": None,  # not stated
    # Sec. 5: "up to 32 DGX-2H servers (a total of 512 Tesla V100 SXM3 32GB GPUs)", 300 GB/s
    # NVSwitch, 100 GB/s between servers over 8 InfiniBand adapters.
    "hardware": {"node": "NVIDIA DGX-2H", "gpu": "NVIDIA Tesla V100 SXM3 32GB",
                 "gpus_per_node": 16},
}

# ---------------------------------------------------------------------------------------------
# [ZERO20] ZeRO-100B running the 100B-parameter model (Fig. 2's 100B point).
# ---------------------------------------------------------------------------------------------
ZERO_100B = {
    "source": "[ZERO20] Sec. 1, Sec. 10.1-10.2, Table 4; SC'20 AE appendix Table 1 (Figure 2)",
    "params_billion": 100,
    # AE appendix Table 1 row "100B ZeRO": 400 GPUs, MP 16, 125 layers, hidden 8192,
    # 64 attention heads, batch size 32, total batch size 800. Table 4 (main text) lists
    # 80B-170B as layers 100,125,150 with HD 8192. That agrees.
    "layers": 125,
    "hidden": 8192,
    "heads": 64,
    "model_parallel": 16,  # Megatron-LM tensor (intra-layer) MP, inside one DGX-2 node
    "gpus": 400,
    "nodes": 25,  # Sec. 10.1: "400 V100 GPUs (25 DGX-2 nodes)"
    "data_parallel": 25,  # derived: 400 / 16. Not printed.
    # AE Table 1: "Batch size" 32 and "Total batch size" 800 = 32 * 25. So 32 is per
    # data-parallel rank (shared by the 16 MP GPUs of a replica).
    "batch_per_dp_rank": 32,
    "batch_total": 800,
    # Sec. 10.1: "ZeRO-100B ... including the full set of optimizations in P_os+g and ZeRO-R".
    # ZeRO-DP stage 2 (optimizer states + gradients partitioned), plus P_a, C_B, M_D.
    "zero_stage": 2,
    "zero_dp": "P_os+g",
    "zero_r": "P_a + C_B + M_D",
    # Sec. 10.5: "P_a+cpu is turned on only when it is beneficial". Not stated for the 100B run.
    "activation_cpu_offload": None,
    # Sec. 1 "Speed": "ZeRO runs 100B parameter models on a 400 Nvidia V100 GPU cluster with
    # over 38 TFlops per GPU, and aggregate performance over 15 Petaflops." (lower bounds)
    "tflops_per_gpu": 38,
    "pflops_aggregate": 15,
    # Sec. 10.2: "sustained throughput of 15 PetaFlops (over 30% of the peak) on average for
    # models with 8B to 100B parameters". The peak value used is not stated.
    "peak_percent_lower_bound": 30,
    "peak_tflops": None,
    # The evaluation never states the sequence length. Sec. 6.1 uses "a 100B model shown in
    # Table 4 with a batch size of 32, sequence length of 1024 and a MP degree of 16" as its
    # activation-memory example (33 GB/GPU of checkpoints, ~2 GB with P_a).
    "seq_len": None,
    "seq_len_sec6_1_example": 1024,
    "vocab": None,  # not stated
    # The FLOP-counting formula is not stated in the paper.
    "flops_formula": None,
    "precision": "fp16 mixed precision with Adam",  # Sec. 3.1 and Fig. 1 (K=12 memory analysis)
    "hardware": {
        # Sec. 10.1 and the AE appendix ("Relevant hardware details").
        "node": "NVIDIA DGX-2",
        "gpu": "NVIDIA Tesla V100-SXM3-32GB",
        "gpus_per_node": 16,
        "intra_node": "NVSwitch, 300 GB/s per link",  # Sec. 10.2
        "inter_node_gbit_per_node": 800,  # Sec. 10.1: "800 Gbps internode communication bandwidth"
        # AE appendix: "8x 100Gb/s InfiniBand Mellanox MT27800 Family (ConnectX-5)"; Sec. 10.2:
        # "12.5 GB/sec per link (Infiniband EDR)"; switch "Mellanox MLNX-OS CS7500 648-ports".
        "inter_node": "8 x 100 Gb/s InfiniBand EDR (ConnectX-5) per node",
        "cpu": "2 x Intel Xeon Platinum 8168, 2.7 GHz, 24 cores each",  # AE appendix
        "cpu_memory_GB": 24 * 64,  # AE appendix: "24x 64GB DDR4 ... 2666 MT/s"
    },
    "software": "PyTorch 1.2, DeepSpeed 0.2, NCCL 2.4.8, Megatron-LM (Sept 2019)",  # AE appendix
    # The baseline at the same size (Megatron-LM MP alone), AE Table 1 row "100B Baseline":
    # 384 GPUs, MP 128, 125 layers, hidden 8192, 128 heads, batch 2, total 6. We did not see
    # its throughput, which is only given in Fig. 2.
    "baseline_megatron": {"gpus": 384, "model_parallel": 128, "heads": 128,
                          "batch_per_dp_rank": 2, "batch_total": 6, "tflops_per_gpu": None},
    # AE appendix Table 1, all ZeRO rows of Figure 2 (400 GPUs each):
    # (params_billion, model_parallel, layers, hidden, heads, batch_per_dp_rank, batch_total).
    # Per-size throughputs are only in Fig. 2, which we did not see.
    "figure2_zero_configs": [
        (1.5, 1, 48, 1600, 16, 24, 9600),
        (8, 4, 72, 3072, 24, 64, 6400),
        (20, 4, 98, 4096, 32, 32, 3200),
        (40, 4, 88, 6144, 32, 12, 1200),
        (60, 16, 132, 6144, 32, 64, 1600),
        (80, 16, 100, 8192, 64, 32, 800),
        (100, 16, 125, 8192, 64, 32, 800),
        (120, 16, 150, 8192, 64, 24, 600),
        (140, 16, 175, 8192, 64, 16, 400),
        (170, 16, 212, 8192, 64, 12, 300),
    ],
    # Sec. 10.4 (arXiv Fig. 4): without MP, ZeRO-100B trains up to 13B on 128 GPUs "achieving
    # throughput over 40 TFlops per GPU on average". AE Table 6 row "13B ZeRO": 128 GPUs, MP 1,
    # 62 layers, hidden 4096, 32 heads, batch 2, total 256.
    "no_mp_13b": {"gpus": 128, "model_parallel": 1, "layers": 62, "hidden": 4096, "heads": 32,
                  "batch_per_dp_rank": 2, "batch_total": 256,
                  "tflops_per_gpu_average_lower_bound": 40},
}

# ---------------------------------------------------------------------------------------------
# [ZOFF21] ZeRO-Offload: ZeRO-2 with fp16 gradients, fp32 optimizer states and the Adam step
# on the CPU (Sec. 3.5, 4.2).
# ---------------------------------------------------------------------------------------------
ZERO_OFFLOAD = {
    "source": "[ZOFF21] abstract, Tables 2-3, Figs. 7, 8, 10",
    # Fig. 7 bar label (single GPU): ZeRO-Offload 13 (PyTorch, Megatron, ZeRO-2: 1.4;
    # SwapAdvisor 8; L2L 17). Abstract: "over 13 billion parameters on a single GPU".
    "largest_single_gpu_params_billion": 13,
    # Table 3 row "12, 13 billion": batch size per GPU 4, MP 1, layers 60, 65, hidden 4096.
    "largest_single_gpu_config": {"layers": 65, "hidden": 4096, "micro_batch": 4,
                                  "model_parallel": 1,
                                  "heads": None},  # Table 3 gives no head count
    # Table 3, "Model configuration in evaluation", one entry per size:
    # (params_billion, micro_batch_per_gpu, model_parallel, layers, hidden).
    "table3": [
        (1, 32, 1, 20, 2048), (2, 32, 1, 40, 2048),
        (4, 32, 1, 64, 2304),
        (6, 16, 1, 53, 3072), (8, 16, 1, 72, 3072),
        (10, 10, 1, 50, 4096), (11, 8, 1, 55, 4096),
        (12, 4, 1, 60, 4096), (13, 4, 1, 65, 4096),
        (15, 8, 2, 78, 4096),
        (20, 8, 2, 25, 8192), (40, 8, 2, 50, 8192), (60, 8, 2, 75, 8192),
        (70, 8, 8, 69, 9216),
    ],
    # Fig. 8 caption: "... on a single GPU with a batch size of 512". Sec. 6.2.2: same micro
    # batch as Table 3, gradient accumulation on, and DPU disabled "so that the comparison
    # is only from the system efficiency perspective".
    "single_gpu_global_batch": 512,
    "single_gpu_dpu": False,
    # Fig. 8, ZeRO-Offload bars, TFLOP/s per GPU on one V100: read off Fig. 8, approximate.
    "single_gpu_tflops": {1: 36, 2: 36, 4: 37, 6: 37, 8: 41.5, 10: 41, 11: 36, 12: 34,
                          13: 34.5},
    # Fig. 8, PyTorch bar (1B only; larger ones OOM): read off Fig. 8, approximate.
    "single_gpu_pytorch_1b_tflops": 24,
    # Abstract: "ZeRO-Offload can achieve 40 TFlops/GPU on a single NVIDIA V100 GPU for 10B
    # parameter model compared to 30TF using PyTorch alone for a 1.4B parameter model".
    "single_gpu_10b_tflops_abstract": 40,
    "pytorch_1_4b_tflops_abstract": 30,
    # Fig. 10: 16 GPUs of one DGX-2, global batch 512 (Sec. 6.2.2). Read off Fig. 10,
    # approximate, TFLOP/s per GPU. Without MP: 1B-13B. With MP (degree from Table 3): 15B-70B.
    "dgx2_16gpu_tflops_no_mp": {1: 36, 2: 36, 8: 41, 10: 41, 13: 34.5},
    "dgx2_16gpu_tflops_with_mp": {15: 31, 20: 43, 40: 37, 60: 31, 70: 30},
    # Fig. 7 bar labels: largest model on 4 GPUs is 30B and on 16 GPUs (one DGX-2) is 70B,
    # both with MP.
    "largest_4gpu_params_billion": 30,
    "largest_16gpu_params_billion": 70,
    # DPU (one-step delayed parameter update): off in Figs. 8 and 10. Sec. 6.2.4 (Fig. 9, read
    # in translation): with DPU at micro batch 8, throughput rises 1.12x-1.59x. In the
    # convergence runs DPU starts after the first 40 iterations.
    "dpu_speedup_range": (1.12, 1.59),
    "seq_len": None,  # not stated in Table 3 or in the Sec. 6 text we read
    "heads": None,  # not stated in Table 3
    "model": "GPT-2-like transformer; hidden size and number of blocks varied (Sec. 6.1)",
    "zero_stage": 2,  # Sec. 2/4.2: ZeRO-Offload "works symbiotically with ZeRO-2"
    "hardware": {
        # Table 2, "Hardware overview of experimental system" (one DGX-2 node).
        "node": "NVIDIA DGX-2",
        "gpu": "NVIDIA Tesla V100 Tensor Core, 32GB HBM2",
        "gpus_per_node": 16,
        "cpu": "2 x Intel Xeon Platinum 8168",
        "cpu_memory": "1.5TB 2666MHz DDR4",
        "cpu_cache": "L1 32K, L2 1M, L3 33M",
        "pcie": "bidirectional 32 GBps PCIe",
        # Sec. 6.1: for the scalability runs, 8 DGX-2 nodes over InfiniBand with a 648-port
        # Mellanox MLNX-OS CS7500 switch.
    },
}
