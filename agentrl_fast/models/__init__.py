"""HF integration: packed forward passes of any HF causal LM through agentrl_fast ops.

    from agentrl_fast.models import pack, packed_forward, unpack, use_packed_attention

    model = use_packed_attention(AutoModelForCausalLM.from_pretrained(...))
    input_ids, position_ids, cu_seqlens, max_seqlen = pack([seq_a, seq_b, seq_c])
    logits = packed_forward(model, input_ids, position_ids, cu_seqlens, max_seqlen).logits
    per_sequence_logits = unpack(logits, cu_seqlens)

``register_attention()`` (returns the name, ``"agentrl_varlen"``) registers the attention function
with transformers' ``AttentionInterface`` and a mask function that builds no mask with its
``AttentionMaskInterface``; ``use_packed_attention(model)`` also switches the model to it. See
``agentrl_fast.models.attention`` for where sequence boundaries come from and when
``cu_seqlens`` is validated. ``use_fused_layers(model)`` runs a Llama-family model's RMSNorms
and SwiGLU MLPs on fused ops (``agentrl_fast.models.fused``).
"""

from agentrl_fast.models.attention import (ATTN_NAME, packed_attention_forward,
                                           packed_attention_mask, packed_forward,
                                           register_attention, use_packed_attention)
from agentrl_fast.models.fused import use_fused_layers
from agentrl_fast.models.packing import pack, position_ids_from_cu_seqlens, unpack

__all__ = ["ATTN_NAME", "pack", "packed_attention_forward", "packed_attention_mask", "packed_forward",
           "position_ids_from_cu_seqlens", "register_attention", "unpack", "use_fused_layers",
           "use_packed_attention"]
