"""Test oracle: DeepSpeed's model-state memory estimators, restated as plain arithmetic.

Not part of the zmpi package; tests and experiments may import it to compare zmpi's
planner against what DeepSpeed's own estimator says.

This file reproduces these DeepSpeed functions:

    deepspeed/runtime/zero/stage_1_and_2.py  estimate_zero2_model_states_mem_needs
    deepspeed/runtime/zero/stage3.py         estimate_zero3_model_states_mem_needs

We read them in microsoft/DeepSpeed at commit 38327e07f6cd39b63418f60cedd1651b0be3e7c3
(2025-02-21). The per-term explanations come from DeepSpeed's docs page
docs/code-docs/source/memory.rst at the same commit.

Both functions return (cpu_mem, gpu_mem) in bytes, truncated to int as DeepSpeed truncates.
The operations run in DeepSpeed's order, so float results match DeepSpeed's bit for bit.
DeepSpeed's zero3 function also returns a third value, largest_layer_memory =
4 * largest_layer_params. This oracle leaves it out.

What the numbers are:
- Model states only (params, grads, optimizer states), for mixed precision with Adam. Not
  activations, buffers or fragmentation.
- cpu_mem is per node, and includes a safety factor, additional_buffer_factor (default 1.5).
- gpu_mem is per GPU, with no safety factor.
- In the ZeRO-2 case with no offload, the code budgets 2*P + 18*P/total_gpus on the GPU.
  memory.rst still says 4*P + 16*P/total_gpus, and its printed example (15.93 GB) still
  uses that older formula. DeepSpeed PR #5099 (commit f4cb866c2, 2024-06-04) changed the
  code. We follow the code.
"""


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, additional_buffer_factor=1.5):
    """ZeRO stage 2 (optimizer states and gradients partitioned). Returns (cpu_mem, gpu_mem)
    in bytes: cpu_mem per node, gpu_mem per GPU."""
    total_gpus = num_nodes * num_gpus_per_node

    if cpu_offload:
        # GPU: 2 bytes per param for the full fp16 parameters, which every rank holds in ZeRO-2.
        # The gradients and optimizer states live on the CPU.
        gpu_mem = 2 * total_params
        # CPU, the larger of two cases:
        #  - 16 bytes per param of fp32 states: 4 params + 4 grads + 4 momentum + 4 variance.
        #    This is counted for the whole model, not divided by num_nodes: the ZeRO-2
        #    estimate does not split it across nodes.
        #  - 4 bytes per param per GPU, where total_gpus counts the GPUs of every node (the
        #    no-offload case uses the local count instead): each process builds the model in
        #    fp32 on the CPU at start-up.
        # Both are times the safety factor.
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # GPU: 2 bytes per param for the fp16 parameters (replicated), plus 18 bytes per param
        # partitioned over all GPUs: 2 fp16 grads + 4 fp32 grads + 4 fp32 master params +
        # 8 fp32 Adam states (momentum and variance).
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        # CPU: only the start-up fp32 copy of the model, 4 bytes per param per local GPU,
        # times the safety factor.
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor

    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
                                          num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5):
    """ZeRO stage 3 (parameters partitioned too). cpu_offload: optimizer states on the CPU
    (offload_optimizer=cpu). cpu_offload_params: parameters on the CPU (offload_param=cpu).
    zero_init: the model is built partitioned (deepspeed.zero.Init). Returns
    (cpu_mem, gpu_mem) in bytes: cpu_mem per node, gpu_mem per GPU."""
    total_gpus = num_nodes * num_gpus_per_node
    # The share of the partitioned states held by one node's CPUs:
    # num_gpus_per_node / total_gpus = 1 / num_nodes.
    gpus_factor = 1 / num_nodes
    # GPU working set to gather the largest layer on one GPU: 2 bytes of fp16 params
    # + 2 bytes of fp16 grads per param of that layer.
    largest_layer_memory = (4 * largest_layer_params)

    if cpu_offload:
        if cpu_offload_params:
            # GPU: only the gathered largest layer. Every model state lives on the CPU.
            gpu_mem = largest_layer_memory
            if zero_init:
                # CPU: 18 bytes per param (4 fp32 params + 4 fp32 grads + 4 momentum +
                # 4 variance + 2 fp16 params), this node's 1/num_nodes share, times the
                # safety factor.
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                # Without zero.Init each local process also builds the full fp32 model on the
                # CPU (4 bytes per param per local GPU). The larger of that and the 18-byte
                # share.
                cpu_mem = (total_params * max(4 * num_gpus_per_node, 18 * gpus_factor)
                           * additional_buffer_factor)
        else:
            # GPU: the gathered largest layer, plus this GPU's 1/total_gpus share of the
            # 2-byte fp16 parameters.
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                # CPU: 16 bytes per param of fp32 states (4 params + 4 grads + 4 momentum
                # + 4 variance), this node's share, times the safety factor.
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                # The larger of that and the start-up fp32 model per local GPU.
                cpu_mem = (total_params * max(4 * num_gpus_per_node, 16 * gpus_factor)
                           * additional_buffer_factor)
    else:
        # GPU: the gathered largest layer, plus this GPU's share of 18 bytes per param:
        # 2 fp16 params + 16 fp32 (params, grads, momentum, variance).
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            # CPU: with zero.Init only one layer at a time passes through the CPU in fp32
            # (4 bytes per param per local GPU), times the safety factor.
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            # CPU: the full fp32 model built once per local GPU at start-up, times the
            # safety factor.
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor

    return int(cpu_mem), int(gpu_mem)


