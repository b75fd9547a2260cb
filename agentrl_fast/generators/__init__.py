"""Generators: the inference engines rollouts and the proxy sample from, behind one protocol
(:class:`Generator`: ``generate(prompts, sampling, seeds, on_tokens)`` -> :class:`Generation`,
``update_weights(model)``). :class:`TorchGenerator` samples in this process with a KV and prefix
cache; :class:`VLLMGenerator` drives vLLM servers (:class:`VLLMServer` starts one) token in,
token out, with weights synced after each update; :class:`ScriptedGenerator` runs a text policy
(scripted experts, tests). Semantics of sampling log-probs: ``docs/design.md``."""

from agentrl_fast.generators.base import FINISH_REASONS, Generation, Generator
from agentrl_fast.generators.scripted import ScriptedGenerator
from agentrl_fast.generators.torch_generator import TorchGenerator
from agentrl_fast.generators.vllm_generator import VLLMGenerator
from agentrl_fast.generators.vllm_server import ServerError, VLLMServer

__all__ = ["FINISH_REASONS", "Generation", "Generator", "ScriptedGenerator", "ServerError",
           "TorchGenerator", "VLLMGenerator", "VLLMServer"]
