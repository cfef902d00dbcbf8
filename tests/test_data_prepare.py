"""`zmpi data prepare --tokenizer tokenizer.json corpus.txt out.bin` (zmpi.data.prepare): the
tokens are the tokenizer's ids, streamed in pieces, in the dtype the vocabulary needs; zmpi
train reads and trains on them; its vocabulary is checked against the model's; bad inputs are
one line each. The tokenizers are built here with the tokenizers API (nothing downloaded);
the package is the `data` extra, which `make install` adds: these tests skip without it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import REPO_ROOT

tokenizers = pytest.importorskip(
    "tokenizers", reason="the tokenizers package (the data extra: pip install -e '.[data]') "
    "is not installed")

from zmpi.data import load_text, load_tokens  # noqa: E402
from zmpi.data.prepare import prepare, token_dtype  # noqa: E402

TEXT = load_text()[:60000]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(directory, tokenizer.json, corpus.txt, the tokenizer): a BPE of 300 ids trained on
    part of Tiny Shakespeare, and that part as the corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("prepare")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300,
                                                        special_tokens=["[UNK]"]),
                            length=len(TEXT))
    tok.save(str(d / "tokenizer.json"))
    (d / "corpus.txt").write_text(TEXT, encoding="utf-8")
    return d, d / "tokenizer.json", d / "corpus.txt", tok


def _zmpi(*args, cwd=REPO_ROOT, timeout=120):
    return subprocess.run([sys.executable, "-m", "zmpi.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_token_dtype_from_the_vocabulary_size():
    assert [token_dtype(v) for v in (1, 65535, 65536, 65537, 1 << 32)] == \
        ["uint16"] * 3 + ["uint32"] * 2  # 65536 ids: the largest, 65535, fits in 16 bits
    with pytest.raises(ValueError, match="more than a uint32"):
        token_dtype((1 << 32) + 1)


def test_tokens_are_the_tokenizers_ids_streamed_in_pieces(files, tmp_path, capsys):
    _, tokenizer, corpus, tok = files
    want = tok.encode(TEXT, add_special_tokens=False).ids
    # pieces of about 1 KB: about 60 of them, each cut at a line end, the bar shown
    info = prepare(tokenizer, corpus, tmp_path / "train.bin", chunk_bytes=1000)
    assert "tokenizing" in capsys.readouterr().err
    assert info["tokens"] == len(want) and info["dtype"] == "uint16" and \
        info["vocab_size"] == 300
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == want
    assert json.loads((tmp_path / "meta.json").read_text())["vocab_size"] == 300
    tokens, vocab = load_tokens(tmp_path / "train.bin")  # what zmpi train --data reads
    assert vocab == 300 and tokens.tolist() == want
    # val.bin of the same tokenizer beside it shares meta.json
    prepare(tokenizer, corpus, tmp_path / "val.bin", chunk_bytes=len(TEXT) * 2)
    assert capsys.readouterr().err == ""  # one piece: no bar
    assert np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist() == want


def test_a_vocabulary_over_65536_writes_uint32_that_zmpi_train_trains_on(tmp_path):
    """A WordLevel vocabulary of 70,000 words (ids above 65535 in the corpus): uint32 ids,
    read back by load_tokens through meta.json, and a short single-process zmpi train run."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 70000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    words = rng.integers(60000, 70000, size=3000)
    (tmp_path / "corpus.txt").write_text(
        "\n".join(" ".join(f"w{i}" for i in line) for line in words.reshape(-1, 10)) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    run = _zmpi("data", "prepare", "--tokenizer", tmp_path / "tokenizer.json",
                tmp_path / "corpus.txt", data / "train.bin")
    assert run.returncode == 0, run.stderr
    assert "3,000 tokens, uint32, vocab_size 70,000" in run.stdout
    tokens, vocab_size = load_tokens(data / "train.bin")
    assert tokens.dtype == np.uint32 and vocab_size == 70000
    assert tokens.tolist() == words.tolist()
    # --vocab-size as well: a uint32 file's vocabulary may pass 65,536 when given as a flag
    run = _zmpi("train", "--data", data / "train.bin", "--vocab-size", "70000",
                "--n-layer", "1", "--d-model", "16",
                "--n-head", "2", "--seq-len", "16", "--batch", "2", "--steps", "3",
                "--sample-tokens", "4", "--out", tmp_path / "run", timeout=300)
    assert run.returncode == 0, run.stderr
    assert len((tmp_path / "run" / "metrics.csv").read_text().splitlines()) == 1 + 3
    sample = (tmp_path / "run" / "sample.txt").read_text().split()
    assert sample and all(0 <= int(t) < 70000 for t in sample)


def test_zmpi_train_names_both_sizes_when_the_models_vocabulary_is_smaller(files, tmp_path):
    _, tokenizer, corpus, _ = files
    assert _zmpi("data", "prepare", "--tokenizer", tokenizer, corpus,
                 tmp_path / "train.bin").returncode == 0
    (tmp_path / "c.json").write_text(json.dumps({"model": {"vocab_size": 200}}))
    run = _zmpi("train", "--data", tmp_path / "train.bin", "--config", tmp_path / "c.json",
                "--steps", "1", "--out", tmp_path / "run")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "model.vocab_size" in lines[0] and "200 is smaller than the vocabulary of --data" \
        in lines[0] and "(300)" in lines[0]


def _error(args, cwd) -> str:
    run = _zmpi("data", "prepare", *args, cwd=cwd)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("zmpi data prepare: ")
    return lines[0]


def test_bad_inputs_are_one_line_each(files, tmp_path):
    _, tokenizer, corpus, _ = files
    t = ["--tokenizer", tokenizer]
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n")
    (tmp_path / "latin1.txt").write_bytes("line one\ncaf\u00e9\n".encode("latin-1"))
    (tmp_path / "other.json").write_text('{"version": "1.0"}')
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    os.mkfifo(tmp_path / "fifo")
    out = tmp_path / "out.bin"
    cases = [
        (["--tokenizer", tmp_path / "none.json", corpus, out], "none.json: not found"),
        (["--tokenizer", corpus, corpus, out], "corpus.txt: not a tokenizer.json"),
        (["--tokenizer", tmp_path / "other.json", corpus, out], "not a tokenizer.json"),
        (["--tokenizer", tmp_path / "binary.json", corpus, out], "not a tokenizer.json"),
        (["--tokenizer", tmp_path, corpus, out], "a directory, not a file"),
        ([*t, tmp_path / "empty.txt", out], "empty (0 bytes)"),
        ([*t, tmp_path / "blank.txt", out], "empty (no tokens)"),
        ([*t, tmp_path / "latin1.txt", out], "not UTF-8 text (byte 12)"),
        ([*t, tmp_path / "fifo", out], "a FIFO, not a regular file"),
        ([*t, "/dev/zero", out], "a character device, not a regular file"),
        ([*t, tmp_path / "none.txt", out], "none.txt: not found"),
        ([*t, corpus, "/dev/null"], "a character device, not a regular file"),
        ([*t, corpus, tmp_path / "no" / "out.bin"], "no directory"),
        ([*t, corpus, corpus, "--overwrite"], "is the corpus itself"),
    ]
    for args, message in cases:
        assert message in _error(args, tmp_path), args
    assert not out.exists() and not (tmp_path / "meta.json").exists()  # nothing half-written
    if os.geteuid() != 0:  # root reads a file of mode 000
        (tmp_path / "locked.json").write_text("{}")
        os.chmod(tmp_path / "locked.json", 0)
        assert "cannot read" in _error(["--tokenizer", tmp_path / "locked.json", corpus, out],
                                       tmp_path)


def test_an_existing_output_or_another_meta_is_refused_unless_overwrite(files, tmp_path):
    _, tokenizer, corpus, _ = files
    out = tmp_path / "train.bin"
    out.write_bytes(b"old")
    assert "train.bin exists: give --overwrite" in _error(["--tokenizer", tokenizer, corpus,
                                                           out], tmp_path)
    assert out.read_bytes() == b"old"
    (tmp_path / "meta.json").write_text('{"vocab_size": 65, "dtype": "uint16"}')
    message = _error(["--tokenizer", tokenizer, corpus, tmp_path / "val.bin"], tmp_path)
    assert "meta.json is there for other tokens" in message and "vocab_size 300" in message
    run = _zmpi("data", "prepare", "--tokenizer", tokenizer, corpus, out, "--overwrite")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "meta.json").read_text())["vocab_size"] == 300
    assert load_tokens(out)[1] == 300