# DeepSpeed's documented example (memory.rst, "_all_cold" with total_params=2851e6,
# largest_layer_params=32e6, 8 GPUs on 1 node), printed in GiB to 2 decimals:
# (cpu GiB, gpu GiB) for each option set.
# The ZeRO-2 no-offload GPU value is the exception: the docs print 15.93, from the formula
# before PR #5099 (4*P + 16*P/G). The current code gives 11.28 (2*P + 18*P/G).
_DOCUMENTED_ZERO2 = {True: ("127.45", "5.31"), False: ("127.45", "11.28")}
_DOCUMENTED_ZERO3 = {  # (cpu_offload_params, cpu_offload, zero_init) -> (cpu, gpu)
    (True, True, True): ("71.69", "0.12"), (True, True, False): ("127.45", "0.12"),
    (False, True, True): ("63.72", "0.78"), (False, True, False): ("127.45", "0.78"),
    (False, False, True): ("1.43", "6.09"), (False, False, False): ("127.45", "6.09"),
}


def _gib(x):
    return f"{x / 2**30:.2f}"


def _self_check():
    for offload, want in _DOCUMENTED_ZERO2.items():
        cpu, gpu = estimate_zero2_model_states_mem_needs(2851e6, 8, 1, cpu_offload=offload)
        assert (_gib(cpu), _gib(gpu)) == want, (offload, _gib(cpu), _gib(gpu), want)
    for (offp, off, init), want in _DOCUMENTED_ZERO3.items():
        cpu, gpu = estimate_zero3_model_states_mem_needs(
            2851e6, 32e6, 8, 1, cpu_offload=off, cpu_offload_params=offp, zero_init=init)
        assert (_gib(cpu), _gib(gpu)) == want, (offp, off, init, _gib(cpu), _gib(gpu), want)
    print("DeepSpeed memory.rst examples (2851e6 params, 8 GPUs x 1 node): reproduced")

    # The ZeRO paper's Fig. 1 example: 7.5B params with 64-way data parallelism, here as
    # 8 nodes x 8 GPUs. The largest layer is the 7.5B Megatron model's word embedding,
    # 51200 x 4096 (h=4096, V=51200).
    p, largest, g, n = 7.5e9, 51200 * 4096, 8, 8
    print(f"\ntotal_params={p:.3g}, {n} nodes x {g} GPUs = {n * g} GPUs; "
          f"largest_layer_params={largest}; cpu per node, gpu per GPU")
    for off in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(p, g, n, cpu_offload=off)
        print(f"zero2 offload_optimizer={'cpu ' if off else 'none'}                     "
              f"cpu {cpu:>17,d} B ({_gib(cpu):>7} GiB)  gpu {gpu:>17,d} B ({_gib(gpu):>6} GiB)")
    for off in (True, False):
        for offp in (True, False):
            if offp and not off:
                continue  # DeepSpeed's estimator skips param offload without optimizer offload
            for init in (True, False):
                cpu, gpu = estimate_zero3_model_states_mem_needs(
                    p, largest, g, n, cpu_offload=off, cpu_offload_params=offp, zero_init=init)
                print(f"zero3 offload_param={'cpu ' if offp else 'none'} "
                      f"offload_optimizer={'cpu ' if off else 'none'} zero_init={int(init)} "
                      f"cpu {cpu:>17,d} B ({_gib(cpu):>7} GiB)  "
                      f"gpu {gpu:>17,d} B ({_gib(gpu):>6} GiB)")


if __name__ == "__main__":
    _self_check()
