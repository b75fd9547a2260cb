"""What a run's rollouts sample with (a leaf: standard library only)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("torch", "vllm")


@dataclass
class GeneratorConfig:
    """``backend``: ``"torch"`` (a :class:`~agentrl_fast.generators.torch_generator.TorchGenerator` on
    the policy, in process) or ``"vllm"`` (vLLM servers over HTTP,
    :class:`~agentrl_fast.generators.vllm_generator.VLLMGenerator`): ``url`` names running ones
    (comma-separated), else a server is started for the run from ``python``, the vLLM
    environment's interpreter (``tools/setup_test_env.sh vllm`` builds one). ``max_concurrency``
    requests in flight, ``timeout`` seconds each, ``retries`` more tries of one that timed out;
    ``startup_timeout`` seconds for a started server to become healthy; a started server's
    ``max_model_len`` (default the run's context budget) and ``max_num_batched_tokens`` (default
    the larger of 16384 and it). The weights reach the servers after every update
    (docs/backends.md)."""

    backend: str = "torch"
    url: str | None = None
    python: str | None = None
    max_concurrency: int = 64
    timeout: float = 120.0
    retries: int = 2
    startup_timeout: float = 300.0
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    weights_dir: str | None = None
    """The folder the trainer writes each weight update into and every server reads it from:
    it must be visible at the same path to the trainer and all servers (shared storage, e.g.
    NFS, for servers on other machines); checked (an existing writable folder) where the
    generator starts. Default ``None``: ``/dev/shm`` when writable, else the temporary folder —
    servers on this machine only."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "torch" and (self.url or self.python):
            raise ValueError("url and python are for backend='vllm'")
        if self.backend == "vllm" and not (self.url or self.python):
            raise ValueError("backend='vllm' needs url (running servers) or python (the vLLM "
                             "environment's interpreter, to start one)")
        if self.url is not None and not all(u.strip().startswith(("http://", "https://"))
                                            for u in self.url.split(",")):
            raise ValueError(f"url must be http(s) URLs separated by commas, got {self.url!r}")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {self.max_concurrency!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if self.weights_dir is not None and not (isinstance(self.weights_dir, str)
                                                 and self.weights_dir.strip()):
            raise ValueError(f"weights_dir must be a folder path or None, got "
                             f"{self.weights_dir!r}")
        for name in ("timeout", "startup_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")

    @property
    def urls(self) -> list[str]:
        return [u.strip() for u in self.url.split(",")] if self.url else []
