"""Built-in environments: tasks, their tools and rewards, written against the
:class:`~agentrl_fast.harness.environment.Environment` protocol. The vault task
(:class:`VaultEnvironment`: open vaults, keep their codes in memory across context compactions,
hand them in; :func:`expert_action` is its scripted expert) is the main job's, with the small
built-in tokenizer it trains on (:func:`build_tokenizer`: a byte-level BPE carrying Qwen3's chat
tokens)."""

from agentrl_fast.envs.dataset import DatasetToolEnvironment
from agentrl_fast.envs.tokenizer import build_tokenizer
from agentrl_fast.envs.vault import VaultEnvironment, VaultEpisode, expert_action

__all__ = ["DatasetToolEnvironment", "VaultEnvironment", "VaultEpisode", "build_tokenizer",
           "expert_action"]
