"""The architectures zmpi exchanges with the Hugging Face ecosystem (zmpi.checkpoint.hf): per
transformers `model_type`, a class whose table maps zmpi's parameters to the Hugging Face
tensors (`Tensor`: the two names, and whether Hugging Face stores it transposed), with the
config.json keys that give zmpi's model section and the values zmpi computes. GPT-2's
Conv1D weights are stored (in, out), as zmpi's Linear keeps them, so none is transposed; a
Llama's nn.Linear weights are (out, in), so each is. A model_type zmpi does not have, or a
config.json value zmpi does not compute, is an HFError, one line saying why.
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
    """One parameter: its zmpi name, its Hugging Face name (without the base model's prefix,
    unless `bare`: a tensor outside the base model, as an untied lm_head) and whether Hugging
    Face stores it transposed."""

    zmpi: str
    hf: str
    transpose: bool = False
    bare: bool = False

    def stored(self, prefix: str) -> str:
        """Its name in a file whose base-model tensors carry `prefix`."""
        return self.hf if self.bare else prefix + self.hf


class GPT2:
    """transformers' GPT2LMHeadModel against zmpi's GPT (models/gpt.py): the same pre-LN
    blocks, tanh GELU, LayerNorm eps 1e-5 and tied LM head. HF's fused c_attn holds [q | k | v]
    with heads in order, as zmpi's qkv does, and Conv1D's (in, out) weights are zmpi's
    Linear's: no tensor is transposed or permuted."""

    model_type, hf_class, prefix = "gpt2", "GPT2LMHeadModel", "transformer."
    # config.json key -> zmpi's model section key (integers >= 1)
    SHAPE = {"n_layer": "n_layer", "n_embd": "d_model", "n_head": "n_head",
             "n_positions": "seq_len", "vocab_size": "vocab_size"}
    KEYS = {"n_layer": "n_layer", "d_model": "d_model", "n_head": "n_head"}  # GPT's -> its
    DEFAULTS: dict = {}  # SHAPE keys config.json may leave out -> the key they default to
    # what zmpi's GPT computes (config.json key: (the value, its default in transformers))
    FIXED = {"activation_function": (("gelu_new", "gelu_pytorch_tanh"), "gelu_new"),
             "layer_norm_epsilon": ((1e-5,), 1e-5), "scale_attn_weights": ((True,), True),
             "scale_attn_by_inverse_layer_idx": ((False,), False),
             "add_cross_attention": ((False,), False), "tie_word_embeddings": ((True,), True)}
    BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")  # causal masks, not weights
    HEAD = "lm_head.weight"  # tied to wte: absent from save_pretrained's files, or equal

    @staticmethod
    def units(m: dict) -> list[list[Tensor]]:
        """The table of model section `m`, unit by unit as zmpi's GPT builds them."""
        n_layer = m["n_layer"]
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
    def model_section(m: dict) -> dict:
        """The zmpi model section (Config's `model`) of a directory's model `m`."""
        return dict(m)

    @staticmethod
    def run_model(shapes: dict, given: dict) -> dict:
        """What a run's model is, to compare with a directory's: its parameter shapes'
        model_of, and n_head where the run's model section `given` has it."""
        return {**GPT2.model_of(shapes), **{k: v for k, v in given.items() if k == "n_head"}}

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

    @staticmethod
    def read(config: dict, model: dict, where) -> None:
        """Nothing beyond SHAPE's keys: GPT-2's model section is its shape."""

    @classmethod
    def check(cls, config: dict, where) -> None:
        """HFError naming the first config.json key whose value zmpi's GPT does not compute."""
        n_inner, d = config.get("n_inner"), config.get("n_embd")
        if n_inner is not None and n_inner != (4 * d if type(d) is int else None):
            raise HFError(f"{where}: mismatch: n_inner {n_inner}: zmpi's GPT-2 MLP is 4 x "
                          f"n_embd ({d})")
        _check_fixed(cls, config, where, "GPT-2")

    @classmethod
    def export_model(cls, shapes: dict, section: dict, n_head, where) -> dict:
        """The model of a checkpoint: its shapes' model_of and n_head (the model section's,
        or `n_head` for a checkpoint saved without one; a ValueError where neither is, or
        where they disagree)."""
        model = cls.model_of(shapes)
        saved_heads = section.get("n_head")
        if n_head is not None and saved_heads not in (None, n_head):
            raise ValueError(f"--n-head {n_head}: the checkpoint's model has n_head "
                             f"{saved_heads}")
        model["n_head"] = n_head or saved_heads
        if model["n_head"] is None:
            raise ValueError(f"{where}: its config has no model.n_head (saved outside zmpi "
                             "train, and no parameter's shape shows it): give --n-head")
        if model["d_model"] % model["n_head"]:
            raise ValueError(f"n_head {model['n_head']} does not divide d_model "
                             f"{model['d_model']}")
        return model


