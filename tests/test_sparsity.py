"""Block-sparse layouts (zmpi.nn.sparsity) against DeepSpeed's make_layout, and the
`sparse_attention` JSON section.

The expected layouts come from tests/deepspeed_sparsity.py, a literal transcription of
DeepSpeed's sparsity_config.py on NumPy, over a grid of parameter sets per mode, and from a few
small layouts checked by hand and written out below. DeepSpeed draws random blocks (bigbird,
variable) with Python's global `random.sample`; zmpi draws the same calls from
`random.Random(seed)`, so after `random.seed(seed)` the transcription gives the very same
random blocks and the random modes are compared exactly too (their rules, k distinct blocks
per row within the allowed columns, are also checked on their own).
"""
import dataclasses
import inspect
import itertools
import json
import random
import re
import subprocess
import sys

import deepspeed_sparsity as ds
import numpy as np
import pytest
from mpi_util import REPO_ROOT

from zmpi.nn.sparsity import (
    MODES,
    BigBirdSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
    causal_layout,
    check_layout,
    kept_blocks,
    mode_keys,
    sparsity_from_dict,
)
from zmpi.nn.sparsity_pieces import random_blocks

RANDOM_MODES = ("variable", "bigbird")
GLOBALS = [([0], None), ([1, 5], None), ([2, 9], None), ([0, 4], [2, 6]), ([3], [20]), ([], None)]


def grid(**axes):
    """Every combination of the axes' values, as keyword dicts."""
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def with_globals(cases):
    out = []
    for case in cases:
        starts, stops = case.pop("globals")
        out.append({**case, "global_block_indices": starts, "global_block_end_indices": stops})
    return out


HEADS = dict(num_heads=[1, 3], different_layout_per_head=[False, True])
BOTH = ["unidirectional", "bidirectional"]
CASES = {  # mode -> [(constructor kwargs, block rows)]
    "dense": grid(**HEADS, n=[1, 2, 5]),
    "fixed": grid(**HEADS, num_local_blocks=[1, 2, 3, 4, 6], num_global_blocks=[1, 2, 3],
                  attention=BOTH, horizontal_global_attention=[False, True],
                  num_different_global_patterns=[1, 2, 4], n=[1, 2, 5, 7, 8, 12]),
    "variable": with_globals(grid(**HEADS, num_random_blocks=[0, 3],
                                  local_window_blocks=[[1], [2, 3], [1, 2, 1], [2, 0, 3]],
                                  globals=GLOBALS, attention=BOTH,
                                  horizontal_global_attention=[False, True], n=[1, 4, 10])),
    "bigbird": grid(**HEADS, num_random_blocks=[0, 1, 2], num_sliding_window_blocks=[1, 2, 3, 5],
                    num_global_blocks=[0, 1, 2], attention=BOTH, n=[1, 2, 4, 9]),
    "bslongformer": with_globals(grid(**HEADS, num_sliding_window_blocks=[1, 3, 4, 7],
                                      globals=GLOBALS, attention=BOTH, n=[1, 3, 6, 9])),
    "local": grid(num_heads=[1, 3], num_sliding_window_blocks=[1, 2, 3, 5, 8], attention=BOTH,
                  n=[1, 2, 5, 9]),
}


def deepspeed_layout(mode, kwargs, seq_len, seed=0):
    """DeepSpeed's layout (the transcription), or the exception its constructor or
    make_layout raises."""
    random.seed(seed)
    try:
        return ds.MODES[mode](**kwargs).make_layout(seq_len)
    except (ValueError, NotImplementedError) as e:
        return e


def zmpi_layout(mode, kwargs, seq_len, seed=0):
    seeded = {"seed": seed} if mode in RANDOM_MODES else {}
    try:
        return MODES[mode](**kwargs, **seeded).make_layout(seq_len)
    except ValueError as e:
        return e


