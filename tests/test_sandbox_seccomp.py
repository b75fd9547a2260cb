"""The seccomp system-call filter (agentrl_fast/harness/sandbox/syscall_filter.py) of the sandbox.

Each attack runs under bubblewrap and without isolation, with the filter (it must fail with
``EPERM``, or ``ENOSYS`` for ``clone3``) and, as a control, without it (where it must reach the
kernel, so that the test can fail). The probes use arguments for which the kernel answers with
another error than ``EPERM`` (a missing mount point, a bad file descriptor, a null pointer), so
that they are harmless without the filter and tell the filter's answer from the kernel's.
Without a working bubblewrap the bubblewrap cases skip, or fail under ``CI=true``, as in
tests/test_sandbox_isolation.py. This machine runs them as root, as CI does.
"""

import errno
import json
import platform
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from agentrl_fast.harness import ToolRegistry, parse_tool_calls
from agentrl_fast.harness.sandbox import syscall_filter
from agentrl_fast.harness.sandbox.bwrap import base_python
from agentrl_fast.harness.sandbox import python_tool
from agentrl_fast.harness.sandbox.execute import run_sandboxed_sync
from test_sandbox import call_text, require_bwrap, run_tool

# System-call numbers the C library has no wrapper for: (keyctl, bpf, perf_event_open, clone).
NUMBERS = {"x86_64": (250, 321, 298, 56), "aarch64": (219, 280, 241, 220)}
MACHINE = platform.machine()

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="seccomp is Linux's"),
    pytest.mark.skipif(MACHINE not in NUMBERS, reason=f"no system-call numbers for {MACHINE}")]

PY = [base_python(), "-I", "-S", "-u", "-"]


@pytest.fixture(params=["none", "bwrap"])
def isolation(request) -> str:
    if request.param == "bwrap":
        require_bwrap()
    return request.param


def run(code: str, isolation: str, syscall_filter: bool = True, **options):
    result = run_sandboxed_sync(PY, stdin=textwrap.dedent(code), isolation=isolation,
                                syscall_filter=syscall_filter, timeout=10, **options)
    assert result.syscall_filter is syscall_filter and result.isolation == isolation
    return result


PROBES = """
    import ctypes, json, os, subprocess
    KEYCTL, BPF, PERF_EVENT_OPEN, CLONE = %r
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    CLONE_NEWUSER, SIGCHLD = 0x10000000, 17

    def call(function, *args):
        ctypes.set_errno(0)
        value = function(*(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
        return 0 if value != -1 else ctypes.get_errno()

    def clone_newuser():
        pid = libc.syscall(ctypes.c_long(CLONE), ctypes.c_long(CLONE_NEWUSER | SIGCHLD), 0, 0,
                           0, 0)
        if pid == 0:
            os._exit(0)  # the child, in its new user namespace
        if pid < 0:
            return ctypes.get_errno()
        os.waitpid(pid, 0)
        return 0

    def ptrace_attach():  # PTRACE_ATTACH to our own child
        child = subprocess.Popen(["sleep", "10"])
        try:
            return call(libc.ptrace, 16, child.pid, 0, 0)
        finally:
            child.kill()
            child.wait()

    report = {
        "clone_newuser": clone_newuser(),
        "ptrace_attach": ptrace_attach(),
        "keyctl": call(libc.syscall, KEYCTL, 0, -3, 0),  # KEYCTL_GET_KEYRING_ID, session
        "bpf": call(libc.syscall, BPF, 9999, None, 0),  # an unknown command: EINVAL
        "io_uring_setup": call(libc.syscall, 425, 0, None),  # 0 entries: EINVAL
        "perf_event_open": call(libc.syscall, PERF_EVENT_OPEN, None, 0, -1, -1, 0),  # EFAULT
        "mount": call(libc.mount, b"none", b"/no-such-mount-point", b"tmpfs", 0, None),
        "setns": call(libc.setns, -1, 0),  # EBADF
        "clone3": call(libc.syscall, 435, None, 0),  # a size of 0: EINVAL
        "personality_set": call(libc.personality, 0x0040000),  # ADDR_NO_RANDOMIZE
        "personality_query": call(libc.personality, 0xffffffff),
        "personality_default": call(libc.personality, 0),
        # Last: it changes this process.
        "unshare_newuser": call(libc.unshare, CLONE_NEWUSER),
    }
    print(json.dumps(report))
""" % (NUMBERS.get(MACHINE),)

DENIED = {"clone_newuser", "ptrace_attach", "keyctl", "bpf", "io_uring_setup",
          "perf_event_open", "mount", "setns", "personality_set", "unshare_newuser"}


def probe(isolation: str, syscall_filter: bool) -> dict[str, int]:
    """What each probe got: 0 (success) or the errno."""
    result = run(PROBES, isolation, syscall_filter)
    assert result.ok, result
    return json.loads(result.stdout)


def test_filter_is_on_by_default_and_reported(isolation):
    code = "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])"
    assert run(code, isolation).stdout == "2\n"  # SECCOMP_MODE_FILTER
    assert run(code, isolation, syscall_filter=False).stdout == "0\n"
    assert run_sandboxed_sync(PY, stdin="", isolation=isolation).syscall_filter is True


def test_escape_routes_fail_with_eperm(isolation):
    got = probe(isolation, syscall_filter=True)
    assert {name: got[name] for name in DENIED} == dict.fromkeys(DENIED, errno.EPERM)
    assert got["clone3"] == errno.ENOSYS  # glibc falls back to clone
    assert got["personality_query"] == got["personality_default"] == 0