class Llama:
    """transformers' LlamaForCausalLM against zmpi's Llama (models/llama.py): pre-norm blocks
    of RMSNorm, grouped-query attention with RoPE and a SwiGLU MLP, no biases, a final
    RMSNorm and an lm_head (untied unless tie_word_embeddings). nn.Linear stores (out, in),
    zmpi's Linear (in, out): every projection is transposed. RoPE rotates the two halves of
    each head as transformers' rotate_half does (docs/layers.md), so q and k are not permuted.
    The model section is zmpi's in LlamaConfig's names; rope_theta and rope_scaling are read
    from transformers 4's keys or transformers 5's rope_parameters, and written as both."""

    model_type, hf_class, prefix = "llama", "LlamaForCausalLM", "model."
    SHAPE = {k: k for k in ("vocab_size", "hidden_size", "intermediate_size",
                            "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                            "max_position_embeddings")}
    KEYS = {"n_layer": "num_hidden_layers", "d_model": "hidden_size",
            "n_head": "num_attention_heads"}
    DEFAULTS = {"num_key_value_heads": "num_attention_heads"}  # multi-head attention
    # what zmpi's Llama computes (config.json key: (the values, transformers' default))
    FIXED = {"hidden_act": (("silu",), "silu"), "attention_bias": ((False,), False),
             "mlp_bias": ((False,), False), "pretraining_tp": ((1,), 1)}
    BUFFERS = re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # older files
    HEAD = "lm_head.weight"  # when tied: absent from save_pretrained's files, or equal
    # the model section's keys that are not shapes, with LlamaConfig's (= transformers') defaults
    COMPUTE = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None}

    @staticmethod
    def units(m: dict) -> list[list[Tensor]]:
        """The table of model section `m`, unit by unit as zmpi's Llama builds them."""
        L = m["num_hidden_layers"]
        blocks = [[Tensor(f"units.{i + 1}.{z}.weight", f"layers.{i}.{h}.weight",
                          not z.startswith("ln"))
                   for z, h in (("ln1", "input_layernorm"), ("attn.q", "self_attn.q_proj"),
                                ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"),
                                ("attn.o", "self_attn.o_proj"),
                                ("ln2", "post_attention_layernorm"),
                                ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"),
                                ("mlp.down", "mlp.down_proj"))] for i in range(L)]
        head = [] if m["tie_word_embeddings"] else [
            Tensor(f"units.{L + 1}.lm_head", "lm_head.weight", bare=True)]
        return [[Tensor("units.0.wte", "embed_tokens.weight")], *blocks,
                [*head, Tensor(f"units.{L + 1}.ln_f.weight", "norm.weight")]]

    @staticmethod
    def shapes(m: dict) -> dict[str, tuple]:
        """zmpi's parameter shapes of model section `m`."""
        d, f, L = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
        kv = m["num_key_value_heads"] * (d // m["num_attention_heads"])
        block = {"ln1.weight": (d,), "attn.q.weight": (d, d), "attn.k.weight": (d, kv),
                 "attn.v.weight": (d, kv), "attn.o.weight": (d, d), "ln2.weight": (d,),
                 "mlp.gate.weight": (d, f), "mlp.up.weight": (d, f), "mlp.down.weight": (f, d)}
        out = {"units.0.wte": (m["vocab_size"], d)}
        for i in range(1, L + 1):
            out.update({f"units.{i}.{k}": s for k, s in block.items()})
        if not m["tie_word_embeddings"]:
            out[f"units.{L + 1}.lm_head"] = (m["vocab_size"], d)
        out[f"units.{L + 1}.ln_f.weight"] = (d,)
        return out

    @staticmethod
    def tied(m: dict) -> dict:
        L = m["num_hidden_layers"]
        return {f"units.{L + 1}.wte": "units.0.wte"} if m["tie_word_embeddings"] else {}

    @staticmethod
    def model_of(shapes: dict) -> dict:
        """The shape keys that zmpi parameter shapes show (hidden_size, intermediate_size,
        num_hidden_layers, vocab_size, tie_word_embeddings), or a ValueError."""
        wte = shapes.get("units.0.wte")
        L = sum(1 for name in shapes if name.endswith(".attn.q.weight"))
        if wte is None or len(wte) != 2 or not L or "units.1.mlp.gate.weight" not in shapes:
            raise ValueError("it has no token embedding and Llama blocks (units.0.wte, "
                             "units.1.attn.q.weight, units.1.mlp.gate.weight)")
        return {"num_hidden_layers": L, "hidden_size": wte[1], "vocab_size": wte[0],
                "intermediate_size": shapes["units.1.mlp.gate.weight"][1],
                "tie_word_embeddings": f"units.{L + 1}.lm_head" not in shapes}

    @classmethod
    def run_model(cls, shapes: dict, given: dict) -> dict:
        """What a run's model is, to compare with a directory's: its shapes' model_of, and
        the heads and RoPE of its model section `given` (zmpi's defaults where not given)."""
        heads = {k: given[k] for k in ("num_attention_heads", "num_key_value_heads")
                 if k in given}
        if "num_attention_heads" in heads:
            heads.setdefault("num_key_value_heads", heads["num_attention_heads"])
        return {**cls.COMPUTE, **{k: given[k] for k in cls.COMPUTE if k in given}, **heads,
                **cls.model_of(shapes)}

    @staticmethod
    def model_section(m: dict) -> dict:
        """The zmpi model section (Config's `model`) of a directory's model `m`."""
        return {"model_type": "llama", **{k: v for k, v in m.items() if v is not None}}

    @classmethod
    def read(cls, config: dict, model: dict, where) -> None:
        """Add to `model` what config.json says beyond the shape: rms_norm_eps, RoPE (HFError
        for a rope_scaling zmpi does not compute, naming it) and tie_word_embeddings."""
        from zmpi.nn.llama_functional import rope_inv_freq

        params = config.get("rope_parameters")
        if isinstance(params, dict):  # transformers 5: theta and scaling in one dict
            theta = params.get("rope_theta", config.get("rope_theta", cls.COMPUTE["rope_theta"]))
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
                scaling = None
        else:
            theta = config.get("rope_theta", cls.COMPUTE["rope_theta"])
            scaling = config.get("rope_scaling")
        d, heads = model["hidden_size"], model["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim not in (None, d // heads):
            raise HFError(f"{where}: mismatch: head_dim {head_dim}: zmpi's Llama computes "
                          f"hidden_size / num_attention_heads ({d // heads})")
        try:
            rope_inv_freq(d // heads, theta, scaling)
        except ValueError as e:
            raise HFError(f"{where}: mismatch: {e}") from None
        tie = config.get("tie_word_embeddings", False)
        if type(tie) is not bool:
            raise HFError(f"{where}: corrupt: tie_word_embeddings is {tie!r}, not true or false")
        eps = config.get("rms_norm_eps", cls.COMPUTE["rms_norm_eps"])
        if type(eps) not in (int, float) or not eps > 0:
            raise HFError(f"{where}: corrupt: rms_norm_eps is {eps!r}, not a number > 0")
        model.update(rms_norm_eps=eps, rope_theta=theta, rope_scaling=scaling,
                     tie_word_embeddings=tie)

    @classmethod
    def check(cls, config: dict, where) -> None:
        """HFError naming the first config.json key whose value zmpi's Llama does not compute."""
        _check_fixed(cls, config, where, "Llama")

    @classmethod
    def export_model(cls, shapes: dict, section: dict, n_head, where) -> dict:
        """The model of a checkpoint: its shapes' model_of and its model section's heads and
        RoPE (no shape shows them: a checkpoint saved outside zmpi train, without a Llama
        model section, is a ValueError; n_head, where given, must agree)."""
        model = cls.model_of(shapes)
        heads = section.get("num_attention_heads")
        if section.get("model_type") != "llama" or heads is None:
            raise CheckpointError(f"{where}: its config has no Llama model section with "
                             "num_attention_heads (saved outside zmpi train); no shape shows "
                             "the heads and RoPE a Llama export needs")
        if n_head is not None and n_head != heads:
            raise ValueError(f"--n-head {n_head}: the checkpoint's model has "
                             f"num_attention_heads {heads}")
        from zmpi.models.llama import LlamaConfig

        positions = section.get("max_position_embeddings", section.get("seq_len"))
        model.update({k: section.get(k, v) for k, v in cls.COMPUTE.items()},
                     num_attention_heads=heads,
                     num_key_value_heads=section.get("num_key_value_heads", heads),
                     max_position_embeddings=positions or LlamaConfig.max_position_embeddings)
        return model

    @classmethod
    def hf_config(cls, m: dict, dtype: str) -> dict:
        """config.json of model `m` for transformers: the shape, RoPE as transformers 4
        (rope_theta, rope_scaling) and 5 (rope_parameters) read it, no dropout, token ids
        null (a checkpoint does not record the tokenizer's)."""
        scaling = m["rope_scaling"]
        kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
        rope = {**{k: v for k, v in (scaling or {}).items() if k != "type"}, "rope_type": kind,
                "rope_theta": m["rope_theta"]}
        return {"architectures": [cls.hf_class], "model_type": cls.model_type,
                **{hf: m[z] for hf, z in cls.SHAPE.items()},
                "head_dim": m["hidden_size"] // m["num_attention_heads"], "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "pretraining_tp": 1, "rms_norm_eps": m["rms_norm_eps"],
                "rope_theta": m["rope_theta"], "rope_scaling": scaling, "rope_parameters": rope,
                "tie_word_embeddings": m["tie_word_embeddings"], "initializer_range": 0.02,
                "use_cache": True, "dtype": dtype, "bos_token_id": None, "eos_token_id": None}


def _check_fixed(arch, config: dict, where, name: str) -> None:
    """HFError naming the first of arch.FIXED's config.json keys whose value zmpi's `name`
    model does not compute."""
    for key, (allowed, default) in arch.FIXED.items():
        value = config.get(key, default)
        if value not in allowed or type(value) is not type(allowed[0]):
            raise HFError(f"{where}: mismatch: {key} {value!r}: zmpi's {name} computes "
                          f"{' or '.join(map(repr, allowed))}")


# model_type -> Architecture
ARCHITECTURES = {"gpt2": GPT2, "llama": Llama}


def architecture(model_type, where):
    """The architecture of config.json's model_type, or an HFError saying why there is none."""
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    raise HFError(f"{where}: model_type {model_type!r}: zmpi has no such model (it reads "
                  f"{', '.join(map(repr, ARCHITECTURES))})")
