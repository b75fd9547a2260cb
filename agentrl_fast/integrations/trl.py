"""Our fused log-probs inside TRL's GRPO trainer (TRL 1.16), through the one extension point it
has for them.

TRL's ``GRPOTrainer.__init__`` calls ``add_fused_lm_head(model, temperature, ...)`` (imported by
name into ``trl.trainer.grpo_trainer``); the model's forward then answers
``model(..., labels=labels, fused_lm_head=True)`` with per-token ``log_probs`` and ``entropy``
instead of logits, and every log-prob the trainer uses (old, reference, current) comes from it.
``patch()`` replaces that name with :func:`add_fused_lm_head`, which installs the same forward
contract on ``linear_token_logprobs`` (hidden states times the LM head's weight, chunked, no
``[B, L, V]`` logits). Models it does not cover (softcapped or scaled logits, an LM-head bias,
MoE router losses, outputs beyond log-probs and entropy) get TRL's own head. Nothing of the
trainer is copied; ``unpatch()`` restores TRL's function.
"""

from __future__ import annotations

import functools
import types

from agentrl_fast.integrations._require import require
from agentrl_fast.ops import linear_token_logprobs

__all__ = ["add_fused_lm_head", "patch", "unpatch"]

_SUPPORTED_OUTPUTS = {"log_probs", "entropy"}
_saved: dict[str, object] = {}


def _trl_utils():
    return require("trl", "trl.trainer.utils")


def _covered(model, outputs) -> bool:
    """Whether our head computes what TRL's would for this model."""
    config = model.config.get_text_config()
    scales = [getattr(config, name, None) for name in (
        "final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
        "logits_scaling")]
    head = model.get_output_embeddings()
    return (set(outputs) <= _SUPPORTED_OUTPUTS and all(s in (None, 1, 1.0) for s in scales)
            and getattr(head, "bias", None) is None
            and not getattr(config, "output_router_logits", False))


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """TRL's ``add_fused_lm_head`` contract (same arguments) on ``linear_token_logprobs``.

    After it, ``model(input_ids, attention_mask, labels=labels[B, L], fused_lm_head=True)``
    returns TRL's ``FusedCausalLMOutput``: ``log_probs`` and ``entropy`` ``[B, L-1]`` (``[B, L]``
    with ``shift_labels``), 0 where the label is -100, and ``loss`` (mean NLL over the scored
    tokens, or divided by ``num_items_in_batch``). Without ``fused_lm_head`` the original forward
    runs (generation is unchanged).
    """
    if not _covered(model, outputs):
        _saved.get("add_fused_lm_head", _trl_utils().add_fused_lm_head)(
            model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
            outputs=outputs)
        return
    output_class = _trl_utils().FusedCausalLMOutput
    original_forward = model.forward
    want_entropy = "entropy" in outputs

    # The signature stays the model's own: generate() validates its keyword arguments against it.
    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels,
                     "num_items_in_batch": num_items_in_batch}
            kwargs.update({k: v for k, v in extra.items() if v is not None})
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state  # looked up per call (PEFT)
        if shift_labels is None:
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        weight = self.get_output_embeddings().weight
        if cast_lm_head_to_fp32:
            hidden, weight = hidden.float(), weight.float()
        elif hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        log_probs, entropy = linear_token_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
            temperature=float(temperature), return_entropy=True, ignore_index=-100)
        mask = targets != -100
        log_probs = log_probs.view(mask.shape)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return output_class(loss=-log_probs.sum() / count, log_probs=log_probs,
                            entropy=entropy.view(mask.shape) if want_entropy else None,
                            label_mask=mask)

    model.forward = types.MethodType(forward, model)


def patch() -> None:
    """Make TRL's GRPO trainer build its fused LM head on our kernel (trainers created after
    the call). Raises ImportError naming TRL when it is not installed."""
    grpo_trainer = require("trl", "trl.trainer.grpo_trainer")
    if grpo_trainer.add_fused_lm_head is not add_fused_lm_head:
        _saved.setdefault("add_fused_lm_head", grpo_trainer.add_fused_lm_head)
        grpo_trainer.add_fused_lm_head = add_fused_lm_head


def unpatch() -> None:
    """Restore TRL's own ``add_fused_lm_head`` in its GRPO trainer."""
    if "add_fused_lm_head" in _saved:
        require("trl", "trl.trainer.grpo_trainer").add_fused_lm_head = _saved.pop(
            "add_fused_lm_head")
