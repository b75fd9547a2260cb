"""Critic values on packed batches, by docs/design.md's position convention: ``V[t] = V(x_<t)``,
read from the critic's output at position ``t - 1`` of the same sequence (0 at a sequence's first
token); the value of the state after a sequence's last token is the critic's output at that last
position. Policy log-probs: :mod:`agentrl_fast.models.policy`.

The critic is an HF token-classification model with one label (``AutoModelForTokenClassification``,
as verl's critic): a backbone plus a scalar head, saved and loaded by ``save_pretrained`` /
``from_pretrained`` like any HF model. :func:`make_critic` builds it from the policy (same
architecture, backbone weights copied, head initialised to zero so the first values are 0).
"""

from __future__ import annotations

import copy

import torch

from agentrl_fast.models.attention import packed_forward, use_packed_attention
from agentrl_fast.models.fused import use_fused_layers, uses_fused_layers
from agentrl_fast.models.packing import SharedLayout
from agentrl_fast.models.policy import packed_inputs, rows_to_tokens


def _as_packed(model: torch.nn.Module) -> torch.nn.Module:
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return model if name == "agentrl_varlen" else use_packed_attention(model)


class ValueHead(torch.nn.Module):
    """A scalar value head on a policy's hidden states (the shared-backbone critic); zero at
    initialisation, so the first values are 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.score.weight)
        torch.nn.init.zeros_(self.score.bias)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor):
        """``hidden [T, H]`` -> ``(values [T], last_values [B])`` as :func:`critic_values`.
        ``hidden`` is in the plain packing's token order (``policy_logprobs(return_hidden=True)``
        gives it so with a shared layout too)."""
        return _values_from_rows(self.score(hidden)[:, 0].float(), cu_seqlens)


def _values_from_rows(raw: torch.Tensor, cu_seqlens: torch.Tensor):
    nonempty = cu_seqlens[1:] > cu_seqlens[:-1]
    last = torch.zeros(cu_seqlens.numel() - 1, dtype=raw.dtype, device=raw.device)
    last[nonempty] = raw[cu_seqlens[1:].long()[nonempty] - 1]
    return rows_to_tokens(raw, cu_seqlens), last


def _values_from_shared_rows(raw: torch.Tensor, layout: SharedLayout):
    """``raw [Ts]`` per shared row -> ``(values [T], last_values [B])`` of the plain packing."""
    def read(rows: torch.Tensor) -> torch.Tensor:
        picked = raw.index_select(0, rows.clamp(min=0))
        return torch.where(rows >= 0, picked, torch.zeros_like(picked))

    return read(layout.prev_rows), read(layout.last_rows)


def critic_values(critic: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  cu_seqlens: torch.Tensor, max_seqlen: int, *,
                  layout: SharedLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [T], last_values [B])`` float32: ``values[t] = V(x_<t)`` (0 at each sequence's
    first token) and the value after each sequence's last token (0 for an empty sequence).
    ``layout``: the same sequences with shared prefixes; the critic runs on its rows."""
    inputs = packed_inputs(input_ids, position_ids, cu_seqlens, max_seqlen, layout)
    raw = packed_forward(critic, **inputs, validate=False).logits[0, :, 0].float()
    if layout is not None:
        return _values_from_shared_rows(raw, layout)
    return _values_from_rows(raw, cu_seqlens)


def make_critic(policy: torch.nn.Module) -> torch.nn.Module:
    """A value model for ``policy``: ``AutoModelForTokenClassification`` (one label, no
    dropout) of the same configuration, backbone weights copied from the policy, head zero, on
    the policy's device and dtype, on packed attention."""
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.architectures = None
    critic = AutoModelForTokenClassification.from_config(config)
    prefix = getattr(policy, "base_model_prefix", "model")
    source = getattr(policy, prefix)
    getattr(critic, critic.base_model_prefix).load_state_dict(source.state_dict())
    head = getattr(critic, "score", None) or getattr(critic, "classifier")
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    if uses_fused_layers(policy):
        use_fused_layers(critic)
    parameter = next(policy.parameters())
    return _as_packed(critic.to(device=parameter.device, dtype=parameter.dtype))
