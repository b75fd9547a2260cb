"""The sandbox: code the model wrote runs in a child process under bubblewrap (no network, no
trainer files; :mod:`.bwrap`), a seccomp filter (:mod:`.syscall_filter`), resource limits set by
a small launcher (:mod:`.launcher`) and a control group per call bounding the memory and the
processes of all its processes together (:mod:`.cgroups`). :func:`run_sandboxed` runs a program;
:func:`python_tool` is the ``run_python`` tool built on it (:mod:`.execute`). What it protects
and what it does not: ``docs/security.md``."""

from agentrl_fast.harness.sandbox.execute import SandboxResult, python_tool, run_sandboxed

__all__ = ["SandboxResult", "python_tool", "run_sandboxed"]