def test_a_full_disk_or_a_fifo_meta_is_one_line_and_leaves_no_file(files, tmp_path):
    """An 8 KiB tmpfs (skipped where this process cannot mount one) fills up as the ids are
    written; a meta.json that is a FIFO is refused, never opened (reading it would wait for a
    writer)."""
    _, tokenizer, corpus, _ = files
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "meta.json")
    assert "meta.json: a FIFO, not a regular file" in _error(
        ["--tokenizer", tokenizer, corpus, fifo_dir / "train.bin"], tmp_path)
    drive = tmp_path / "drive"
    drive.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(drive)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        message = _error(["--tokenizer", tokenizer, corpus, drive / "train.bin"], tmp_path)
        assert f"output {drive / 'train.bin'}: cannot write: No space left on device" \
            in message
        assert os.listdir(drive) == []  # no partial file, no meta.json
    finally:
        subprocess.run(["umount", str(drive)], check=True)


def test_without_the_tokenizers_package_one_line_names_the_extra(files, tmp_path,
                                                                 monkeypatch):
    _, tokenizer, corpus, _ = files
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    with pytest.raises(ValueError, match=r"tokenizers package is not installed: pip install "
                       r"'zmpi\[data\]'"):
        prepare(tokenizer, corpus, tmp_path / "x.bin")


def test_load_tokens_refuses_a_bad_dtype_or_a_partial_id(tmp_path):
    np.arange(10, dtype=np.uint32).tofile(tmp_path / "a.bin")
    (tmp_path / "meta.json").write_text('{"vocab_size": 10, "dtype": "int8"}')
    with pytest.raises(ValueError, match="dtype must be one of uint16, uint32, got 'int8'"):
        load_tokens(tmp_path / "a.bin")
    (tmp_path / "meta.json").write_text('{"vocab_size": 10, "dtype": "uint32"}')
    assert load_tokens(tmp_path / "a.bin")[0].tolist() == list(range(10))
    with open(tmp_path / "a.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="42 bytes, not a whole number of uint32 ids"):
        load_tokens(tmp_path / "a.bin")
