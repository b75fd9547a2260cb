"""bench/results/README.md is the index bench/results_index.py makes from the result files:
it is current, it lists every file, and a change to a recorded file makes ``--check`` fail."""

import importlib.util
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _load_script():
    """bench/results_index.py as a module (bench/ is not a package; run in-process: fast)."""
    spec = importlib.util.spec_from_file_location("results_index",
                                                  ROOT / "bench" / "results_index.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


index = _load_script()


def test_the_index_is_current():
    problems = index.check(RESULTS)
    assert not problems, ("bench/results/README.md is stale or a record lacks its header; "
                          "run `python bench/results_index.py`:\n" + "\n".join(problems))


def test_the_index_lists_every_file_and_links_only_files_that_exist():
    text = (RESULTS / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)\s]+)\)", text))
    assert all((RESULTS / link).is_file() for link in links), links
    assert set(index.result_files(RESULTS)) <= links
    main_job = text.split("## `main_job.md`", 1)[1].split("\n## ", 1)[0]
    assert "seeds 0-4" in main_job and "mean 0.995" in main_job


def _copy(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    assert index.main(["--check", "--results", str(results)]) == 0
    return results


def test_a_planted_change_makes_check_fail_and_a_rewrite_fixes_it(tmp_path, capsys):
    results = _copy(tmp_path)
    row = ('{"op": "gae", "provider": "verl-loop", "shape": "planted", "dtype": "float32", '
           '"device": "cpu", "time_ms": 1.0, "ratio": 99.0, "commit": "abcdef1", '
           '"date": "2099-01-01"}\n')
    with open(results / "gae.jsonl", "a") as f:
        f.write(row)
    assert index.main(["--check", "--results", str(results)]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and "+" in err and "abcdef1" in err
    assert index.main(["--results", str(results)]) == 0
    assert index.main(["--check", "--results", str(results)]) == 0


def test_a_file_no_record_owns_and_a_record_without_a_summary_fail(tmp_path, capsys):
    results = _copy(tmp_path)
    (results / "stray.log").write_text("raw output\n")
    text = (results / "verl.md").read_text()
    (results / "verl.md").write_text(text.replace("Summary:", "Summery:", 1))
    assert index.main(["--check", "--results", str(results)]) == 1
    err = capsys.readouterr().err
    assert "stray.log: no record owns it" in err
    assert "verl.md: its header lacks a 'Summary:' paragraph" in err


def test_a_main_job_summary_that_disagrees_with_its_runs_fails(tmp_path, capsys):
    results = _copy(tmp_path)
    text = (results / "main_job.md").read_text()
    (results / "main_job.md").write_text(text.replace("0.995", "0.825"))
    assert index.main(["--check", "--results", str(results)]) == 1
    assert "does not state PPO's mean 0.995" in capsys.readouterr().err


def test_a_benchmark_rewriting_its_record_keeps_the_header(tmp_path):
    """bench/common.write_record, which the benchmarks write their .md records with: the
    replaced file's Summary paragraph is kept, a Command and a date/commit line are added, so
    a rerun leaves a header the index accepts."""
    sys.path.insert(0, str(ROOT / "bench"))
    import common

    record = tmp_path / "proxy.md"
    shutil.copy(RESULTS / "proxy.md", record)
    before = index.parse_header(record.read_text())
    common.write_record(record, "# OpenAI proxy overhead\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n",
                        command="python bench/bench_proxy.py --out x.md")
    after = index.parse_header(record.read_text())
    assert after.summary == before.summary and after.title == before.title
    assert after.command == "`python bench/bench_proxy.py --out x.md`" and after.date
    assert index.header_problems("proxy.md", after) == []
    assert "| 1 | 2 |" in record.read_text()
