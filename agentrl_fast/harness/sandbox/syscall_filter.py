"""The seccomp system-call filter a sandboxed program runs under (:mod:`.sandbox` loads it).

The filter allows every system call except those an untrusted program never needs and that are
the usual ways into the kernel or out of a sandbox; each of those fails with ``EPERM``:

- :data:`DENIED_SYSCALLS`, whatever their arguments: debugging other processes (``ptrace``,
  ``process_vm_readv``, ``pidfd_getfd``, ...), namespaces (``unshare``, ``setns``), mounts (old
  and new API), kernel modules and ``kexec``, ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``io_uring``, the kernel keyring, file handles (``open_by_handle_at``), the clock, swap,
  reboot, quotas, ``syslog``, x86 port I/O, moving other processes' pages and some obsolete
  calls;
- ``clone`` with any of :data:`NAMESPACE_CLONE_FLAGS` (a comparison on its flags argument), so
  a program cannot make a user namespace (in which it would be root, with the kernel code only
  root reaches) nor any other namespace; plain ``fork``, ``vfork`` and threads are allowed;
- ``personality`` unless it keeps the default persona (0) or only asks for the current one
  (``0xffffffff``).

``clone3`` fails with ``ENOSYS`` instead (:data:`ENOSYS_SYSCALLS`): its flags sit in a struct
that seccomp cannot read, and glibc falls back to ``clone`` on ``ENOSYS``, as under Docker's
default profile. A system call of another ABI (32-bit x86 through ``int 0x80``, x32) kills the
program (libseccomp's default for a foreign architecture), so it cannot go around the list.
libseccomp also sets ``no_new_privs``: no set-uid program gains privileges after it.

The filter is a deny list, not an allow list: a kernel bug reachable through an allowed call
(``open``, ``mmap``, sockets, ...) is not covered. See docs/security.md.

The launcher that loads it runs as ``python -I -S`` and imports only the standard library, so
the code is text (:data:`LAUNCHER_CODE`, prepended to :data:`.sandbox.LAUNCHER`) that calls
libseccomp through ``ctypes``. libseccomp is the well-kept C library that Docker, systemd and
Podman build their filters with (``libseccomp.so.2`` on every Debian, Ubuntu and Fedora); it
knows each architecture's system-call numbers and writes the BPF program, which would
otherwise be hand-written here. A pip binding could not be imported by ``python -I -S``.
"""

from __future__ import annotations

import ctypes

LIBSECCOMP = "libseccomp.so.2"
"""The library the launcher loads (a name the dynamic loader finds, or a path)."""

DENIED_SYSCALLS: tuple[str, ...] = (
    # other processes' memory and state
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "process_madvise",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # the machine: swap, reboot, kernel code, accounting, quotas, the clock, the console
    "swapon", "swapoff", "reboot", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "acct", "quotactl", "quotactl_fd", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "syslog", "vhangup", "iopl", "ioperm",
    # the usual kernel attack surface
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "name_to_handle_at",
    "open_by_handle_at", "lookup_dcookie", "fanotify_init",
    # moving other processes' pages between NUMA nodes (a process's own policy, mbind and
    # set_mempolicy, stays allowed: numerical libraries set it)
    "migrate_pages", "move_pages",
    # obsolete
    "_sysctl", "uselib", "ustat", "sysfs", "nfsservctl", "create_module", "get_kernel_syms",
    "query_module",
)
"""System calls that fail with ``EPERM`` whatever their arguments. A name the architecture
lacks (``iopl`` on aarch64) is skipped."""

NAMESPACE_CLONE_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    # clone3 and unshare only (in clone's flags this bit belongs to the exit signal, which is
    # below 65): denied all the same.
    "CLONE_NEWTIME": 0x00000080,
}
"""``clone`` with any of these flags fails with ``EPERM``."""

ENOSYS_SYSCALLS: tuple[str, ...] = ("clone3",)
"""System calls that fail with ``ENOSYS``, as if the kernel lacked them (the C library then
falls back to an older call the filter can inspect)."""

_LOADER = r'''
def load_syscall_filter(library):
    """Load the seccomp filter (deny list above) into this process; it holds after exec."""
    import ctypes

    def fail(what):
        raise RuntimeError(f"the system-call filter (libseccomp) could not be set up: {what}; "
                           f"pass syscall_filter=False to run without it")

    try:
        lib = ctypes.CDLL(library)
    except OSError as error:
        fail(f"cannot load {library} ({error}): install libseccomp (apt-get install "
             f"libseccomp2, dnf install libseccomp)")

    class Comparison(ctypes.Structure):  # struct scmp_arg_cmp
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                    ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(Comparison)]
    lib.seccomp_load.argtypes = lib.seccomp_release.argtypes = [ctypes.c_void_p]
    allow, masked_eq = 0x7FFF0000, 7  # SCMP_ACT_ALLOW, SCMP_CMP_MASKED_EQ
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38  # SCMP_ACT_ERRNO(EPERM), (ENOSYS)
    filter_ = lib.seccomp_init(allow)  # the bad-architecture action stays kill
    if not filter_:
        fail("seccomp_init failed")

    def add(name, action, comparisons=()):
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # unknown to libseccomp, or not a system call of this architecture
            if name == "clone3":  # clone3 would then be a way around the clone rules
                fail(f"{library} does not know clone3 (libseccomp 2.5 or later needed)")
            return
        array = (Comparison * len(comparisons))(*(Comparison(*c) for c in comparisons))
        code = lib.seccomp_rule_add_array(filter_, action, number, len(comparisons), array)
        if code < 0:
            fail(f"seccomp_rule_add({name}) returned {code}")

    for name in SYSCALL_FILTER_EPERM:
        add(name, eperm)
    for name in SYSCALL_FILTER_ENOSYS:
        add(name, enosys)
    flags_arg = 1 if os.uname().machine.startswith("s390") else 0  # s390: clone(stack, flags)
    for flag in SYSCALL_FILTER_CLONE_FLAGS:
        add("clone", eperm, [(flags_arg, masked_eq, flag, flag)])
    # personality: only 0 (the default persona) and 0xffffffff (a query) in its low 32 bits,
    # which the kernel reads. Any other value has a bit set whose next bit (cyclically) is
    # clear: one masked comparison per bit covers exactly those.
    for bit in range(32):
        mask = (1 << bit) | (1 << (bit + 1) % 32)
        add("personality", eperm, [(0, masked_eq, mask, 1 << bit)])
    code = lib.seccomp_load(filter_)
    lib.seccomp_release(filter_)
    if code < 0:
        fail(f"seccomp_load returned {code}")
'''

LAUNCHER_CODE = (f"SYSCALL_FILTER_EPERM = {DENIED_SYSCALLS!r}\n"
                 f"SYSCALL_FILTER_ENOSYS = {ENOSYS_SYSCALLS!r}\n"
                 f"SYSCALL_FILTER_CLONE_FLAGS = {tuple(NAMESPACE_CLONE_FLAGS.values())!r}\n"
                 + _LOADER)
"""Python text defining ``load_syscall_filter(library)`` (and the lists it reads); needs
``os`` imported. Raises ``RuntimeError`` naming libseccomp and ``syscall_filter=False`` when
libseccomp is missing or refuses the filter."""


def libseccomp_problem() -> str | None:
    """Why the filter cannot be loaded here, or ``None``: checks that :data:`LIBSECCOMP` loads
    (in this process; the filter itself is only ever loaded in the sandboxed child)."""
    try:
        ctypes.CDLL(LIBSECCOMP)
    except OSError as error:
        return f"cannot load {LIBSECCOMP} ({error})"
    return None