@pytest.mark.parametrize("mode", CASES)
def test_layouts_equal_deepspeeds_over_a_grid_of_parameters(mode):
    """Every parameter set of the grid: the same layout as DeepSpeed's, or refused where
    DeepSpeed raises. One refusal of zmpi's own: fixed with fewer block rows than
    num_global_blocks (DeepSpeed's last window then starts at a negative index and wraps)."""
    block, compared = 4, 0
    for case in CASES[mode]:
        kwargs = dict(case)
        seq_len = kwargs.pop("n") * block
        ours = zmpi_layout(mode, {**kwargs, "block": block}, seq_len, seed=7)
        theirs = deepspeed_layout(mode, {**kwargs, "block": block}, seq_len, seed=7)
        if mode == "fixed" and seq_len // block < kwargs["num_global_blocks"] and \
                not isinstance(theirs, Exception):
            assert "sparse_attention.num_global_blocks" in str(ours), (case, ours)
        elif isinstance(theirs, Exception):
            assert isinstance(ours, ValueError), (case, theirs)
        else:
            assert not isinstance(ours, Exception), (case, ours)
            assert ours.dtype == bool and ours.shape == theirs.shape, case
            np.testing.assert_array_equal(ours, theirs.astype(bool), err_msg=str(case))
            compared += 1
    assert compared >= 0.15 * len(CASES[mode])  # many valid parameter sets, not only refusals


def picture(text: str) -> np.ndarray:
    """A layout drawn one block row a line, '#' kept and '.' not."""
    return np.array([[c == "#" for c in line.split()[0]] for line in text.strip().splitlines()])


# (mode, constructor kwargs, block rows, head -> head's layout drawn by hand from the rules)
HAND = [
    ("fixed", dict(attention="unidirectional"), 8, {0: """
        #.......
        ##......
        ###.....
        ####....    window 0 ends; its last block (3) is global from row 3 on
        ...##...
        ...###..
        ...####.
        ...#####    window 1's last block (7) is global from row 7 on
    """}),
    ("fixed", dict(num_heads=4, different_layout_per_head=True, attention="unidirectional",
                   num_different_global_patterns=4), 8, {2: """
        #.......
        ##......
        ###.....
        ####....
        .#..#...    head 2: block 1 of each window is global (4 - (1 + 2))
        .#..##..
        .#..###.
        .#..####
    """}),
    ("fixed", dict(attention="unidirectional"), 6, {0: """
        #.....
        ##....
        ###...
        ####..
        ...##.      a short last window: its global block is min(4 + 3, 6 - 1) = 5
        ...###
    """}),
    ("fixed", dict(num_local_blocks=3, horizontal_global_attention=True), 6, {0: """
        ###..#
        ###..#
        ######      block 2 (global) attends everywhere, and is attended by every row
        ..####
        ..####
        ######
    """}),
    ("variable", dict(local_window_blocks=[1, 2]), 6, {0: """
        #.....      windows of 1, 2, then 2 repeated: [0] [1 2] [3 4] [5]
        ###...
        ###...
        #..##.
        #..##.
        #....#
    """}),
    ("bigbird", dict(num_random_blocks=0, attention="unidirectional"), 5, {0: """
        #....
        ##...
        ###..
        #.##.
        #..##
    """}),
    ("bslongformer", {}, 5, {0: """
        #####
        ###..
        ####.
        #.###
        #..##
    """}),
    ("local", {}, 5, {0: """
        #....
        ##...
        .##..
        ..##.
        ...##
    """}),
]


@pytest.mark.parametrize("mode, kwargs, n, heads", HAND, ids=[h[0] for h in HAND])
def test_small_layouts_checked_by_hand(mode, kwargs, n, heads):
    kwargs = {"num_heads": 1, "block": 2, **kwargs}
    ours = MODES[mode](**kwargs).make_layout(2 * n)
    theirs = ds.MODES[mode](**kwargs).make_layout(2 * n)
    for h, drawn in heads.items():
        np.testing.assert_array_equal(ours[h], picture(drawn))
        np.testing.assert_array_equal(theirs[h], picture(drawn))  # the oracle agrees


def test_random_blocks_are_k_distinct_blocks_per_row_in_the_allowed_columns():
    """The random blocks' rules, independently of DeepSpeed's stream: k distinct per row, from
    every column (or those at or before the row, causal), and each allowed column drawn."""
    n, k = 9, 3
    seen = np.zeros((n, n), int)
    for seed in range(60):
        full = random_blocks(random.Random(seed), n, k, causal=False)
        causal = random_blocks(random.Random(seed), n, 1, causal=True)
        assert (full.sum(axis=1) == k).all() and (causal.sum(axis=1) == 1).all()
        assert not np.triu(causal, 1).any()
        seen += full
    assert seen.all()  # no column left out of the draws


