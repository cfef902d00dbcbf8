"""Pipeline parallelism in the engine (tests/ranks/pipeline_checks.py): a 6-unit GPT cut into
stages and trained with GPipe and 1F1B, at pp 2, 3 and 4 and (dp, pp, tp) in (1, 2, 2),
(2, 2, 1), (2, 2, 2), against the same model trained in one process without pipelining: fp64 to
rounding (1e-12 of the move training made), fp32 within 1e-5 of it (model-wide); the loss the
same on every rank; the tied embedding's copy on the last stage equal to the first stage's;
ZeRO stages 0-3 inside the stages. Saved activations in the ledger: GPipe holds m
micro-batches, 1F1B at most p - s (exactly, in bytes). The config's pipeline section and
`zmpi train --pp` (schedules and partitions in tests/test_pipeline_schedule.py)."""
import pytest
from mpi_util import CLI, RANKS_DIR, launch_mpi, run_mpi, said_by_ranks

from zmpi.config import Config, ConfigError

STEPS, MICRO_BATCHES = 4, 4  # as tests/ranks/pipeline_checks.py
UNITS = ["TokenPositionEmbedding", "Block", "Block", "Block", "Block", "LMHead"]
LAUNCHES = {2: ["1,2,1"], 3: ["1,3,1"], 4: ["1,4,1", "1,2,2", "2,2,1"], 8: ["2,2,2"]}


@pytest.fixture(scope="module", params=sorted(LAUNCHES), ids=lambda n: f"{n}ranks")
def reports(request):
    return run_mpi(RANKS_DIR / "pipeline_checks.py", request.param, LAUNCHES[request.param],
                   timeout=300)


def layout_of(key):
    return tuple(int(n) for n in key.split("_")[0].split(","))


@pytest.mark.mpi
def test_pipelined_training_matches_one_process(reports):
    runs = reports[0]["runs"]
    layouts = {layout_of(k) for k in runs}
    assert layouts == {tuple(int(n) for n in a.split(",")) for a in LAUNCHES[len(reports)]}
    for name, run in runs.items():
        if name.endswith("fp64"):
            assert run["model_move"] <= 1e-12 and run["loss_diff"] <= 1e-13, (name, run)
            continue
        # fp32: the tied embedding's two gradients are summed in another order (measured
        # up to 5.1e-6 of the model's move, at stage 3)
        assert run["model_move"] <= 1e-5 and run["loss_diff"] <= 1e-6, (name, run)
        assert run["names_match"] and run["same_loss_everywhere"], name
        assert run["tied_equal"] in (True, None), name  # None: stage 3 releases parameters
    strategies = {k.split("_")[2] for k in runs if layout_of(k) == (1, 2, 1)}
    assert strategies in (set(), {"stage0", "stage1", "stage2", "stage3"})
    for r in reports[1:]:
        assert {k: v["model_move"] for k, v in r["runs"].items()} == \
            {k: v["model_move"] for k, v in runs.items()}


@pytest.mark.mpi
def test_stages_hold_the_units_in_order_and_the_tied_copy_last(reports):
    for key in reports[0]["runs"]:
        if key.endswith("fp64"):
            continue
        dp, pp, tp = layout_of(key)
        stages = [r["runs"][key]["units"] for r in reports[::dp * tp]]  # one rank per stage
        assert len(stages) == pp and all(stages), key
        assert stages[-1][0] == "HeldTokenPositionEmbedding", key
        cut = [stages[0], *stages[1:-1], stages[-1][1:]]
        assert [u for s in cut for u in s] == UNITS, key


@pytest.mark.mpi
def test_pipeline_messages_and_tied_reductions_are_counted(reports):
    """Per step a stage sends m activations and a header forward (not the last) and m
    gradients back (not the first); the first and last stages allreduce the tied gradients
    once."""
    for r in reports:
        for key, run in r["runs"].items():
            if key.endswith("fp64"):
                continue
            dp, pp, tp = layout_of(key)
            stage = r["rank"] // (dp * tp)
            sends = (stage < pp - 1) * (MICRO_BATCHES + 1) + (stage > 0) * MICRO_BATCHES
            assert run["pp_sends"] == sends * STEPS, (key, r["rank"])
            assert run["pp_allreduces"] == (stage in (0, pp - 1)) * STEPS, (key, r["rank"])


