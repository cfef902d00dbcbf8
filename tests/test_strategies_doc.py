"""docs/strategies.md: its example strategy loads as written (tests/test_zero.py runs it through
the shared suite), and strategies load by registered name, by module path and by entry point,
with clear errors for bad ones."""
import re
import sys

import pytest
from mpi_util import REPO_ROOT

from zmpi.zero import available_strategies, get_strategy
from zmpi.zero.strategy import Strategy

DOC = REPO_ROOT / "docs" / "strategies.md"


def example_code() -> str:
    """The first python block of the tutorial: the whole strategy file."""
    return re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / "zero1_allreduce.py").write_text(example_code())
    return tmp_path


def test_strategy_by_module_path_and_bad_paths(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))
    cls = get_strategy("zero1_allreduce:Zero1Allreduce")
    assert issubclass(cls, Strategy) and cls.name == "zero1_allreduce"
    assert get_strategy("zero1_allreduce") is cls and "zero1_allreduce" in available_strategies()
    with pytest.raises(ValueError, match="cannot load partition strategy 'nope.mod:X'"):
        get_strategy("nope.mod:X")
    with pytest.raises(ValueError, match="not a subclass of zmpi.zero.strategy.Strategy"):
        get_strategy("zero1_allreduce:register")
    with pytest.raises(ValueError, match="unknown partition strategy 'stage9'; available: "
                                         "hybrid, hybrid_zero2, stage0"):
        get_strategy("stage9")


def test_strategy_by_entry_point(tmp_path, monkeypatch):
    """An installed distribution's entry point in the group zmpi.strategies."""
    (tmp_path / "ep_strategy.py").write_text(
        "from zmpi.zero.stage2 import Stage2\nclass Mine(Stage2):\n    pass\n")
    dist = tmp_path / "ep_strategy-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-strategy\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[zmpi.strategies]\nmine = ep_strategy:Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "mine" in available_strategies()
    cls = get_strategy("mine")
    assert cls.__name__ == "Mine" and cls.name == "mine"


def test_plain_module_runs_as_one_unit():
    import numpy as np

    from zmpi import Engine, __version__
    from zmpi.nn import Linear

    assert __version__ and "zmpi" in sys.modules
    with pytest.warns(UserWarning, match="runs as one unit"):
        engine = Engine(Linear(8, 4, rng=np.random.default_rng(0)),
                        {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}})
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    first = engine.train_step(x, np.arange(4))
    for _ in range(20):
        last = engine.train_step(x, np.arange(4))
    assert last < first
    with pytest.raises(TypeError, match="needs a zmpi.nn UnitModel or Module"):
        Engine(object(), {})


def test_available_strategies_lists_every_builtin_in_a_fresh_process():
    import subprocess

    out = subprocess.run([sys.executable, "-c", "from zmpi.zero import available_strategies;"
                          " print(available_strategies())"], capture_output=True, text=True,
                         cwd=REPO_ROOT, check=True).stdout
    assert "['hybrid', 'hybrid_zero2', 'stage0', 'stage1', 'stage2', 'stage3', 'zeropp']" in out


def test_the_names_a_strategy_author_uses_are_documented_and_importable():
    """docs/strategies.md's table of names: each imports as written, and it holds every name
    the built-in strategies import from zmpi.config and zmpi.words (ConfigError, count)."""
    import importlib

    section = DOC.read_text().split("## Names a strategy author uses", 1)[1].split("\n## ")[0]
    names = re.findall(r"^\| `(zmpi\.[\w.]+)` \|", section, re.M)
    for dotted in names:
        module, _, attr = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), dotted
    used = set()
    for path in (REPO_ROOT / "zmpi" / "zero").glob("*.py"):
        for module, attrs in re.findall(r"^from (zmpi\.(?!zero)[\w.]+) import (.+)$",
                                        path.read_text(), re.M):
            used |= {f"{module}.{a.strip()}" for a in attrs.split(",")}
    assert {"zmpi.config.ConfigError", "zmpi.words.count"} <= used
    assert {n for n in used if n.startswith(("zmpi.config.", "zmpi.words."))} <= set(names)


def test_load_strategy_file_registers_its_strategies(tmp_path, isolated_registry):
    from zmpi.zero import load_strategy_file

    path = tmp_path / "mine_file.py"
    path.write_text(example_code().replace('"zero1_allreduce"', '"mine_file"'))
    assert load_strategy_file(path) == ["mine_file"]
    assert load_strategy_file(path) == ["mine_file"]  # already imported: not run again
    assert get_strategy("mine_file").__module__ == "mine_file"
    with pytest.raises(ValueError, match="is not a Python file"):
        load_strategy_file(tmp_path / "missing.py")
    (tmp_path / "bad_file.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="cannot load strategy module .*RuntimeError: boom"):
        load_strategy_file(tmp_path / "bad_file.py")
    other = tmp_path / "sub"
    other.mkdir()
    (other / "mine_file.py").write_text("")
    with pytest.raises(ValueError, match="a module named 'mine_file' is already imported"):
        load_strategy_file(other / "mine_file.py")