def test_random_layouts_are_deterministic_in_the_seed_and_on_every_rank():
    """The seed alone decides the random blocks: the same twice, the global `random` state
    neither read nor advanced, another seed another layout, and a fresh interpreter with
    another hash seed (another rank) the same; importing the module loads no MPI or torch."""
    cfg = BigBirdSparsityConfig(num_heads=4, block=16, different_layout_per_head=True,
                                num_random_blocks=2, seed=11)
    first = cfg.make_layout(512)
    random.seed(1)
    state = random.getstate()
    np.testing.assert_array_equal(cfg.make_layout(512), first)
    assert random.getstate() == state
    assert not (dataclasses.replace(cfg, seed=12).make_layout(512) == first).all()
    assert len({first[h].tobytes() for h in range(4)}) == 4  # a layout per head
    code = ("import sys; from zmpi.nn.sparsity import BigBirdSparsityConfig as C; "
            "print(C(num_heads=4, block=16, different_layout_per_head=True, "
            "num_random_blocks=2, seed=11).make_layout(512).tobytes().hex()); "
            "assert not {'mpi4py', 'torch'} & set(sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60, env={"PYTHONHASHSEED": "123",
                                                     "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == first.tobytes()


def test_each_modes_keys_and_defaults_are_deepspeeds_constructor_arguments():
    """A mode's JSON keys are its DeepSpeed constructor's arguments but num_heads (the model
    gives it), with the defaults of DeepSpeed's config reader: the constructor's, but bigbird's
    num_random_blocks, SPARSE_NUM_RANDOM_BLOCKS_DEFAULT = 0 in deepspeed/runtime/config.py
    (the constructor's is 1); the random modes add their seed (default 0)."""
    reader = {"bigbird": {"num_random_blocks": 0}}
    for mode, cls in ds.MODES.items():
        params = inspect.signature(cls.__init__).parameters
        theirs = {k: p.default for k, p in params.items() if k not in ("self", "num_heads")}
        theirs.update(reader.get(mode, {}))
        ours = mode_keys(mode)
        assert ("seed" in ours) == (mode in RANDOM_MODES) and ours.pop("seed", 0) == 0
        assert ours == {k: tuple(v) if isinstance(v, list) else v for k, v in theirs.items()}


def test_the_json_section_as_deepspeed_writes_it():
    text = """{"mode": "fixed", "block": 16, "different_layout_per_head": true,
               "num_local_blocks": 4, "num_global_blocks": 1, "attention": "unidirectional",
               "horizontal_global_attention": false, "num_different_global_patterns": 4}"""
    cfg = sparsity_from_dict(json.loads(text), num_heads=8)
    assert cfg == FixedSparsityConfig(8, 16, True, 4, 1, "unidirectional", False, 4)
    kwargs = {k: v for k, v in json.loads(text).items() if k != "mode"}
    np.testing.assert_array_equal(
        cfg.make_layout(256), ds.FixedSparsityConfig(8, **kwargs).make_layout(256))
    assert sparsity_from_dict({}, 2) == FixedSparsityConfig(2)  # DeepSpeed's default mode
    variable = sparsity_from_dict(json.loads(
        '{"mode": "variable", "global_block_indices": [0, 8], '
        '"global_block_end_indices": [2, 9], "local_window_blocks": [4, 8], "seed": 3}'), 2)
    assert variable == VariableSparsityConfig(2, local_window_blocks=(4, 8), seed=3,
                                              global_block_indices=(0, 8),
                                              global_block_end_indices=(2, 9))
    assert sparsity_from_dict({"mode": "variable", "global_block_end_indices": None}, 2) == \
        VariableSparsityConfig(2)
    # DeepSpeed's config reader gives bigbird SPARSE_NUM_RANDOM_BLOCKS_DEFAULT = 0 random
    # blocks (its class's default, and BigBirdSparsityConfig's, is 1)
    assert sparsity_from_dict({"mode": "bigbird"}, 2) == BigBirdSparsityConfig(
        2, num_random_blocks=0)


REFUSED = [  # (section, the key named, words of the reason)
    ([], "sparse_attention", "expected an object"),
    ({"mode": "sparse"}, "mode", "not one of dense, fixed, variable, bigbird, bslongformer"),
    ({"mode": None}, "mode", "not one of"),
    ({"blok": 16}, "blok", "unknown key; mode 'fixed' takes block, different_layout_per_head"),
    ({"mode": "bigbird", "num_local_blocks": 4}, "num_local_blocks", "a key of mode 'fixed'"),
    ({"mode": "fixed", "global_block_indices": [0]}, "global_block_indices",
     "a key of mode 'variable' and 'bslongformer', not of 'fixed'"),
    ({"mode": "fixed", "seed": 1}, "seed", "a key of mode 'variable' and 'bigbird'"),
    ({"mode": "local", "different_layout_per_head": True}, "different_layout_per_head",
     "a key of mode"),
    ({"block": "16"}, "block", "expected an integer >= 1, got '16'"),
    ({"block": 16.0}, "block", "expected an integer"),
    ({"block": 0}, "block", "expected an integer >= 1"),
    ({"block": True}, "block", "expected an integer"),
    ({"different_layout_per_head": 1}, "different_layout_per_head", "expected true or false"),
    ({"attention": "causal"}, "attention", "'unidirectional', 'bidirectional'"),
    ({"num_global_blocks": None}, "num_global_blocks", "expected an integer"),
    ({"mode": "variable", "local_window_blocks": []}, "local_window_blocks", "non-empty list"),
    ({"mode": "variable", "local_window_blocks": 4}, "local_window_blocks", "list of integers"),
    ({"mode": "variable", "local_window_blocks": [4, 0]}, "local_window_blocks[1]", ">= 1"),
    ({"mode": "bslongformer", "global_block_indices": [-1]}, "global_block_indices[0]", ">= 0"),
    ({"mode": "bigbird", "num_random_blocks": -1}, "num_random_blocks", ">= 0"),
    ({"mode": "bigbird", "seed": -1}, "seed", ">= 0"),
    # DeepSpeed's rules between keys
    ({"num_local_blocks": 4, "num_global_blocks": 3}, "num_global_blocks",
     "3 does not divide num_local_blocks 4"),
    ({"attention": "unidirectional", "horizontal_global_attention": True},
     "horizontal_global_attention", "only attention 'bidirectional'"),
    ({"mode": "variable", "attention": "unidirectional", "horizontal_global_attention": True},
     "horizontal_global_attention", "only attention 'bidirectional'"),
    ({"num_different_global_patterns": 2}, "num_different_global_patterns",
     "need different_layout_per_head true"),
    ({"different_layout_per_head": True, "num_local_blocks": 4, "num_global_blocks": 2,
      "num_different_global_patterns": 3}, "num_different_global_patterns",
     "3 is more than the 2 groups"),
    ({"mode": "variable", "global_block_indices": [0, 4], "global_block_end_indices": [2]},
     "global_block_end_indices", "1 end indices for 2 global_block_indices"),
    ({"mode": "bslongformer", "global_block_indices": [3], "global_block_end_indices": [3]},
     "global_block_end_indices", "end 3 is not after its start 3"),
    ({"mode": "bigbird", "attention": "unidirectional", "num_random_blocks": 2},
     "num_random_blocks", "block row 0 has 1 block to draw from"),
]


@pytest.mark.parametrize("section, key, reason", REFUSED, ids=[r[1] for r in REFUSED])
def test_a_bad_section_is_refused_naming_its_key(section, key, reason):
    name = key if key == "sparse_attention" else f"sparse_attention.{key}"
    with pytest.raises(ValueError, match="^" + name.replace("[", r"\[").replace("]", r"\]")
                       + ": ") as e:
        sparsity_from_dict(section, num_heads=4)
    assert reason in str(e.value)
    assert "\n" not in str(e.value)


def test_a_sequence_the_layout_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="sequence length 100 is not a positive multiple of "
                                         "sparse_attention.block 16"):
        FixedSparsityConfig(2).make_layout(100)
    with pytest.raises(ValueError, match="sparse_attention.num_sliding_window_blocks: 5 "
                                         "blocks is more than the 4 block rows"):
        sparsity_from_dict({"mode": "local", "num_sliding_window_blocks": 5}, 2).make_layout(64)
    with pytest.raises(ValueError, match="sparse_attention.num_random_blocks: 3 blocks"):
        BigBirdSparsityConfig(2, block=8, num_random_blocks=3).make_layout(16)
    with pytest.raises(ValueError, match="^num_heads: expected an integer >= 1"):
        sparsity_from_dict({}, num_heads=0)


