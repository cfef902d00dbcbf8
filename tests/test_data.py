"""Corpus, tokenizer and the rank-sliced samplers' data-parallel contract."""

import numpy as np
import pytest

from zmpi.data import BatchSampler, CharTokenizer, SyntheticSource, load_text, train_val_split


@pytest.fixture(scope="module")
def text():
    return load_text()


@pytest.fixture(scope="module")
def tokens(text):
    return CharTokenizer(text).encode(text)


def test_load_text(text):
    assert len(text) > 1_000_000 and text.startswith("First Citizen:")
    with pytest.raises(ValueError, match="no corpus named 'nope'; available: tinyshakespeare"):
        load_text("nope")


def test_tokenizer_round_trip_on_corpus(text, tokens):
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == 65 and tok.chars == "".join(sorted(set(text)))
    assert tokens.dtype == np.int32 and tokens.shape == (len(text),)
    assert tokens.min() == 0 and tokens.max() == tok.vocab_size - 1
    assert tok.decode(tokens) == text
    assert tok.decode(tok.encode("")) == ""
    assert list(tok.encode("\n ")) == [0, 1]  # sorted vocabulary: '\n' < ' ' < ...


def test_tokenizer_unicode_and_errors():
    tok = CharTokenizer("héllo wörld ✓")
    s = "wörld ✓ héllo"
    assert tok.decode(tok.encode(s)) == s and tok.decode(tok.encode(s).tolist()) == s
    with pytest.raises(ValueError, match=r"character 'z' \(U\+007A\) at position 3"):
        tok.encode("ho zł")  # the first unknown character is reported
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer("")


def test_train_val_split():
    t = np.arange(100)
    tr, va = train_val_split(t)
    assert len(tr) == 90 and len(va) == 10 and np.array_equal(np.concatenate([tr, va]), t)
    assert len(train_val_split(t, 0.0)[1]) == 0
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(t, 1.0)


def _sources(world_size, rank, seed=0, tokens=None):
    toks = np.arange(1000, dtype=np.int32) if tokens is None else tokens
    return [BatchSampler(toks, 16, 12, rank, world_size, seed),
            SyntheticSource(50, 16, 12, rank, world_size, seed)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_slices_partition_the_global_batch(world_size, tokens):
    for kind in range(2):
        for step in (0, 1, 7):
            ref = _sources(1, 0, tokens=tokens)[kind].global_sample(step)
            parts = [_sources(world_size, r, tokens=tokens)[kind].sample(step)
                     for r in range(world_size)]
            b = 12 // world_size
            for r, (x, y) in enumerate(parts):  # rank r holds exactly rows [r*b, (r+1)*b)
                assert x.shape == y.shape == (b, 16) and x.dtype == y.dtype == np.int64
                assert np.array_equal(x, ref[0][r * b:(r + 1) * b])
            for i in (0, 1):
                assert np.array_equal(np.concatenate([p[i] for p in parts]), ref[i])


def test_y_is_x_shifted(tokens):
    for src in _sources(2, 1, tokens=tokens):
        x, y = src.sample(3)
        assert np.array_equal(x[:, 1:], y[:, :-1])
    s = BatchSampler(tokens, 8, 4)
    x, y = s.global_sample(0)
    for row_x, row_y in zip(x, y, strict=True):  # each row is a real window of the stream
        o = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(
            tokens, 9) == np.append(row_x, row_y[-1]), axis=1))[0])
        assert np.array_equal(tokens[o:o + 8], row_x)


def test_deterministic_across_instances_and_seeds(tokens):
    for a, b, c in zip(_sources(2, 0, tokens=tokens), _sources(2, 0, tokens=tokens),
                       _sources(2, 0, seed=1, tokens=tokens), strict=True):
        assert all(np.array_equal(u, v) for u, v in zip(a.sample(5), b.sample(5), strict=True))
        assert not np.array_equal(a.sample(5)[0], c.sample(5)[0])
        assert not np.array_equal(a.sample(5)[0], a.sample(6)[0])
        np.random.seed(123)  # global state must not matter
        assert np.array_equal(a.sample(5)[0], b.sample(5)[0])


def test_iteration_starts_at_step_0():
    s = SyntheticSource(10, 4, 6, rank=1, world_size=3, seed=2)
    it = iter(s)
    for step in range(3):
        x, y = next(it)
        assert np.array_equal(x, s.sample(step)[0]) and x.shape == (2, 4)
    assert s.local_batch == 2


def test_bad_arguments():
    toks = np.arange(100)
    with pytest.raises(ValueError, match=r"global_batch \(10\) must be divisible by world_size "
                                         r"\(4\)"):
        BatchSampler(toks, 8, 10, rank=0, world_size=4)
    with pytest.raises(ValueError, match="divisible"):
        SyntheticSource(10, 8, 7, world_size=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        BatchSampler(toks, 8, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="at least seq_len"):
        BatchSampler(np.arange(8), 8, 4)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(toks, 0, 4)
    with pytest.raises(ValueError, match="step must be >= 0"):
        BatchSampler(toks, 8, 4).sample(-1)


def test_binary_token_file_is_memory_mapped_and_checked(tmp_path):
    import json

    from zmpi.data import BatchSampler, load_tokens

    ids = (np.arange(5000) * 7 % 50).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match="give the vocabulary size"):
        load_tokens(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    tokens, vocab = load_tokens(tmp_path / "train.bin")
    assert isinstance(tokens, np.memmap) and vocab == 50 and tokens[123] == ids[123]
    with pytest.raises(ValueError, match="token id 49 >= vocab size 40"):
        load_tokens(tmp_path / "train.bin", vocab_size=40)
    a = BatchSampler(tokens, 16, 4, 0, 2, seed=1).sample(3)
    b = BatchSampler(ids, 16, 4, 0, 2, seed=1).sample(3)
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))  # same windows
