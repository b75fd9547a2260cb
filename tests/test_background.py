"""The test suite's background children (tests/background.py): lowest CPU priority, pytest's own
session (so nice applies: a new session is a new scheduler autogroup), a group killed whole."""

import os
import sys
import time

import pytest

from background import Background, Command

PROBE = ("import os, sys; print(os.nice(0), os.getsid(0), os.getpgid(0) == os.getpid()); "
         "sys.stdout.flush(); sys.stderr.write('err')")


def test_a_child_runs_niced_in_this_session_in_a_group_of_its_own():
    child = Background.start(Command([sys.executable, "-c", PROBE], cwd=os.getcwd(), timeout=60))
    result = child.result()
    assert result.returncode == 0, result.stderr
    niceness, session, leads_group = result.stdout.split()
    assert int(niceness) == 19
    assert int(session) == os.getsid(0)  # same session: same autogroup as pytest
    assert leads_group == "True" and result.stderr == "err"


def test_a_timeout_fails_the_test_and_kills_the_whole_group():
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)")
    child = Background.start(Command([sys.executable, "-c", code], cwd=os.getcwd(), timeout=3))
    with pytest.raises(pytest.fail.Exception, match="did not finish within 3 s of waiting"):
        child.result()
    assert child.process.poll() is not None
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessLookupError):  # the grandchild went with the group
        while time.monotonic() < deadline:
            os.killpg(child.process.pid, 0)
            time.sleep(0.05)