def test_causal_layout_keeps_the_lower_triangle_of_blocks():
    layout = np.random.default_rng(0).integers(0, 2, (3, 7, 7), dtype=np.uint8)
    causal = causal_layout(layout)
    assert causal.dtype == bool
    np.testing.assert_array_equal(causal, np.tril(layout).astype(bool))
    np.testing.assert_array_equal(causal_layout(causal), causal)


def test_every_modes_causal_layout_gives_every_query_a_key():
    """The grid's layouts pass check_layout once made causal (each keeps its diagonal)."""
    for mode, cases in CASES.items():
        for case in cases[::7]:
            kwargs = dict(case)
            n = kwargs.pop("n")
            layout = zmpi_layout(mode, {**kwargs, "block": 2}, 2 * n)
            if not isinstance(layout, ValueError):
                check_layout(causal_layout(layout), 2 * n, 2)


def test_check_layout_refuses_a_row_without_keys_a_bad_shape_and_length():
    layout = causal_layout(np.ones((2, 4, 4), bool))
    check_layout(layout, 64, 16)
    layout[1, 3, :3] = False
    check_layout(layout, 64, 16)  # row 3 still keeps block 3
    layout[1, 2:] = False
    with pytest.raises(ValueError, match=r"head 1, query block row 2 \(tokens 32-47\) keeps no "
                                         r"key block \(and 1 more rows\)"):
        check_layout(layout, 64, 16)
    with pytest.raises(ValueError, match=r"of shape \(2, 4, 4\) for sequence length 128 at "
                                         r"block 16: expected \(heads, 8, 8\)"):
        check_layout(np.ones((2, 4, 4), bool), 128, 16)
    with pytest.raises(ValueError, match="sequence length 60 is not a positive multiple"):
        check_layout(np.ones((2, 4, 4), bool), 60, 16)


