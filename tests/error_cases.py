"""Bad-input cases run in child processes, so that a crash fails its case, not the suite.

A test module declares ``PRELUDE`` (code that sets up names) and ``CASES``:
``name -> (expected exception type name or "NoError", message fragment, statement)``, where a
statement may hold several statements separated by "; ". ``run_cases`` runs them all in one child
that prints one JSON line per case; if the child dies, the case it died at is recorded as a
"Crash" and the rest run in a new child.
"""

import json
import textwrap

import pytest


def child_code(prelude: str, cases: dict, names) -> str:
    """The child's code: the prelude, then each case, printing one JSON line per case."""
    lines = [prelude, "import json as _json", "def _report(name, kind, message):",
             "    print(_json.dumps({'name': name, 'type': kind, 'message': message}), flush=True)"]
    for name in names:
        lines += [
            "try:",
            textwrap.indent(cases[name][2].replace("; ", "\n"), "    "),
            f"    _report({name!r}, 'NoError', '')",
            "except Exception as error:",
            f"    _report({name!r}, type(error).__name__, str(error))",
        ]
    return "\n".join(lines) + "\n"


def parse_reports(stdout: str) -> dict:
    results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["name"]] = record
    return results


def run_cases(run_in_subprocess, prelude: str, cases: dict) -> dict:
    """name -> {"type", "message"} for every case (see the module docstring)."""
    pending, results = list(cases), {}
    while pending:
        completed = run_in_subprocess(child_code(prelude, cases, pending))
        reported = parse_reports(completed.stdout)
        results.update(reported)
        missing = [name for name in pending if name not in reported]
        if not missing:
            break
        crash = {"type": "Crash",
                 "message": f"the child died at this case (exit code {completed.returncode}); "
                            f"stderr:\n{completed.stderr[-4000:]}"}
        if not results:  # died in the prelude: nothing else is meaningful
            return {name: crash for name in cases}
        results[missing[0]] = crash
        pending = missing[1:]
    return results


def assert_outcome(name: str, cases: dict, outcomes: dict) -> None:
    """The case raised the expected exception type with the fragment in its message."""
    expected_type, fragment, _ = cases[name]
    outcome = outcomes[name]
    assert outcome["type"] == expected_type, (
        f"{name}: expected {expected_type} containing {fragment!r}, got {outcome['type']}: "
        f"{outcome['message']}")
    assert fragment in outcome["message"], f"{name}: {fragment!r} not in {outcome['message']!r}"


def assert_clean_exit(run_in_subprocess, prelude: str, cases: dict, names) -> None:
    """The named cases, in one child, raise nothing and the child exits with status 0 (no crash
    at exit either, e.g. from a heap overrun detected at free)."""
    completed = run_in_subprocess(child_code(prelude, cases, names))
    assert completed.returncode == 0, completed.stderr[-4000:]
    outcomes = parse_reports(completed.stdout)
    assert sorted(outcomes) == sorted(names)
    assert all(o["type"] == "NoError" for o in outcomes.values()), outcomes


def bad_input_tests(prelude: str, cases: dict, names=None):
    """``(outcomes, test)`` for a module's case table: the module-scoped ``outcomes`` fixture
    (every case run in child processes) and a test parametrized over ``names`` (default all
    cases) asserting each outcome. Bind both at module level, under the names pytest collects:
    ``outcomes, test_bad_input = bad_input_tests(PRELUDE, CASES)``."""

    @pytest.fixture(scope="module")
    def outcomes(run_in_subprocess):
        return run_cases(run_in_subprocess, prelude, cases)

    @pytest.mark.parametrize("name", list(cases) if names is None else list(names))
    def test(name, outcomes):
        assert_outcome(name, cases, outcomes)

    return outcomes, test


def no_error_tests(prelude: str, cases: dict):
    """``(test_call_returns, test_unvalidated_child)`` for a case table whose ``"NoError"``
    cases include ``unvalidated_*`` garbage: each such case returns (read from the module's
    ``outcomes`` fixture), and all the ``unvalidated_*`` ones in one child exit with status 0.
    Bind both at module level: ``test_call_returns, test_unvalidated_garbage_child_exits_cleanly
    = no_error_tests(PRELUDE, CASES)``."""

    @pytest.mark.parametrize("name", [n for n, c in cases.items() if c[0] == "NoError"])
    def test_call_returns(name, outcomes):
        """The baseline call succeeds; validate=False with garbage does not crash the process."""
        outcome = outcomes[name]
        assert outcome["type"] == "NoError", f"{name}: {outcome['type']}: {outcome['message']}"

    def test_unvalidated_child(run_in_subprocess):
        """All the validate=False garbage cases in one child, which must exit with status 0."""
        assert_clean_exit(run_in_subprocess, prelude, cases,
                          [n for n in cases if n.startswith("unvalidated_")])

    return test_call_returns, test_unvalidated_child