@pytest.mark.mpi
def test_saved_activations_gpipe_m_and_1f1b_at_most_p_minus_s(reports):
    for r in reports:
        peaks = r["peaks"]
        for layout in {k.split("_")[0] for k in peaks}:
            dp, pp, tp = (int(n) for n in layout.split(","))
            stage = peaks[f"{layout}_gpipe_m1"]["stage"]
            one = peaks[f"{layout}_gpipe_m1"]["bytes"]
            each = peaks[f"{layout}_gpipe_m2"]["bytes"] - one  # one more micro-batch
            assert each > 0
            m = MICRO_BATCHES
            assert peaks[f"{layout}_gpipe_m{m}"]["bytes"] == one + (m - 1) * each, layout
            held = min(pp - stage, m)
            assert peaks[f"{layout}_1f1b_m{m}"]["bytes"] == one + (held - 1) * each, layout


def test_the_pipeline_section_acts_or_is_refused():
    section = Config.from_dict({"pipeline": {"stages": 2, "partition": "type:Block",
                                             "schedule": "gpipe"}}).pipeline
    assert (section.stages, section.partition, section.schedule) == (2, "type:Block", "gpipe")
    assert Config.from_dict({}).pipeline.schedule == "1f1b"
    for name, read in (("GPipe", "gpipe"), ("1F1B", "1f1b")):  # as the papers spell them
        assert Config.from_dict({"pipeline": {"schedule": name}}).pipeline.schedule == read
    for name, read in (("Parameters", "parameters"), ("UNIFORM", "uniform"),
                       ("Type:Block", "type:Block")):  # any case, as DeepSpeed; the regex kept
        assert Config.from_dict({"pipeline": {"partition": name}}).pipeline.partition == read
    for bad, words in [({"schedule": "interleaved"}, "interleaved schedule is not built"),
                       ({"schedule": "zb"}, "use one of gpipe, 1f1b"),
                       ({"partition": "best"}, "unknown partition method 'best'"),
                       ({"partition": "type:("}, "partition method 'type:\\('"),
                       ({"activation_checkpoint_interval": -1}, "must be >= 0"),
                       ({"pipe_partitioned": True}, "sends each stage's activations whole"),
                       ({"stages": 0}, "must be >= 1"),
                       ({"micro_batches": 4}, "unknown key")]:
        with pytest.raises(ConfigError, match=words):
            Config.from_dict({"pipeline": bad})
    Config.from_dict({"pipeline": {"pipe_partitioned": False, "seed_layers": False}})


@pytest.mark.mpi
def test_zmpi_train_pp(tmp_path):
    config = tmp_path / "pp.json"
    config.write_text('{"gradient_accumulation_steps": 4, "pipeline": {"schedule": "gpipe"}}')
    result = launch_mpi(CLI, 2, ["train", "--config", str(config), "--pp", "2", "--n-layer",
                                 "2", "--d-model", "16", "--n-head", "2", "--seq-len", "16",
                                 "--batch", "8", "--steps", "3", "--out",
                                 str(tmp_path / "run")], timeout=120)
    assert result.returncode == 0, result.describe()
    assert "loss" in result.stdout, result.stdout
    too_many = launch_mpi(CLI, 4, ["train", "--pp", "4", "--n-layer", "1", "--d-model", "16",
                                   "--n-head", "2", "--seq-len", "16", "--steps", "1",
                                   "--out", str(tmp_path / "bad")], timeout=120)
    assert too_many.returncode == 2, too_many.describe()
    assert "cannot split 3 units into 4 pipeline stages" in too_many.stderr + too_many.stdout


class TwoStages:
    """A rank of stage 0 of a 2-stage mesh whose allgather returns `found` (what each rank
    said: None, or its error and its stage), whatever this rank gives."""
    pp, pp_rank = 2, 0

    def __init__(self, found):
        self.comm = self
        self.found = found

    def allgather_object(self, _):
        return self.found


