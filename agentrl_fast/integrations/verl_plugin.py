"""Imported by verl in every process of a job when named in ``VERL_USE_EXTERNAL_MODULES`` (or
``actor_rollout_ref.model.external_lib``): registers our GAE, PPO loss and attention with
``override=True`` and patches the actor's log-probs, so Ray workers run them too."""

from agentrl_fast.integrations import verl as _verl

_verl.register(override=True)
_verl.patch_logprobs()
