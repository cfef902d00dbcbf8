"""The architectures zmpi exchanges with the Hugging Face ecosystem (zmpi.checkpoint.hf): per
transformers `model_type`, a class whose table maps zmpi's parameters to the Hugging Face
tensors (`Tensor`: the two names, and whether Hugging Face stores it transposed), with the
config.json keys that give zmpi's model shape and the values zmpi computes. GPT-2's is here;
GPT-2's Conv1D weights are stored (in, out), as zmpi's Linear keeps them, so none is
transposed (a Llama's nn.Linear weights, (out, in), will be). A model_type zmpi does not have
is an HFError, one line saying why.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from zmpi.checkpoint.store import CheckpointError


class HFError(CheckpointError):
    """A Hugging Face model directory that zmpi cannot read or write, or that is not the
    model asked for: one line naming the file and what differs."""


@dataclass(frozen=True)
class Tensor:
    """One parameter: its zmpi name, its Hugging Face name (without the base model's prefix)
    and whether Hugging Face stores it transposed."""

    zmpi: str
    hf: str
    transpose: bool = False


class GPT2:
    """transformers' GPT2LMHeadModel against zmpi's GPT (models/gpt.py): the same pre-LN
    blocks, tanh GELU, LayerNorm eps 1e-5 and tied LM head. HF's fused c_attn holds [q | k | v]
    with heads in order, as zmpi's qkv does, and Conv1D's (in, out) weights are zmpi's
    Linear's: no tensor is transposed or permuted."""

    model_type, hf_class, prefix = "gpt2", "GPT2LMHeadModel", "transformer."
    # config.json key -> zmpi's model section key
    SHAPE = {"n_layer": "n_layer", "n_embd": "d_model", "n_head": "n_head",
             "n_positions": "seq_len", "vocab_size": "vocab_size"}
    # what zmpi's GPT computes (config.json key: (the value, its default in transformers))
    FIXED = {"activation_function": (("gelu_new", "gelu_pytorch_tanh"), "gelu_new"),
             "layer_norm_epsilon": ((1e-5,), 1e-5), "scale_attn_weights": ((True,), True),
             "scale_attn_by_inverse_layer_idx": ((False,), False),
             "add_cross_attention": ((False,), False), "tie_word_embeddings": ((True,), True)}
    BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")  # causal masks, not weights
    HEAD = "lm_head.weight"  # tied to wte: absent from save_pretrained's files, or equal

    @staticmethod
    def units(n_layer: int) -> list[list[Tensor]]:
        """The table, unit by unit as zmpi's GPT builds them."""
        blocks = [[Tensor(f"units.{i + 1}.{z}.{w}", f"h.{i}.{h}.{w}")
                   for z, h in (("ln1", "ln_1"), ("attn.qkv", "attn.c_attn"),
                                ("attn.proj", "attn.c_proj"), ("ln2", "ln_2"),
                                ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))
                   for w in ("weight", "bias")] for i in range(n_layer)]
        head = [Tensor(f"units.{n_layer + 1}.ln_f.{w}", f"ln_f.{w}") for w in ("weight", "bias")]
        return [[Tensor("units.0.wte", "wte.weight"), Tensor("units.0.wpe", "wpe.weight")],
                *blocks, head]

    @staticmethod
    def shapes(m: dict) -> dict[str, tuple]:
        """zmpi's parameter shapes of model section `m`."""
        d, L = m["d_model"], m["n_layer"]
        block = {"ln1.weight": (d,), "ln1.bias": (d,), "attn.qkv.weight": (d, 3 * d),
                 "attn.qkv.bias": (3 * d,), "attn.proj.weight": (d, d), "attn.proj.bias": (d,),
                 "ln2.weight": (d,), "ln2.bias": (d,), "mlp.fc.weight": (d, 4 * d),
                 "mlp.fc.bias": (4 * d,), "mlp.proj.weight": (4 * d, d), "mlp.proj.bias": (d,)}
        out = {"units.0.wte": (m["vocab_size"], d), "units.0.wpe": (m["seq_len"], d)}
        for i in range(1, L + 1):
            out.update({f"units.{i}.{k}": s for k, s in block.items()})
        out.update({f"units.{L + 1}.ln_f.weight": (d,), f"units.{L + 1}.ln_f.bias": (d,)})
        return out

    @staticmethod
    def tied(m: dict) -> dict:
        return {f"units.{m['n_layer'] + 1}.wte": "units.0.wte"}  # GPT.tied_parameters

    @staticmethod
    def model_of(shapes: dict) -> dict:
        """The model section (less n_head, which no shape shows) of zmpi parameter shapes."""
        wte, wpe = shapes.get("units.0.wte"), shapes.get("units.0.wpe")
        if wte is None or wpe is None or len(wte) != 2:
            raise ValueError("it has no token and position embedding (units.0.wte, wpe)")
        n_layer = sum(1 for name in shapes if name.endswith(".attn.qkv.weight"))
        return {"n_layer": n_layer, "d_model": wte[1], "seq_len": wpe[0],
                "vocab_size": wte[0]}

    @classmethod
    def hf_config(cls, m: dict, dtype: str) -> dict:
        """config.json of model section `m` for transformers (no dropout: zmpi has none). The
        token ids are the tokenizer's, which a checkpoint does not record: null (transformers'
        GPT-2 would otherwise say 50256, outside a smaller vocabulary)."""
        out = {"architectures": [cls.hf_class], "model_type": cls.model_type,
               **{hf: m[z] for hf, z in cls.SHAPE.items()}, "n_inner": None,
               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
               "initializer_range": 0.02, "scale_attn_weights": True,
               "tie_word_embeddings": True, "use_cache": True, "dtype": dtype,
               "bos_token_id": None, "eos_token_id": None}
        return out

    @classmethod
    def check(cls, config: dict, where) -> None:
        """HFError naming the first config.json key whose value zmpi's GPT does not compute."""
        n_inner, d = config.get("n_inner"), config.get("n_embd")
        if n_inner is not None and n_inner != (4 * d if type(d) is int else None):
            raise HFError(f"{where}: mismatch: n_inner {n_inner}: zmpi's GPT-2 MLP is 4 x "
                          f"n_embd ({d})")
        for key, (allowed, default) in cls.FIXED.items():
            value = config.get(key, default)
            if value not in allowed:
                raise HFError(f"{where}: mismatch: {key} {value!r}: zmpi's GPT-2 computes "
                              f"{' or '.join(map(repr, allowed))}")


# model_type -> Architecture, or why zmpi cannot take it yet
ARCHITECTURES = {"gpt2": GPT2}
NOT_BUILT = {"llama": "zmpi's Llama model is not built yet (its layers are in "
                      "zmpi/nn/llama_layers.py; models/llama.py is to come)"}


def architecture(model_type, where):
    """The architecture of config.json's model_type, or an HFError saying why there is none."""
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    if model_type in NOT_BUILT:
        raise HFError(f"{where}: model_type {model_type!r}: {NOT_BUILT[model_type]}")
    raise HFError(f"{where}: model_type {model_type!r}: zmpi has no such model (it reads "
                  f"{', '.join(map(repr, ARCHITECTURES))})")
