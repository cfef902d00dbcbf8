"""`sparse_attention` (DeepSpeed's section): block-sparse attention in the GPT's layers.

The section is kept as DeepSpeed writes it, {"mode": "fixed", "block": 16, ...}; its keys and
their rules are zmpi.nn.sparsity's (`sparsity_from_dict`), checked when the config is read.
The layout itself needs the model's head count: `sparsity(num_heads)` makes it for the model.
This module imports no MPI.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from zmpi.nn.sparsity import SparsityConfig, sparsity_from_dict

from .base import ConfigError, _Section

__all__ = ["SparseAttentionConfig", "sparse_attention_flag"]

_PREFIX = "sparse_attention."


@dataclass(frozen=True)
class SparseAttentionConfig(_Section):
    """`sparse_attention`: empty (the default) for dense attention; else DeepSpeed's keys,
    "mode" (dense, fixed, variable, bigbird, bslongformer, local; default fixed) and that
    mode's keys (docs/sparse-attention.md). A causal model intersects the layout with the
    causal mask."""

    keys: dict = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def sparsity(self, num_heads: int) -> SparsityConfig | None:
        """The layout's config for a model of `num_heads` heads (None: dense attention)."""
        if not self.keys:
            return None
        try:
            return sparsity_from_dict(dict(self.keys), num_heads)
        except ValueError as e:  # zmpi.nn.sparsity names the key as sparse_attention.<key>
            key, sep, msg = str(e).partition(": ")
            if sep and key.startswith(_PREFIX):
                raise ConfigError(key[len(_PREFIX):], msg) from None
            raise ConfigError("", str(e)) from None

    def _validate(self):
        sparsity = self.sparsity(num_heads=1)  # every key and rule but the model's heads
        if sparsity is not None:
            object.__setattr__(self, "_own_notes", tuple(sparsity.notes()))

    @classmethod
    def from_dict(cls, d: Mapping):
        if not isinstance(d, Mapping):
            raise ConfigError("", f"expected object, got {type(d).__name__} ({d!r})")
        return cls(keys=dict(d))

    def to_dict(self) -> dict:
        return dict(self.keys)

    def replace(self, **kw):
        return type(self).from_dict({**self.keys, **kw})


def sparse_attention_flag(text: str) -> SparseAttentionConfig:
    """A command line's --sparse-attention: a mode name (that mode at DeepSpeed's defaults) or
    a JSON object as the config's section; ConfigError (one line) if it is neither."""
    from .base import parse_json

    stripped = text.strip()
    section = parse_json(stripped, "--sparse-attention") if stripped.startswith("{") \
        else {"mode": stripped}
    try:
        return SparseAttentionConfig.from_dict(section)
    except ConfigError as e:
        raise e.prefixed("sparse_attention") from None
