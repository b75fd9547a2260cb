"""A vLLM OpenAI-compatible server as a child process: :class:`VLLMServer`.

vLLM pins its own torch, so it lives in a virtual environment of its own; the server runs from
that environment's interpreter (``python``). It serves on 127.0.0.1, with what the rollouts
need: ``--logprobs-mode processed_logprobs`` (the sampled token's log-prob after temperature,
the trainer's convention), ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc`` reloads weights in
place, ``/reset_prefix_cache`` drops keys of old weights: :mod:`~agentrl_fast.harness.
vllm_generator`) and float32 weights, as the trainer's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

# Flags every server gets (then --max-model-len and --max-num-batched-tokens, see VLLMServer);
# ``args`` come after them and win (argparse keeps the last). Chunked prefill is off: vLLM 0.32's
# CPU worker crashes ("CPU Generator does not use offset") when a seeded request's prefill is
# split over steps; whole prefills need a token budget of at least the model length per step.
SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
               "--no-enable-chunked-prefill", "--disable-log-stats",
               "--uvicorn-log-level", "warning")
DEFAULT_MAX_MODEL_LEN = 2048  # without a run's context budget: vLLM's KV cache on the CPU is small
MIN_BATCHED_TOKENS = 16384


class ServerError(RuntimeError):
    """A vLLM server died, never became healthy or stopped answering; the message names it and
    quotes the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text) or "(empty log)"


def _lengths(model_dir: Path, max_model_len: int | None, batched: int | None) -> tuple[int, int]:
    """``(max_model_len, max_num_batched_tokens)`` for a server of ``model_dir`` (checked
    against its ``config.json``: vLLM refuses a length above the model's)."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    model_max = config.get("max_position_embeddings")
    for name, value in (("max_model_len", max_model_len), ("max_num_batched_tokens", batched)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, model_max or DEFAULT_MAX_MODEL_LEN)
    elif model_max is not None and max_model_len > model_max:
        raise ValueError(f"max_model_len ({max_model_len}, the run's context budget when a run "
                         f"starts the server) exceeds the model's max_position_embeddings "
                         f"({model_max}, {model_dir / 'config.json'}); lower it")
    batched = batched if batched is not None else max(MIN_BATCHED_TOKENS, max_model_len)
    if batched < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({batched}) must be at least max_model_len "
                         f"({max_model_len}): prefills are not chunked")
    return max_model_len, batched


class VLLMServer:
    """``with VLLMServer(model_dir, python=...) as server:`` serves ``model_dir`` (a folder vLLM
    loads: config, safetensors, tokenizer) at ``server.base_url`` until the block ends.

    ``python``: the vLLM environment's interpreter; ``port``: default a free one; ``args``: more
    server flags (after :data:`SERVER_ARGS`, so they override them); ``env``: more environment
    variables; ``threads``: the CPU cores vLLM's OpenMP threads are bound to (a
    ``VLLM_CPU_OMP_THREADS_BIND`` value, default ``"0-{n-1}"`` of this machine's cores), so the
    server and the trainer do not oversubscribe them; ``kv_cache_gib``: its KV cache on the CPU;
    ``startup_timeout``: seconds to wait for ``/health``. The log is kept in ``log_path`` (default
    a temporary file). On exit the whole process group is stopped.

    ``max_model_len``: the longest sequence served (a run passes its context budget; default the
    smaller of 2048 and the model's ``max_position_embeddings``; more than the model's is an
    error); ``max_num_batched_tokens``: tokens per engine step, at least ``max_model_len`` since
    prefills are not chunked (default the larger of 16384 and ``max_model_len``).
    """

    def __init__(self, model_dir: str | os.PathLike, *, python: str | os.PathLike,
                 port: int | None = None, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, threads: str | None = None,
                 kv_cache_gib: float = 1, startup_timeout: float = 300,
                 log_path: str | os.PathLike | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None):
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model_dir must be a model folder with a config.json, got "
                             f"{str(model_dir)!r}")
        self.python = os.path.expanduser(str(python))
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"python must be the vLLM environment's interpreter, got "
                             f"{self.python!r} (not an executable)")
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"port must be an int in [1, 65535] or None, got {port!r}")
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout!r}")
        self.port = port
        self.max_model_len, self.max_num_batched_tokens = _lengths(
            self.model_dir, max_model_len, max_num_batched_tokens)
        self.args = tuple(str(a) for a in args)
        self.env = dict(env or {})
        self.threads = threads or f"0-{(os.cpu_count() or 1) - 1}"
        self.kv_cache_gib = kv_cache_gib
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen | None = None
        self._launched_at = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"vLLM server {self.base_url} (model {self.model_dir}, log {self.log_path})"

    def command(self) -> list[str]:
        # setpriv --pdeathsig: SIGTERM to the server when the thread that started it dies, so a
        # trainer killed with SIGKILL leaves no server behind (vLLM then stops its engine).
        guard = ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []
        return [*guard, self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                *SERVER_ARGS, "--max-model-len", str(self.max_model_len),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens), *self.args]

    def start(self) -> "VLLMServer":
        """Launch the server and wait until it is healthy."""
        return self.launch().wait()

    def launch(self) -> "VLLMServer":
        """Start the server's process and return at once (:meth:`wait` for it: several servers
        boot side by side)."""
        if self.process is not None:
            raise RuntimeError(f"{self.name} is already started")
        if self.port is None:
            self.port = free_port()
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": self.threads,
               "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1", **self.env}
        for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # this environment's, not the server's
            if key not in self.env:
                env.pop(key, None)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        self._launched_at = time.monotonic()
        return self

    def wait(self) -> "VLLMServer":
        """Wait for ``/health`` (``startup_timeout`` from the launch); on failure the server is
        stopped and :class:`ServerError` raised."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = self._launched_at + self.startup_timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if self.healthy(timeout=2):
                return
            time.sleep(0.5)
        raise ServerError(f"{self.name} did not become healthy within {self.startup_timeout} s; "
                          f"log tail:\n{log_tail(self.log_path)}")

    def healthy(self, timeout: float = 2) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        """Raise :class:`ServerError` (with the log's tail) if the server has exited."""
        if self.process is None:
            raise ServerError(f"{self.name} was never started")
        code = self.process.poll()
        if code is not None:
            raise ServerError(f"{self.name} exited with code {code}; log tail:\n"
                              f"{log_tail(self.log_path)}")

    def stop(self, grace: float = 10) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived the leader (the engine core)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
