"""Running code the model wrote: a child process, isolated by bubblewrap, under a timeout and
resource limits.

:func:`run_sandboxed` runs a program in a child process, never in the trainer's process, and
:func:`python_tool` is the ``run_python`` tool built on it. The code is handed to the child as
data (on its stdin); the harness never evaluates a tool argument as code.

Isolation (``isolation=``, :data:`ISOLATIONS`; every :class:`SandboxResult` records which ran):

- ``"bwrap"``: bubblewrap (:mod:`.bwrap`): new user, PID, network, IPC, UTS and cgroup
  namespaces; a read-only view of only the system directories and the base interpreter's prefix;
  a fresh size-capped ``tmpfs`` as working directory and ``/tmp``; its own ``/proc``; no network
  at all. As root, the program runs as a fresh unprivileged uid under ``RLIMIT_NPROC``
  (``max_processes``). When bwrap dies (our kill at the timeout, a cancellation, the trainer's
  death: ``--die-with-parent``) its PID namespace dies, and every process of the run with it,
  ``setsid()`` or not. Raises ``RuntimeError`` when bubblewrap cannot run here
  (:func:`bwrap_problem`).
- ``"none"``: the resource limits below only, in the trainer's filesystem and network.
- ``"auto"`` (default): ``"bwrap"`` when it works here, else ``"none"`` with one
  ``RuntimeWarning`` per process naming what is missing.

What the child gets in both:

- its own session and process group (``start_new_session=True``); on a timeout, when the
  awaiting task is cancelled (a tool timeout in :class:`~.tools.ToolRegistry`), and after the
  program exits, the whole group is sent ``SIGKILL``;
- resource limits set in the child by a small launcher (:data:`.launcher.LAUNCHER`, run by
  ``python -I -S``, which imports neither ``agentrl_fast`` nor torch) before it ``exec``\\ s the
  program, so no ``preexec_fn`` runs in the trainer (it is not thread-safe): ``RLIMIT_AS``
  (address space, ``memory_mb``, per process), ``RLIMIT_CPU`` (``cpu_seconds``; the hard limit
  is one second above the soft one, so the program first gets ``SIGXCPU``), ``RLIMIT_FSIZE``
  (:data:`.launcher.FILE_SIZE_LIMIT_MB`) and ``RLIMIT_CORE`` 0;
- a minimal environment (:func:`default_env`: ``PATH``, ``LANG=C.UTF-8``, ``PYTHONHASHSEED=0``,
  one BLAS thread) unless ``env`` is given: nothing else of the trainer's environment (API keys,
  tokens) reaches it;
- bounded output: stdout and stderr are read concurrently and at most ``max_output_bytes`` of
  each is kept; the rest is read and discarded, so a program printing forever neither blocks nor
  grows the trainer's memory;
- a seccomp system-call filter (``syscall_filter=True``, :mod:`.syscall_filter`, loaded through
  libseccomp by the launcher just before the ``exec``): ``EPERM`` for ``ptrace``, namespaces
  (``unshare``, ``setns``, ``clone`` with a namespace flag), mounts, ``bpf``, ``io_uring``,
  ``keyctl``, ``perf_event_open`` and other calls no program here needs;
- a control group of its own where the host lets us make one (``cgroup="auto"``,
  :mod:`.cgroups`): ``memory_mb`` bounds the memory of all its processes together, scratch
  ``tmpfs`` pages included (the kernel's OOM killer ends the call: ``"memory_limit"``),
  ``max_processes`` their number, and at the end every process in it is killed.

The threat model (what this protects, what it does not, what production should add):
docs/security.md.
"""

from __future__ import annotations

import asyncio
import functools
import math
import numbers
import os
import signal as _signal
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agentrl_fast.harness.sandbox import cgroups as _cgroups
from agentrl_fast.harness.sandbox import syscall_filter as _syscall_filter
from agentrl_fast.harness.sandbox.bwrap import base_python, bwrap_command, bwrap_path, sandbox_uid
from agentrl_fast.harness.sandbox.launcher import inner_command
from agentrl_fast.harness.tools import Tool, tool

