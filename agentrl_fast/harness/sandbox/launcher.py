"""The launcher: the small program that starts every sandboxed run inside the child (and
inside bubblewrap, when it isolates), run by the base interpreter as ``python -I -S`` so that it
imports neither ``agentrl_fast`` nor torch; it sets the limits, drops the uid, loads the
system-call filter (:mod:`.syscall_filter`) and ``exec``\\ s the program. No ``preexec_fn`` runs
in the (multi-threaded) trainer."""

from collections.abc import Sequence

from agentrl_fast.harness.sandbox import syscall_filter as _syscall_filter
from agentrl_fast.harness.sandbox.bwrap import INNER_UID, base_python

FILE_SIZE_LIMIT_MB = 64
"""Largest file (MB) a sandboxed program may write (``RLIMIT_FSIZE``)."""


# Run as ``python -I -S -c LAUNCHER STATUS_FD AS_BYTES CPU_S FSIZE_BYTES NPROC UID INNER_UID
# LIBSECCOMP -- PROGRAM ARGS...``. It writes "+" to STATUS_FD (so a sandbox that never started is
# told apart from a program that failed), sets RLIMIT_NPROC (NPROC >= 0), drops to UID (>= 0,
# root's sandboxes: the uid must change before the kernel counts processes) and enters a new user
# namespace showing it as INNER_UID, sets the other limits (never raising a hard limit that is
# already lower), loads the system-call filter through LIBSECCOMP (unless it is empty) and execs
# the program. If that fails it writes the error to STATUS_FD (closed by a successful exec) and
# exits 127.
LAUNCHER = "import os, resource, sys\n" + _syscall_filter.LAUNCHER_CODE + """\
args = sys.argv[1:]
split = args.index("--")
fd, memory, cpu, fsize, nproc, uid, inner = map(int, args[:split - 1])
library = args[split - 1]
argv = args[split + 1:]
try:
    os.write(fd, b"+")
    if nproc >= 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if uid >= 0:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, reset by setresuid: /proc/self is ours again
        if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER) failed")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{inner} {uid} 1"),
                           ("gid_map", f"{inner} {uid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    for which, soft, hard in ((resource.RLIMIT_AS, memory, memory),
                              (resource.RLIMIT_CPU, cpu, cpu + 1),
                              (resource.RLIMIT_FSIZE, fsize, fsize),
                              (resource.RLIMIT_CORE, 0, 0)):
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))
    os.set_inheritable(fd, False)
    if library:
        load_syscall_filter(library)  # last: the launcher's own unshare must come before it
    os.execvp(argv[0], argv)
except BaseException as error:
    number = getattr(error, "errno", None) or 0
    os.write(fd, f"{type(error).__name__}\\0{number}\\0{error}".encode(errors="replace"))
    os._exit(127)
"""



def inner_command(status_fd: int, memory_mb: int, cpu: int, nproc: int, uid: int,
                   syscall_filter: bool, argv: Sequence[str]) -> list[str]:
    """The launcher (run by the base interpreter, which is inside the sandbox too) and argv."""
    return [base_python(), "-I", "-S", "-c", LAUNCHER, str(status_fd),
            str(memory_mb * 1024 * 1024), str(cpu), str(FILE_SIZE_LIMIT_MB * 1024 * 1024),
            str(nproc), str(uid), str(INNER_UID),
            _syscall_filter.LIBSECCOMP if syscall_filter else "", "--", *argv]