def test_kept_blocks_counts_over_heads():
    fixed = FixedSparsityConfig(3, block=2, attention="unidirectional").make_layout(16)
    assert kept_blocks(fixed) == 3 * (1 + 2 + 3 + 4 + 2 + 3 + 4 + 5)  # the first picture above
    assert kept_blocks(MODES["dense"](5, block=4).make_layout(24)) == 5 * 6 * 6


DOC = REPO_ROOT / "docs" / "sparse-attention.md"


def test_the_docs_example_runs_and_its_table_gives_each_modes_keys_and_defaults():
    """docs/sparse-attention.md: the Python example as written; the keys table row by row equal
    to mode_keys (a default in JSON, '-' where the mode does not take the key)."""
    text = DOC.read_text()
    (code,) = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
               if "sparsity_from_dict" in b]
    exec(compile(code, str(DOC), "exec"), {})
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| key |")))
    stop = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    header, _rule, *rows = lines[start:stop]  # the keys table, where it is on the page
    modes = [cell.strip(" `") for cell in header.split("|")[2:-1]]
    assert modes == list(MODES)
    table = {}
    for row in rows:
        key, *cells = [cell.strip(" `") for cell in row.split("|")[1:-1]]
        for mode, cell in zip(modes, cells, strict=True):
            if cell != "-":
                table.setdefault(mode, {})[key] = json.loads(cell)
    expected = {mode: {k: list(v) if isinstance(v, tuple) else v
                       for k, v in mode_keys(mode).items()} for mode in MODES}
    assert table == expected


def test_keys_that_leave_the_layout_unchanged_are_noted():
    """different_layout_per_head where heads cannot differ, a seed with no random blocks:
    accepted (DeepSpeed takes them) and named in notes(); where they act, no note."""
    for mode, section in [("dense", {}), ("bslongformer", {}), ("fixed", {}),
                          ("variable", {"seed": 5}), ("bigbird", {"num_random_blocks": 0})]:
        cfg = sparsity_from_dict({"mode": mode, "different_layout_per_head": True, **section}, 4)
        layout = cfg.make_layout(128)
        assert (layout == layout[:1]).all()  # every head the same: the key had no effect
        assert cfg.notes()[0].startswith("different_layout_per_head: accepted without effect")
    assert sparsity_from_dict({"mode": "variable", "seed": 5}, 4).notes() == \
        ["seed: accepted without effect (num_random_blocks is 0)"]
    for section in [{"mode": "bigbird", "num_random_blocks": 1, "seed": 5},
                    {"num_different_global_patterns": 2, "attention": "unidirectional"},
                    {"mode": "variable", "num_random_blocks": 1, "seed": 3}]:
        cfg = sparsity_from_dict({**section, "different_layout_per_head": True}, 4)
        layout = cfg.make_layout(128)
        assert not (layout == layout[:1]).all() and cfg.notes() == []
    assert sparsity_from_dict({}, 4).notes() == []