ISOLATIONS = ("auto", "bwrap", "none")
"""``isolation`` values: ``"bwrap"`` (bubblewrap, or an error), ``"none"`` (resource limits
only), ``"auto"`` (bubblewrap when it works here, else ``"none"`` with one warning)."""

CGROUPS = ("auto", "required", "off")
"""``cgroup`` values: a control group per call (:mod:`.cgroups`) when this host lets us make one
(``"auto"``), or an error (``"required"``), or none (``"off"``)."""

MAX_PROCESSES = 64
"""Processes (and threads) a sandboxed program may have at once: ``RLIMIT_NPROC`` under
bubblewrap (without isolation it would count all of the user's processes, and root ignores it)
and the call's ``pids.max`` where it has a control group."""

_KILL_GRACE_S = 2.0  # waiting for a killed group to be reaped and its pipes to close

@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended. No wall-clock time is recorded (rollouts stay
    deterministic).

    ``exit_code``: the exit status, or ``None`` when a signal ended it; ``signal``: that signal's
    number, else ``None`` (under bubblewrap, which reports a signal N as exit status 128 + N, a
    program's own exit status 129-192 reads as that signal). ``stdout``/``stderr``: the first
    ``max_output_bytes`` of each, decoded as UTF-8 (``errors="replace"``); ``truncated``: either
    stream was longer. ``timed_out``: the
    wall-clock timeout fired and the group was killed. ``killed_reason``: ``"timeout"``,
    ``"cpu_limit"`` (``SIGXCPU``, or a ``SIGKILL`` not sent by us: the hard CPU limit, or
    rarely the kernel's OOM killer), ``"memory_limit"`` (best effort: the program failed with a
    memory-error message such as ``MemoryError`` on stderr, or died of ``SIGSEGV``/``SIGBUS``/
    ``SIGABRT``, what an allocation failure in C code under ``RLIMIT_AS`` usually becomes; a
    genuine crash is labelled the same), or ``None``. ``isolation``: what the program ran
    under, ``"bwrap"`` or ``"none"`` (resource limits only); ``syscall_filter``: whether the
    seccomp filter (:mod:`.syscall_filter`) was on; ``cgroup``: whether the call had its own
    control group (:mod:`.cgroups`), whose out-of-memory kills read ``"memory_limit"``.
    """

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    killed_reason: str | None = None
    isolation: str = "none"
    syscall_filter: bool = False
    cgroup: bool = False

    @property
    def ok(self) -> bool:
        """The program exited with status 0."""
        return self.exit_code == 0


_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"out of memory", b"bad_alloc")
_MEMORY_SIGNALS = (_signal.SIGSEGV, _signal.SIGBUS, _signal.SIGABRT)


def _killed_reason(timed_out: bool, exit_code: int | None, signum: int | None,
                   stderr: bytes, oom_killed: bool) -> str | None:
    if timed_out:
        return "timeout"
    if oom_killed:
        return "memory_limit"
    if signum in (_signal.SIGXCPU, _signal.SIGKILL):
        return "cpu_limit"
    if signum in _MEMORY_SIGNALS:
        return "memory_limit"
    if exit_code not in (0, None) and any(marker in stderr for marker in _MEMORY_MARKERS):
        return "memory_limit"
    return None


def _check_number(name: str, value, *, minimum: float, integer: bool = False,
                  strict: bool = False) -> None:
    """``value`` must be a (finite) real, or an int if ``integer``, that is ``>= minimum``
    (``> minimum`` if ``strict``)."""
    kinds = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an int" if integer else "a number"
        raise TypeError(f"run_sandboxed: {name} must be {kind}, got {type(value).__name__}")
    if (not integer and not math.isfinite(value)) or value < minimum or (
            strict and value == minimum):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"run_sandboxed: {name} must be finite and {bound}, got {value!r}; "
                         f"pass a value {bound}")


def _validate(argv, stdin, timeout, memory_mb, cpu_seconds, max_output_bytes, cwd, env,
              isolation="none", max_processes=1, read_only_paths=(), syscall_filter=False,
              cgroup="off", cpus=None):
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence):
        raise TypeError(f"run_sandboxed: argv must be a sequence of str such as "
                        f"['python', '-c', 'print(1)'], got {type(argv).__name__}")
    if len(argv) == 0:
        raise ValueError("run_sandboxed: argv is empty; pass the program and its arguments")
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise TypeError(f"run_sandboxed: argv[{i}] must be a str, got {type(arg).__name__}")
        if "\0" in arg:
            raise ValueError(f"run_sandboxed: argv[{i}] contains a NUL character; remove it")
    if not argv[0]:
        raise ValueError("run_sandboxed: argv[0] (the program) is an empty string")
    if not isinstance(stdin, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"run_sandboxed: stdin must be str or bytes, got {type(stdin).__name__}")
    _check_number("timeout", timeout, minimum=0, strict=True)
    _check_number("memory_mb", memory_mb, minimum=32, integer=True)
    if cpu_seconds is not None:
        _check_number("cpu_seconds", cpu_seconds, minimum=0, strict=True)
    _check_number("max_output_bytes", max_output_bytes, minimum=0, integer=True)
    if cwd is not None:
        if not isinstance(cwd, (str, os.PathLike)):
            raise TypeError(f"run_sandboxed: cwd must be a path or None, got {type(cwd).__name__}")
        if not os.path.isdir(cwd):
            raise ValueError(f"run_sandboxed: cwd {os.fspath(cwd)!r} is not a directory")
    if env is not None:
        if not isinstance(env, Mapping):
            raise TypeError(f"run_sandboxed: env must be a mapping of str to str or None, "
                            f"got {type(env).__name__}")
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"run_sandboxed: env must map str to str, got {key!r}: "
                                f"{type(value).__name__}")
    if isolation not in ISOLATIONS:
        raise ValueError(f"run_sandboxed: isolation must be one of {ISOLATIONS}, got "
                         f"{isolation!r}")
    _check_number("max_processes", max_processes, minimum=1, integer=True)
    if isinstance(read_only_paths, (str, bytes, os.PathLike)) or not all(
            isinstance(path, (str, os.PathLike)) for path in read_only_paths):
        raise TypeError("run_sandboxed: read_only_paths must be a sequence of paths")
    if not isinstance(syscall_filter, bool):
        raise TypeError(f"run_sandboxed: syscall_filter must be a bool (True: the seccomp "
                        f"filter), got {type(syscall_filter).__name__}")
    if cgroup not in CGROUPS:
        raise ValueError(f"run_sandboxed: cgroup must be one of {CGROUPS}, got {cgroup!r}")
    if cpus is not None:
        _check_number("cpus", cpus, minimum=0.01)
        if cgroup == "off":
            raise ValueError("run_sandboxed: cpus needs the call's control group; got "
                             "cgroup='off'")


def _call_group(cgroup: str, memory_mb: int, max_processes: int,
                cpus: float | None) -> _cgroups.CallGroup | None:
    """The call's control group, or ``None`` (``"off"``, or ``"auto"`` where none can be made
    and no ``cpus`` bound asks for one)."""
    if cgroup == "off":
        return None
    problem = _cgroups.cgroup_problem()
    if problem is None:
        try:
            return _cgroups.CallGroup.create(_cgroups.hierarchy(), memory_mb << 20,
                                             max_processes, cpus)
        except OSError as error:
            problem = f"making the call's group failed: {error}"
    if cgroup == "required" or cpus is not None:
        what = "cgroup='required'" if cpus is None else f"cpus={cpus!r}"
        raise RuntimeError(f"run_sandboxed: {what} needs a control group per call, but "
                           f"{problem} (docs/security.md)")
    return None


def default_env() -> dict[str, str]:
    """The environment a sandboxed program gets unless ``env`` is given: ``PATH`` (the
    trainer's), ``LANG=C.UTF-8``, ``PYTHONHASHSEED=0`` and one thread for OpenMP/OpenBLAS/MKL
    (a BLAS sizing its thread pool to the machine would spend the memory limit on stacks, and
    one thread keeps results reproducible); nothing else."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


@functools.lru_cache(maxsize=None)
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate runs on this machine, or ``None`` when it can. Checked once
    per process by running a real sandbox (bwrap may be installed where namespaces are not
    allowed, as in many containers)."""
    if sys.platform != "linux":
        return "bubblewrap needs Linux"
    bwrap = bwrap_path()
    if bwrap is None:
        return "the bwrap executable (package bubblewrap) is not on PATH"
    status_read, status_write = os.pipe()
    try:
        uid = sandbox_uid()
        inner = inner_command(status_write, 256, 10, MAX_PROCESSES, uid, False,
                               [base_python(), "-I", "-S", "-c", "print('ok')"])
        result = subprocess.run(bwrap_command(bwrap, inner, uid=uid, cwd=None),
                                pass_fds=(status_write,), capture_output=True, timeout=30,
                                stdin=subprocess.DEVNULL, env=default_env())
    except (OSError, subprocess.SubprocessError) as error:
        return f"running {bwrap} failed: {error}"
    finally:
        os.close(status_write)
        with os.fdopen(status_read, "rb") as status:
            report = status.read()[1:].replace(b"\0", b" ").decode(errors="replace")
    if result.stdout != b"ok\n":
        lines = (report or result.stderr.decode(errors="replace")).strip().splitlines()
        return (f"{bwrap} could not start a sandbox: "
                f"{lines[-1] if lines else f'exit code {result.returncode}'}")
    return None


_warned_unisolated = False


def _isolation_for(isolation: str) -> str:
    """What ``isolation`` means here and now: ``"bwrap"`` or ``"none"``."""
    global _warned_unisolated
    if isolation == "none":
        return "none"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if isolation == "bwrap":
        raise RuntimeError(f"run_sandboxed: isolation='bwrap' but bubblewrap cannot isolate "
                           f"runs here: {problem}. Install it (apt-get install bubblewrap; "
                           f"tools/setup_test_env.sh does) or pass isolation='auto' or 'none'")
    if not _warned_unisolated:
        _warned_unisolated = True
        warnings.warn(f"run_sandboxed: isolation='auto' runs model-written code WITHOUT "
                      f"isolation because {problem}: only resource limits apply, and the code "
                      f"can read the trainer's files, use the network and outlive its call. "
                      f"Install bubblewrap (apt-get install bubblewrap), or pass "
                      f"isolation='none' to choose this knowingly (docs/security.md).",
                      RuntimeWarning, stacklevel=3)
    return "none"


class _Collector(asyncio.SubprocessProtocol):
    """Keeps the first ``limit`` bytes of stdout and of stderr and drops the rest as it arrives
    (so the child never blocks on a full pipe); ``exited`` resolves when the program exits,
    ``finished`` when it has exited and all its pipes are closed."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop):
        self.limit = limit
        self.output = {1: bytearray(), 2: bytearray()}
        self.truncated = False
        self.exited = loop.create_future()
        self.finished = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        kept = self.output[fd]
        room = self.limit - len(kept)
        if len(data) > room:
            self.truncated = True
            data = data[:max(room, 0)]
        kept += data

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.finished.done():
            self.finished.set_result(None)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _launch_failure(status_fd: int, argv: Sequence[str], timed_out: bool,
                    stderr: bytes) -> BaseException | None:
    """The launcher's error report (it could not set a limit or exec the program), or the
    sandbox's when the launcher never ran (bwrap could not set it up), if any."""
    try:
        report = os.read(status_fd, 65536)
    except BlockingIOError:
        report = b""
    if not report.startswith(b"+"):
        if timed_out:
            return None
        reason = stderr.decode(errors="replace").strip() or "no message"
        return RuntimeError(f"run_sandboxed: the sandbox did not start: {reason}")
    report = report[1:]
    if not report:
        return None
    kind, number, message = (report.decode(errors="replace").split("\0", 2) + ["", ""])[:3]
    text = f"run_sandboxed: cannot run {argv[0]!r}: {kind}: {message}"
    if number.isdigit() and int(number):
        return OSError(int(number), text)  # FileNotFoundError, PermissionError, ...
    return RuntimeError(text)


def _command(mode: str, status_fd: int, argv: Sequence[str], memory_mb: int, cpu: int,
             max_processes: int, cwd, read_only_paths, syscall_filter: bool) -> list[str]:
    if mode == "none":
        return inner_command(status_fd, memory_mb, cpu, -1, -1, syscall_filter, argv)
    uid = sandbox_uid()
    inner = inner_command(status_fd, memory_mb, cpu, max_processes, uid, syscall_filter, argv)
    return bwrap_command(bwrap_path(), inner, uid=uid, cwd=None if cwd is None else os.fspath(cwd),
                         read_only_paths=[os.fspath(path) for path in read_only_paths])


def _exit_status(mode: str, returncode: int | None) -> tuple[int | None, int | None]:
    """``(exit_code, signal)``. bwrap reports a program killed by signal N as exit code 128 + N
    (its own death by our SIGKILL stays a negative return code)."""
    if returncode is not None and returncode < 0:
        return None, -returncode
    if mode == "bwrap" and returncode is not None and 128 < returncode < 128 + 65:
        return None, returncode - 128
    return returncode, None


async def run_sandboxed(argv: Sequence[str], *, stdin: str | bytes = b"", timeout: float = 10.0,
                        memory_mb: int = 512, cpu_seconds: float | None = None,
                        max_output_bytes: int = 16384, cwd: str | os.PathLike | None = None,
                        env: Mapping[str, str] | None = None, isolation: str = "auto",
                        max_processes: int = MAX_PROCESSES,
                        read_only_paths: Sequence[str | os.PathLike] = (),
                        syscall_filter: bool = True, cgroup: str = "auto",
                        cpus: float | None = None) -> SandboxResult:
    """Run ``argv`` in a child process under a timeout and resource limits, isolated with
    bubblewrap when ``isolation`` says so (see the module).

    ``stdin`` (str, UTF-8 encoded, or bytes) is written to the program's stdin, which is then
    closed. ``timeout``: wall-clock seconds before the run is killed; ``memory_mb``:
    address-space limit per process (``RLIMIT_AS``, at least 32; an interpreter needs some of it
    just to start); ``cpu_seconds``: CPU-time limit (``RLIMIT_CPU``, rounded up to whole
    seconds; default ``ceil(timeout)``); ``max_output_bytes``: bytes kept of stdout and of stderr
    each; ``env``: the program's whole environment (default :func:`default_env`). An ``argv[0]``
    without a slash is looked up on the child's ``PATH``. ``isolation``: one of
    :data:`ISOLATIONS` (default ``"auto"``); ``max_processes``: ``RLIMIT_NPROC`` inside the
    sandbox. ``cwd``: the working directory; under bubblewrap it is bound read-only (default: the
    sandbox's fresh ``/tmp``). ``read_only_paths``: more host paths bound read-only under
    bubblewrap (a program outside the system directories and the interpreter's prefix must be
    in one to run). ``syscall_filter``: load the seccomp filter (:mod:`.syscall_filter`; needs
    libseccomp, else the run fails to start with a ``RuntimeError`` saying so), in either
    isolation. ``cgroup``: one of :data:`CGROUPS` (default ``"auto"``): the call's own control
    group, where ``memory_mb`` and ``max_processes`` bound all its processes together. ``cpus``:
    CPU seconds per wall-clock second for all of them (e.g. 0.5; needs the group's ``cpu``
    controller, else ``RuntimeError``); default unbounded.

    Everything the program does is reported in the :class:`SandboxResult`; this raises only for
    bad arguments (``TypeError``/``ValueError`` naming the argument) and when the program cannot
    be started at all (``OSError`` such as ``FileNotFoundError``, or ``RuntimeError``, also when
    ``isolation="bwrap"`` and bubblewrap cannot run here). If the awaiting task is cancelled,
    the run is killed before ``CancelledError`` propagates.
    """
    _validate(argv, stdin, timeout, memory_mb, cpu_seconds, max_output_bytes, cwd, env,
              isolation, max_processes, read_only_paths, syscall_filter, cgroup, cpus)
    mode = _isolation_for(isolation)
    group = _call_group(cgroup, memory_mb, max_processes, cpus)
    data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    cpu = math.ceil(cpu_seconds if cpu_seconds is not None else timeout)
    status_read, status_write = os.pipe()
    os.set_blocking(status_read, False)
    loop = asyncio.get_running_loop()
    timed_out = False
    try:
        try:
            command = _command(mode, status_write, argv, memory_mb, cpu, max_processes, cwd,
                               read_only_paths, syscall_filter)
            command = group.wrap(command) if group is not None else command
            transport, collector = await loop.subprocess_exec(
                lambda: _Collector(max_output_bytes, loop), *command, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=(status_write,), cwd=cwd if mode == "none" else None,
                env=dict(env) if env is not None else default_env())
        finally:
            os.close(status_write)
        try:
            stdin_pipe = transport.get_pipe_transport(0)
            if data:
                stdin_pipe.write(data)  # buffered by the loop; a child that never reads is fine
            stdin_pipe.write_eof()
            # Wait for the program itself, not for its pipes: a forked child may hold them.
            done, _ = await asyncio.wait({collector.exited}, timeout=timeout)
            timed_out = not done
        finally:
            # Also after a normal exit or a cancellation: nothing of the run may outlive us.
            # Under bubblewrap, bwrap's death kills its PID namespace (--die-with-parent), and
            # with it every process of the run, setsid() or not.
            _kill_group(transport.get_pid())
            if group is not None:  # its processes, setsid() or not, bubblewrap or not
                group.kill()
            try:
                # The exit status and the pipes' last bytes; then close what is left (pipes held
                # by a program that escaped the group with setsid()).
                await asyncio.wait({collector.finished}, timeout=_KILL_GRACE_S)
            finally:
                transport.close()
        failure = _launch_failure(status_read, argv, timed_out, bytes(collector.output[2]))
    finally:
        os.close(status_read)
        oom_killed = group is not None and group.oom_killed()
        if group is not None:
            group.remove()
    if failure is not None:
        raise failure
    exit_code, signum = _exit_status(mode, transport.get_returncode())
    out, err = (bytes(collector.output[fd]) for fd in (1, 2))
    return SandboxResult(exit_code=exit_code, signal=signum,
                         stdout=out.decode("utf-8", errors="replace"),
                         stderr=err.decode("utf-8", errors="replace"), timed_out=timed_out,
                         truncated=collector.truncated,
                         killed_reason=_killed_reason(timed_out, exit_code, signum, err,
                                                      oom_killed),
                         isolation=mode, syscall_filter=syscall_filter, cgroup=group is not None)


def run_sandboxed_sync(argv: Sequence[str], **kwargs) -> SandboxResult:
    """:func:`run_sandboxed` from synchronous code (not from inside a running event loop)."""
    return asyncio.run(run_sandboxed(argv, **kwargs))


def _status_lines(result: SandboxResult, *, timeout: float, cpu_seconds: int,
                  memory_mb: int) -> list[str]:
    lines = []
    if result.killed_reason == "timeout":
        lines.append(f"[killed: timeout after {timeout:g} s]")
    elif result.killed_reason == "cpu_limit":
        lines.append(f"[killed: CPU time limit {cpu_seconds} s]")
    elif result.killed_reason == "memory_limit":
        if result.signal is not None:
            lines.append(f"[killed: memory limit {memory_mb} MB]")
        elif result.exit_code == 0:  # the call's group killed one of its other processes
            lines.append(f"[a process was killed: memory limit {memory_mb} MB]")
        else:
            lines.append(f"[exit code {result.exit_code}: memory limit {memory_mb} MB]")
    elif result.signal is not None:
        try:
            name = _signal.Signals(result.signal).name
        except ValueError:
            name = str(result.signal)
        lines.append(f"[killed by signal {name}]")
    elif result.exit_code != 0:
        lines.append(f"[exit code {result.exit_code}]")
    if result.truncated:
        lines.append("[output truncated]")
    return lines


def format_result(result: SandboxResult, *, timeout: float, cpu_seconds: int,
                  memory_mb: int) -> str:
    """The text :func:`python_tool` returns: stdout, then stderr, then status lines."""
    parts = [text if text.endswith("\n") else text + "\n"
             for text in (result.stdout, result.stderr) if text]
    parts += [line + "\n" for line in _status_lines(result, timeout=timeout,
                                                     cpu_seconds=cpu_seconds,
                                                     memory_mb=memory_mb)]
    return "".join(parts).rstrip("\n") if parts else "[no output]"


def python_tool(*, name: str = "run_python", timeout: float = 10.0, memory_mb: int = 512,
                cpu_seconds: float | None = None, max_output_bytes: int = 8192,
                isolation: str = "auto", max_processes: int = MAX_PROCESSES,
                site_packages: bool = False, syscall_filter: bool = True,
                cgroup: str = "auto", cpus: float | None = None) -> Tool:
    """A :class:`~.tools.Tool` (``code: str``) running the model's Python in :func:`run_sandboxed`.

    The code goes to the base interpreter's ``python -I -S -u -`` on stdin (``-u``: what was
    printed before a kill is kept; ``-I -S``: no environment variables, no site-packages, only
    the standard library). ``site_packages=True`` runs ``python -I -u -`` instead, the trainer's
    interpreter with its installed packages (its virtual environment, if any, bound read-only
    under bubblewrap). ``isolation``, ``max_processes``, ``syscall_filter``, ``cgroup`` and
    ``cpus``: as :func:`run_sandboxed`.
    The tool returns one text: the program's stdout, then its stderr (if any), then status lines
    as they apply: ``[exit code 1]``, ``[killed: timeout after 2 s]``,
    ``[killed: CPU time limit 2 s]``, ``[killed: memory limit 256 MB]`` (or
    ``[exit code 1: memory limit 256 MB]`` after a ``MemoryError``),
    ``[killed by signal SIGTERM]``, ``[output truncated]``; ``[no output]`` when all is empty.
    ``max_output_bytes`` applies to stdout and stderr each.

    A program that fails, however it fails (traceback, timeout, limit), is a normal result
    (``ToolResult.error is None``; the model reads what happened and the episode continues).
    Only a failure to start the sandbox raises (``tool_exception`` in the registry: an error
    result the model reads). The Tool's own timeout is the sandbox's plus 5 s, so the sandbox's
    kill, not the registry's, ends a runaway program and its message is the one the model reads.
    ``isolation="bwrap"`` raises ``RuntimeError`` here, at construction, when bubblewrap cannot
    run on this machine (and ``"auto"`` warns here), as do ``syscall_filter=True`` when
    libseccomp cannot be loaded and ``cgroup="required"`` when no group can be made.
    """
    # Check the limits and the isolation now, not at the model's first call.
    _validate([sys.executable], b"", timeout, memory_mb, cpu_seconds, max_output_bytes, None,
              None, isolation, max_processes, (), syscall_filter, cgroup, cpus)
    if cgroup == "required" or cpus is not None:  # raises now when no group can be made
        _call_group(cgroup, memory_mb, max_processes, cpus).remove()
    if not isinstance(site_packages, bool):
        raise TypeError(f"python_tool: site_packages must be a bool, got "
                        f"{type(site_packages).__name__}")
    _isolation_for(isolation)
    problem = _syscall_filter.libseccomp_problem() if syscall_filter else None
    if problem is not None:
        raise RuntimeError(f"python_tool: the system-call filter needs libseccomp: {problem}. "
                           f"Install it (apt-get install libseccomp2) or pass "
                           f"syscall_filter=False")
    cpu = math.ceil(cpu_seconds if cpu_seconds is not None else timeout)
    argv = ([sys.executable, "-I", "-u", "-"] if site_packages
            else [base_python(), "-I", "-S", "-u", "-"])
    options = {"timeout": timeout, "memory_mb": memory_mb, "cpu_seconds": cpu_seconds,
               "max_output_bytes": max_output_bytes, "isolation": isolation,
               "max_processes": max_processes, "syscall_filter": syscall_filter,
               "cgroup": cgroup, "cpus": cpus,
               "read_only_paths": [sys.prefix] if site_packages else []}

    async def run_python(code: str) -> str:
        """Run a Python program in a sandbox and return its output.

        Args:
            code: The Python source to run.
        """
        result = await run_sandboxed(argv, stdin=code, **options)
        return format_result(result, timeout=timeout, cpu_seconds=cpu, memory_mb=memory_mb)

    return tool(run_python, name=name, timeout=timeout + 5.0)