def test_control_without_the_filter_reaches_the_kernel(isolation):
    """The same probes without the filter: those whose outcome does not depend on the kernel's
    configuration succeed or fail with the kernel's own error, not EPERM."""
    got = probe(isolation, syscall_filter=False)
    for name in ("unshare_newuser", "clone_newuser", "ptrace_attach", "personality_set"):
        assert got[name] == 0, (name, got)
    assert got["mount"] == errno.ENOENT and got["setns"] == errno.EBADF, got
    assert got["clone3"] == errno.EINVAL and got["perf_event_open"] == errno.EFAULT, got


def test_ordinary_programs_still_work(isolation):
    """fork/exec (clone without namespace flags, or clone3 falling back), threads, a forked
    multiprocessing worker and file reads."""
    code = """
        import multiprocessing, os, subprocess, sys, threading
        assert subprocess.run(["/bin/true"]).returncode == 0
        print(subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                             text=True).stdout.strip())
        results = []
        threads = [threading.Thread(target=results.append, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(sorted(results))
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        worker = context.Process(target=queue.put, args=("from a worker",))
        worker.start()
        print(queue.get(timeout=5))
        worker.join()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        print(len(open(sys.executable, "rb").read(4096)), len(os.listdir("/usr")) > 0)
    """
    result = run(code, isolation)
    assert result.ok, result
    assert result.stdout.splitlines() == ["42", "[0, 1, 2, 3]", "from a worker", "7",
                                          "4096 True"]


def test_tool_output_is_unchanged(isolation):
    code = "import sys\nprint(sum(range(10)))\nprint('note', file=sys.stderr)\nsys.exit(2)"
    expected = "45\nnote\n[exit code 2]"
    assert run_tool(code, isolation=isolation) == expected
    assert run_tool(code, isolation=isolation, syscall_filter=False) == expected


def test_foreign_abi_system_calls_kill_the_program(isolation):
    """x32 system-call numbers (and, if gcc is here, 32-bit ``int 0x80``) cannot go around the
    list: libseccomp's bad-architecture action kills the program."""
    if MACHINE != "x86_64":
        pytest.skip("x86_64 only")
    x32 = "import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 39)\nprint('survived')"
    assert run(x32, isolation).signal == signal.SIGSYS
    assert run(x32, isolation, syscall_filter=False).stdout == "survived\n"


def test_int80_is_killed(isolation, tmp_path):
    if MACHINE != "x86_64" or shutil.which("gcc") is None:
        pytest.skip("needs x86_64 and gcc")
    source = tmp_path / "int80.c"
    source.write_text('int main(void) { long r; __asm__ volatile ("int $0x80" : "=a"(r) : '
                      '"a"(20L) : "memory"); return r > 0 ? 0 : 1; }\n')  # i386 getpid
    program = str(tmp_path / "int80")
    subprocess.run(["gcc", "-O1", "-o", program, str(source)], check=True, timeout=60)
    tmp_path.chmod(0o755)  # the sandbox's uid must reach the program
    options = {"isolation": isolation, "read_only_paths": [tmp_path], "timeout": 10}
    if not run_sandboxed_sync([program], syscall_filter=False, **options).ok:
        pytest.skip("this kernel runs no 32-bit system calls (no IA32 emulation)")
    assert run_sandboxed_sync([program], **options).signal == signal.SIGSYS


def test_missing_libseccomp_is_a_clear_error(isolation, monkeypatch):
    registry = ToolRegistry([python_tool(isolation=isolation)])  # built while libseccomp loads
    monkeypatch.setattr(syscall_filter, "LIBSECCOMP", "libseccomp-missing.so.0")
    with pytest.raises(RuntimeError, match=r"libseccomp.*syscall_filter=False"):
        run_sandboxed_sync(PY, stdin="print(1)", isolation=isolation)
    assert run_sandboxed_sync(PY, stdin="print(1)", isolation=isolation,
                              syscall_filter=False).stdout == "1\n"
    # Through the tool: an error result the model reads, not a crash.
    [result] = registry.execute_sync(parse_tool_calls(call_text(("run_python",
                                                                 {"code": "print(1)"}))))
    assert result.error == "tool_exception" and "syscall_filter=False" in result.content
    # A tool built now fails at once, as isolation="bwrap" does without bubblewrap.
    with pytest.raises(RuntimeError, match=r"libseccomp.*syscall_filter=False"):
        python_tool(isolation=isolation)
    python_tool(isolation=isolation, syscall_filter=False)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_syscall_filter_value_raises(bad):
    with pytest.raises(TypeError, match="syscall_filter"):
        python_tool(syscall_filter=bad, isolation="none")
    with pytest.raises(TypeError, match="syscall_filter"):
        run_sandboxed_sync(PY, isolation="none", syscall_filter=bad)


def test_one_home_for_the_list():
    from agentrl_fast.harness.sandbox.launcher import LAUNCHER
    assert repr(syscall_filter.DENIED_SYSCALLS) in LAUNCHER
    assert {"ptrace", "unshare", "setns", "mount", "bpf", "keyctl", "io_uring_setup",
            "perf_event_open", "userfaultfd"} <= set(syscall_filter.DENIED_SYSCALLS)
    assert len(set(syscall_filter.DENIED_SYSCALLS)) == len(syscall_filter.DENIED_SYSCALLS)
