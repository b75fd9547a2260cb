"""docs/reference/config.md is what tools/config_reference.py writes from the config
dataclasses (issue 44): the page is up to date, every field of the trainer's configs has an
attribute docstring, every main-job value that differs from the library's says why, and the
checker finds a planted field without a docstring."""

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from agentrl_fast.config import DistributedConfig, RolloutConfig, SamplingParams, TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


reference = _tool()


def test_the_page_is_up_to_date():
    assert reference.PAGE.read_text() == reference.render(), (
        "docs/reference/config.md is stale: run python tools/config_reference.py")


@pytest.mark.parametrize("cls", [TrainConfig, RolloutConfig, SamplingParams, DistributedConfig])
def test_every_field_of_the_trainer_configs_has_a_docstring(cls):
    assert cls.__name__ in reference.DOCUMENTED
    source = Path(inspect.getsourcefile(cls)).read_text()
    written = reference.class_sources(source)[cls.__name__].fields
    assert list(written) == [f.name for f in dataclasses.fields(cls)]  # the parser sees them all
    assert reference.missing_docstrings(source, [cls.__name__]) == []


def test_every_main_job_value_that_differs_says_why():
    assert reference.problems() == []
    found, reasons = reference.sections()
    differing = {row.path for s in found for row in s.rows
                 if row.section is None and row.library != row.main}
    # The ten of issue 44 among them, each with its reason on the page.
    assert {f"train.{name}" for name in (
        "lam", "checkpoint_every", "steps", "micro_batch_tokens", "mini_batches", "critic_lr",
        "bootstrap_truncated", "loss_agg_mode", "tis_cap", "recompute_logprobs")} <= differing
    assert differing <= set(reasons)


PLANTED = '''
from dataclasses import dataclass, field

@dataclass
class Planted:
    """A class docstring is not a field's."""

    documented: int = 1
    """Has one."""
    undocumented: float = 0.5  # a comment is not a docstring
    nested: list = field(default_factory=list)
    """Has one too."""
    empty: str = ""
    """ """

class NotADataclass:
    plain: int = 0
'''


def test_the_checker_finds_a_planted_field_without_a_docstring():
    assert reference.missing_docstrings(PLANTED) == ["Planted.undocumented", "Planted.empty"]
    assert reference.missing_docstrings(PLANTED, ["Planted"]) == ["Planted.undocumented",
                                                                  "Planted.empty"]
    fields = reference.class_sources(PLANTED)["Planted"].fields
    assert fields["documented"].docstring == "Has one."
    assert fields["undocumented"].comment == "a comment is not a docstring"  # the fallback
    assert fields["nested"].annotation == "list"


def test_reasons_are_the_comments_of_the_main_job_functions():
    source = '''
from dataclasses import dataclass, field

def _main_job_train():
    return TrainConfig(
        steps=3, seed=1,
        # Why lam: the comment above it.
        lam=1.0,
        gamma=0.9,  # why gamma, on its line
        rollout=RolloutConfig(
            # Why the budget,
            # over two lines.
            context_budget=200))

@dataclass
class RunConfig:
    train: TrainConfig = field(default_factory=_main_job_train)
'''
    assert reference.main_job_reasons(source) == {
        "train.lam": "Why lam: the comment above it.",
        "train.gamma": "why gamma, on its line",
        "train.rollout.context_budget": "Why the budget, over two lines."}


def test_check_exits_1_on_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "config.md"
    monkeypatch.setattr(reference, "PAGE", page)
    page.write_text(reference.render())
    assert reference.main(["--check"]) == 0
    page.write_text(reference.render().replace("| `train.lam` |", "| `train.lambda` |"))
    assert reference.main(["--check"]) == 1
    assert "config.md is stale" in capsys.readouterr().err
    assert reference.main([]) == 0 and reference.main(["--check"]) == 0  # rewritten
