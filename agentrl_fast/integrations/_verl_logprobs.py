"""The functions ``verl.patch_logprobs()`` puts in place of verl's, with verl's signatures.

verl's FSDP actor (``verl.workers.engine.fsdp.transformer_impl``) gets per-token log-probs and
entropy in one of two ways: from logits (``logprobs_from_logits``, ``entropy_from_logits``) or,
with ``use_fused_kernels``, from a patched model forward that returns ``log_probs``/``entropy``
straight from the last hidden state. Each replacement here keeps the signature and output of the
function it replaces and runs ``token_logprobs`` / ``linear_token_logprobs`` inside.
"""

from __future__ import annotations

import torch

from agentrl_fast.ops import linear_token_logprobs, token_logprobs


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor,
                         inplace_backward: bool = True) -> torch.Tensor:
    """``log_softmax(logits)[label]``: logits ``[..., V]``, labels ``[...]`` -> float32 ``[...]``.
    ``inplace_backward`` as verl passes it (True when nothing else needs the logits' values)."""
    return token_logprobs(logits, labels, inplace_backward=bool(inplace_backward))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)``: ``[..., V]`` -> float32 ``[...]``, differentiable."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    return token_logprobs(logits, labels, return_entropy=True)[1]


def _rolled_labels(input_ids, labels, shift_labels):
    """The next token of each position, as verl's fused forwards pick it."""
    if shift_labels is not None:
        return shift_labels
    if labels is not None:
        return torch.roll(labels, shifts=-1, dims=-1)
    if input_ids is not None:
        return torch.roll(input_ids, shifts=-1, dims=-1)
    raise ValueError("the fused log-prob forward needs labels, shift_labels or input_ids")


def forward_with_linear_logprobs(self, input_ids=None, attention_mask=None, position_ids=None,
                                 past_key_values=None, inputs_embeds=None, labels=None,
                                 use_cache=None, output_attentions=None, output_hidden_states=None,
                                 return_dict=None, cache_position=None, logits_to_keep=0,
                                 temperature: float = 1.0, shift_labels=None, **_loss_kwargs):
    """verl's fused ``torch``-backend forward for dense causal LMs (``self`` the HF model):
    ``log_probs`` and ``entropy`` ``[B, L]`` from ``linear_token_logprobs(hidden[T, H],
    lm_head.weight[V, H], labels[T])`` at ``temperature``, no ``[T, V]`` logits."""
    from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model

    if not return_dict:
        raise ValueError("the fused log-prob forward returns a dict: pass return_dict=True "
                         "(verl's engine does)")
    outputs = forward_base_model(
        self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
        output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        cache_position=cache_position)
    hidden = outputs[0]
    targets = _rolled_labels(input_ids, labels, shift_labels)
    log_probs, entropy = linear_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets.reshape(-1),
        temperature=float(temperature), return_entropy=True)
    return CausalLMOutputForPPO(
        log_probs=log_probs.view(hidden.shape[:-1]), entropy=entropy.view(hidden.shape[:-1]),
        past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions)
