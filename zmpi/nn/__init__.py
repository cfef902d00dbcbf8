"""zmpi.nn: autograd-free layers with explicit forward/backward (NumPy or CuPy; no MPI here).

    functional   pure kernels: y, cache = op_forward(...); grads = op_backward(dy, cache)
    parameter    Parameter (.data, .grad), compute_data, accumulate_grad_
    base         Module (forward/backward, parameters, state), activation accounting
    module       UnitModel (units + engine hooks + loss), UnitHooks
    layers       Linear, Dense (Linear + GELU), Embedding, LayerNorm, GELU, CausalSelfAttention,
                 MLP (transformer feed-forward), Block
    losses       Loss, CrossEntropyLoss (ignore_index), MSELoss
    llama_layers RMSNorm, SwiGLU, RotaryEmbedding, GroupedQueryAttention (the Llama family's
                 layers; their kernels in llama_functional and gqa)
"""

from zmpi.backend import array_module, compute_dtype
from zmpi.nn import functional
from zmpi.nn.layers import (
    GELU,
    MLP,
    Block,
    CausalSelfAttention,
    Dense,
    Embedding,
    LayerNorm,
    Linear,
    constant_parameter,
    embedding_lookup,
    normal_parameter,
)
from zmpi.nn.losses import CrossEntropyLoss, Loss, MSELoss
from zmpi.nn.module import Module, UnitHooks, UnitModel
from zmpi.nn.parameter import Parameter, accumulate_grad_, compute_data, live

__all__ = [
    "GELU", "MLP", "Block", "CausalSelfAttention", "CrossEntropyLoss", "Dense", "Embedding",
    "LayerNorm", "Linear", "Loss", "MSELoss", "Module", "Parameter", "UnitHooks", "UnitModel",
    "accumulate_grad_", "array_module", "compute_data", "compute_dtype", "constant_parameter",
    "embedding_lookup", "functional", "live", "normal_parameter",
]
