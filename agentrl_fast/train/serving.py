"""A run's generator (``RunConfig.generator``): ``None`` for the in-process
:class:`~agentrl_fast.generators.torch_generator.TorchGenerator`, or a
:class:`~agentrl_fast.generators.vllm_generator.VLLMGenerator` on the servers at ``url``, or on a
server started for the run from the policy exported as a model folder (config, safetensors,
tokenizer) in ``run_dir/serving``, its log in ``run_dir/vllm-server.log``. Weight updates go
through ``generator.weights_dir`` (checked before a server is started)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from agentrl_fast.config import ConfigError, RunConfig
from agentrl_fast.generators.base import Generator
from agentrl_fast.generators.vllm_generator import VLLMGenerator, checked_weights_dir
from agentrl_fast.generators.vllm_server import VLLMServer
from agentrl_fast.train.export import export_pretrained


@contextlib.contextmanager
def run_generator(config: RunConfig, policy, tokenizer, run_dir: Path,
                  distributed: bool) -> Iterator[Generator | None]:
    """The generator rollouts, validation checks and evaluations of the run sample with
    (``None``: a TorchGenerator each on the policy); servers started here stop at the end."""
    settings = config.generator
    if settings.backend == "torch":
        yield None
        return
    if distributed:
        raise ConfigError("generator.backend=vllm runs on one process; under torchrun each rank "
                          "samples with its own TorchGenerator (generator.backend=torch)")
    try:
        weights_dir = checked_weights_dir(settings.weights_dir)
    except ValueError as error:  # the CLI reports a ConfigError as a bad configuration
        raise ConfigError(str(error)) from None
    with contextlib.ExitStack() as stack:
        targets: list = settings.urls
        if not targets:
            folder = export_pretrained(policy, Path(run_dir) / "serving", tokenizer=tokenizer)
            targets = [stack.enter_context(VLLMServer(
                folder, python=settings.python, startup_timeout=settings.startup_timeout,
                log_path=Path(run_dir) / "vllm-server.log",
                max_model_len=settings.max_model_len or config.train.rollout.context_budget,
                max_num_batched_tokens=settings.max_num_batched_tokens))]
        yield stack.enter_context(VLLMGenerator(
            targets, max_concurrency=settings.max_concurrency, timeout=settings.timeout,
            retries=settings.retries, weights_dir=weights_dir))