@pytest.mark.parametrize("said, raised, message", [
    (("memory", "", "", "budget exceeded"), "OutOfMemory", "budget exceeded"),
    (("other", "", "", "KeyError: 'x'"), "RuntimeError", "KeyError: 'x'"),
    (("config", "k", "too big", "k: too big"), "ConfigError", "k: too big")])
def test_an_error_on_another_stage_is_raised_here_as_its_kind(said, raised, message):
    """agreed_across_stages, on a rank whose own build succeeded: stage 1's error comes back
    as its kind (only the message travels), naming the stage."""
    from zmpi.engine.checks import agreed_across_stages

    mesh = TwoStages([None, (said, 1)])
    with pytest.raises(Exception) as caught:
        agreed_across_stages(mesh, lambda: "built")
    assert type(caught.value).__name__ == raised
    assert str(caught.value) == f"{message} (on pipeline stage 1 of 2)"
    assert agreed_across_stages(TwoStages([None, None]), lambda: "built") == "built"


ONE_STAGE_FAILS = """
import sys
from zmpi.comm import Comm
from zmpi.config import ConfigError
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

comm = Comm()
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
          "pipeline": {"stages": 2},
          "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 60000,
                                "stage3_prefetch_bucket_size": 10000}}
try:  # stage 0 keeps about 50,000 elements gathered at once, stage 1 (the LM head) 67,520
    Engine(GPT(GPTConfig(256, 16, 2, 2, 64), seed=0), config, comm, mesh=Mesh(comm, pp=2))
    said = "built"
except ConfigError as e:
    said = f"ConfigError {e}"
with open(f"{sys.argv[1]}/rank{comm.rank}.txt", "w") as fh:  # ranks' stdout lines interleave
    fh.write(said)
"""


@pytest.mark.mpi
def test_a_config_error_on_one_pipeline_stage_is_raised_on_every_stage(tmp_path):
    """ZeRO-3's live-parameter limit is checked on each stage's own units: here only stage
    1 exceeds it. Its rank once raised alone and stage 0's waited for ever in the next
    collective across stages; now every rank raises the same error, naming the stage."""
    said = said_by_ranks(tmp_path, ONE_STAGE_FAILS)
    assert said[0] == said[1], said
    assert said[0].startswith("ConfigError zero_optimization.stage3_max_live_parameters: "
                              "zmpi keeps up to 67520 parameter elements"), said
    assert said[0].endswith("(on pipeline stage 1 of 2)"), said


REPLICAS_DIFFER_ON_ONE_STAGE = """
import sys
import numpy as np
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

comm, said = Comm(), []
for change in ("one more", "nan"):  # on world rank 3: stage 1's second data-parallel rank
    model = GPT(GPTConfig(16, 8, 2, 2, 16), seed=0)
    w = dict(model.named_parameters())["units.2.ln1.weight"].data  # a block of stage 1
    if comm.rank == 3:
        w[0] = np.nan if change == "nan" else w[0] + 1
    try:
        Engine(model, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                       "pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}},
               comm).close()
        said.append("built")
    except ValueError as e:
        said.append(str(e))
with open(f"{sys.argv[1]}/rank{comm.rank}.txt", "w") as fh:
    fh.write("\\n".join(said))
"""


@pytest.mark.mpi
def test_replicas_that_differ_on_one_pipeline_stage_are_refused_on_every_stage(tmp_path):
    """dp 2 x pp 2, the second stage's replicas built differently (a changed value, a NaN on
    one of them): the data-parallel check of the initial values fails on that stage only (the
    NaN on one rank only). Those ranks once raised alone and the others waited for ever in
    the next collective; now every rank raises the same one line, naming the stage."""
    said = said_by_ranks(tmp_path, REPLICAS_DIFFER_ON_ONE_STAGE, nprocs=4, timeout=120)
    assert len(set(said)) == 1, said
    assert said[0].split("\n") == [
        "ranks built different initial models: seed the model identically on every rank "
        "(on pipeline stage 1 of 2)",
        "the model's initial parameters contain NaN or inf (on pipeline stage 1 of 2)"], said
