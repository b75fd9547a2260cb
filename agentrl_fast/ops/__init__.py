"""The ops of agentrl_fast. Each lives in ``agentrl_fast/ops/<op>.py``; float64 references for
all of them are in ``agentrl_fast.ops.reference``."""

from agentrl_fast.ops.gae import adaptive_lam, gae, gae_padded, whiten
from agentrl_fast.ops.ppo_loss import loss_weights, ppo_loss, value_loss
from agentrl_fast.ops.token_logprobs import linear_token_logprobs, token_logprobs
from agentrl_fast.ops.varlen_attention import varlen_attention

__all__ = [
    "adaptive_lam", "gae", "gae_padded", "linear_token_logprobs", "loss_weights", "ppo_loss",
    "token_logprobs", "value_loss", "varlen_attention", "whiten",
]
