"""Training data: the packaged corpus, a character tokenizer and rank-sliced batch samplers.

    text = load_text()                                  # tiny Shakespeare, 1.1 MB
    tok = CharTokenizer(text)                           # tok.vocab_size == 65
    train, val = train_val_split(tok.encode(text))
    sampler = BatchSampler(train, seq_len=64, global_batch=12, rank=r, world_size=4)
    x, y = sampler.sample(step)                         # (3, 64) int64 each; y = x shifted by 1

Data parallelism contract: the global batch of a step depends only on (seed, step), and rank r
gets rows [r*b, (r+1)*b) of it with b = global_batch // world_size. So N ranks together see
exactly the batch a single-process reference sees (`global_sample(step)`), which is what the
multi-rank tests compare against. No global random state is used.

Modules: `text` (load_text, CharTokenizer), `tokens` (load_tokens, read_meta,
check_vocab_size, FileWatch), `sampler` (train_val_split, BatchSampler, SyntheticSource).
Import from `zmpi.data`; the split is an implementation detail. `zmpi.data.prepare` (token
files from a tokenizer.json, `zmpi data prepare`) is imported on its own: it needs the
optional tokenizers package.
"""

from .sampler import BatchSampler, SyntheticSource, train_val_split
from .text import CharTokenizer, load_text
from .tokens import MAX_VOCAB, DataChanged, FileWatch, check_vocab_size, load_tokens, read_meta

__all__ = ["load_text", "CharTokenizer", "train_val_split", "BatchSampler", "SyntheticSource",
           "load_tokens", "read_meta", "check_vocab_size", "MAX_VOCAB", "FileWatch",
           "DataChanged"]
