"""Packed attention for HF models: ``varlen_attention`` behind transformers' attention interface.

docs/design.md, "Training": the policy and the critic run on packed input — one row of sequences laid
end to end, position ids restarting per sequence — through transformers' attention interface.

- ``register_attention()`` registers :func:`packed_attention_forward` with ``AttentionInterface``
  and :func:`packed_attention_mask` with ``AttentionMaskInterface`` under :data:`ATTN_NAME`, and
  returns that name. The mask function never builds a mask (it returns None), so a packed forward
  materializes no ``[L, L]`` tensor; it only rejects padding.
- ``use_packed_attention(model)`` registers and switches a model to it
  (``model.set_attn_implementation(name)`` where transformers has it, else
  ``config._attn_implementation = name``).
- ``packed_forward(model, input_ids, position_ids, cu_seqlens, max_seqlen, **kw)`` validates
  ``cu_seqlens`` once and calls ``model(..., cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
  max_length_q=max_seqlen, max_length_k=max_seqlen)``.

Where the sequence boundaries come from, in each attention layer (see
:func:`packed_attention_forward`): ``cu_seq_lens_q`` / ``max_length_q`` from the forward's keyword
arguments; without them, the restarts of ``position_ids`` at 0; without those, the row is one
sequence.

Shared prefixes (issue 47, :class:`~agentrl_fast.models.packing.SharedLayout`): a ``prefix_of``
keyword argument (int32 ``[B]``, ``varlen_attention``'s) rides along the forward's keyword
arguments (transformers passes them to the attention function unchanged) and needs explicit
``cu_seq_lens_q``: a suffix's position ids continue from its prefix's, so boundaries are never
read from position ids then. transformers' own packed-sequence detection from ``position_ids``
only shapes the mask function it hands to our mask function, which ignores it.

Validation once per forward, not once per layer: the value checks of ``cu_seqlens`` (the
``agentrl_fast::validate_cu_seqlens`` op, one host sync on the GPU; ``prefix_of``'s likewise) run
on the first layer that sees a ``cu_seqlens`` tensor, which is then remembered as validated (by
identity and version, for its ``T`` and ``max_seqlen``) so that later layers skip them;
``packed_forward`` validates before the forward, so no layer repeats it. The attention op itself
always runs with ``validate=False``. A ``cu_seqlens`` tensor reused (unmodified) across forwards
is checked only the first time.

Costs besides the attention: with ``position_ids`` and no ``attention_mask``, transformers' own
mask preparation looks for packed sequences in ``position_ids`` (one host sync per forward, no
``[L, L]`` tensor) before calling our mask function. The per-tensor memo is plain Python, not
traced by ``torch.compile`` (untested under compile).
"""

from __future__ import annotations

import torch


from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.ops._checks import (check_cu_seqlens_metadata, check_prefix_of_metadata,
                                      validate_cu_seqlens, validate_prefix_of)
from agentrl_fast.ops._tensor_memo import TensorMemo
from agentrl_fast.ops.varlen_attention import varlen_attention

ATTN_NAME = "agentrl_varlen"
"""The name under which :func:`register_attention` registers the attention (and mask) function.
It contains neither "flash", "sdpa", "flex" nor "/", so transformers treats it as a plain custom
implementation (no flash-attention or hub-kernel special cases)."""

__all__ = ["ATTN_NAME", "packed_attention_forward", "packed_attention_mask", "packed_forward",
           "register_attention", "use_packed_attention"]


_MEMO = TensorMemo()


def _ensure_validated(cu_seqlens: torch.Tensor, num_tokens: int, max_seqlen: int) -> None:
    """Value checks of ``cu_seqlens`` for ``T = num_tokens`` and ``max_seqlen``, once per tensor."""
    fact = ("validated", num_tokens, max_seqlen)
    if _MEMO.get(cu_seqlens, fact):
        return
    validate_cu_seqlens(cu_seqlens, num_tokens, max_seqlen)
    _MEMO.put(cu_seqlens, fact, True)


def _ensure_prefix_of_validated(prefix_of: torch.Tensor) -> None:
    """Value checks of ``prefix_of``, once per tensor."""
    if _MEMO.get(prefix_of, "validated"):
        return
    validate_prefix_of(prefix_of)
    _MEMO.put(prefix_of, "validated", True)


def _prefix_of(kwargs: dict, cu_seqlens: torch.Tensor | None,
               device: torch.device) -> torch.Tensor | None:
    """The forward's ``prefix_of`` (int32 ``[B]``), checked; None without one."""
    prefix_of = kwargs.get("prefix_of")
    if prefix_of is None:
        return None
    if cu_seqlens is None:
        raise ValueError("prefix_of was passed without cu_seq_lens_q; shared-prefix segments need "
                         "explicit boundaries (a suffix's position ids do not restart at 0): pass "
                         "cu_seq_lens_q and max_length_q, or use packed_forward")
    check_prefix_of_metadata(prefix_of, cu_seqlens.numel() - 1, device)
    _ensure_prefix_of_validated(prefix_of)
    return prefix_of


def _cu_seqlens_from_position_ids(position_ids: torch.Tensor, num_tokens: int):
    """``(cu_seqlens int32, max_seqlen)``: a sequence starts at token 0 and wherever the position
    id is 0. One host sync per ``position_ids`` tensor (memoized across layers)."""
    fact = ("derived", num_tokens)
    derived = _MEMO.get(position_ids, fact)
    if derived is not None:
        return derived
    if position_ids.dim() == 2 and position_ids.shape[0] != 1:
        raise ValueError(f"packed attention takes one row: position_ids must be [1, L], got shape "
                         f"{tuple(position_ids.shape)}; pack the sequences with agentrl_fast.models.pack")
    flat = position_ids.reshape(-1)
    if flat.numel() != num_tokens:
        raise ValueError(f"position_ids must have one entry per token (L = {num_tokens}), got shape "
                         f"{tuple(position_ids.shape)}")
    if num_tokens == 0:
        return torch.zeros(1, dtype=torch.int32, device=flat.device), 0
    starts = flat == 0
    starts[0] = True
    bounds = torch.cat([starts.nonzero().flatten(),
                        torch.tensor([num_tokens], device=flat.device)]).tolist()  # the sync
    max_seqlen = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=flat.device)
    derived = (cu_seqlens, max_seqlen)
    _MEMO.put(position_ids, fact, derived)
    return derived


def _longest_key_span(cu_seqlens: torch.Tensor, prefix_of: torch.Tensor) -> int:
    """The most keys a query attends in the prefix-shared mode: a suffix's length plus its
    prefix's. One host sync per ``prefix_of`` tensor (memoized across layers); only models with
    a sliding window ask."""
    fact = ("key span", cu_seqlens.data_ptr())
    span = _MEMO.get(prefix_of, fact)
    if span is None:
        lengths = cu_seqlens.diff().long()
        prefix = prefix_of.long()
        spans = lengths + torch.where(prefix >= 0, lengths[prefix.clamp(min=0)], 0)
        span = int(spans.max()) if spans.numel() else 0
        _MEMO.put(prefix_of, fact, span)
    return span


def _as_int(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a Python int (the longest sequence), got a tensor of "
                             f"shape {tuple(value.shape)}")
        return int(value)  # a host sync per layer when on the GPU; pass an int instead
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int (the longest sequence), got "
                        f"{type(value).__name__}")
    return value


def _sequence_metadata(query: torch.Tensor,
                       kwargs: dict) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    num_tokens = query.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None and cu_k is not None:
        cu_q, max_q = cu_k, max_k
    if cu_q is not None:
        if max_q is None:
            raise ValueError("cu_seq_lens_q was passed without max_length_q; pass max_length_q "
                             "(and max_length_k), the length of the longest sequence, as an int")
        max_seqlen = _as_int("max_length_q", max_q)
        if cu_k is not None and cu_k is not cu_q:
            # Self-attention over one packing: k's boundaries are q's. Checked on metadata only
            # (comparing values would cost a host sync per layer).
            if not isinstance(cu_k, torch.Tensor) or cu_k.shape != cu_q.shape:
                raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (packed self-attention), got "
                                 f"shapes {tuple(getattr(cu_k, 'shape', ()))} and {tuple(cu_q.shape)}")
            if max_k is not None and _as_int("max_length_k", max_k) != max_seqlen:
                raise ValueError(f"max_length_k must equal max_length_q (packed self-attention), got "
                                 f"{max_k} and {max_q}")
        if isinstance(cu_q, torch.Tensor) and cu_q.dtype == torch.int64:
            # HF's type hint is LongTensor; the op takes int32. Converted once per tensor.
            converted = _MEMO.get(cu_q, "int32")
            if converted is None:
                converted = cu_q.to(torch.int32)
                _MEMO.put(cu_q, "int32", converted)
            cu_q = converted
        check_cu_seqlens_metadata(cu_q, query.device)
        _ensure_validated(cu_q, num_tokens, max_seqlen)
        return cu_q, max_seqlen, _prefix_of(kwargs, cu_q, query.device)
    _prefix_of(kwargs, None, query.device)  # raises when there is one
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return *_cu_seqlens_from_position_ids(position_ids, num_tokens), None
    return torch.tensor([0, num_tokens], dtype=torch.int32, device=query.device), num_tokens, None


# ---------------------------------------------------------------------------------------------
# The functions transformers calls.

def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``varlen_attention`` over one packed row.

    ``query [1, Hq, L, D]``, ``key``/``value [1, Hk, L, D]`` (transformers' layout) →
    ``(out [1, L, Hq, D], None)``. The sequence boundaries are, in order of preference:

    1. ``cu_seq_lens_q`` (int32, or int64, converted) and ``max_length_q`` (an int) from the
       forward's keyword arguments (``cu_seq_lens_k``/``max_length_k`` must describe the same
       packing; only their shape and value are compared). Their values are validated once per
       tensor (the first layer; none at all after :func:`packed_forward`). With them, a
       ``prefix_of`` keyword argument (int32 ``[B]``) runs the shared-prefix mode (validated
       once per tensor likewise).
    2. Otherwise ``position_ids`` from the keyword arguments: a sequence starts at every position
       0 (and at the first token). Valid by construction; one host sync per forward.
    3. Otherwise the row is one sequence.

    Out of scope, with a ``ValueError``: a batch of more than one row (padding), an attention mask,
    a KV cache holding earlier tokens, attention dropout, soft-capping, attention sinks, and a
    sliding window shorter than ``max_seqlen``.
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("packed attention expects query, key, value as [batch, heads, L, head_dim], "
                         f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row of concatenated sequences (batch size 1), got "
                         f"batch size {query.shape[0]}; batches with padding are not supported: pack "
                         "the sequences with agentrl_fast.models.pack and pass cu_seqlens")
    if attention_mask is not None:
        raise ValueError("packed attention takes no attention mask (got one of shape "
                         f"{tuple(attention_mask.shape)}); sequence boundaries come from "
                         "cu_seq_lens_q/max_length_q or position_ids")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"packed attention needs as many keys as queries, got {key.shape[2]} keys for "
                         f"{query.shape[2]} queries (a KV cache with earlier tokens?); run without a "
                         "cache (use_cache=False)")
    if dropout:
        raise ValueError(f"packed attention does not support attention dropout, got dropout={dropout}; "
                         "set config.attention_dropout = 0 or call model.eval()")
    if softcap is not None:
        raise ValueError(f"packed attention does not support attention logit soft-capping (softcap="
                         f"{softcap})")
    if s_aux is not None:
        raise ValueError("packed attention does not support attention sinks (s_aux)")
    cu_seqlens, max_seqlen, prefix_of = _sequence_metadata(query, kwargs)
    if sliding_window is not None:
        span = max_seqlen if prefix_of is None else _longest_key_span(cu_seqlens, prefix_of)
        if span > sliding_window:
            what = "max_seqlen" if prefix_of is None else "the longest prefix + suffix"
            raise ValueError(f"packed attention does not support a sliding window: sliding_window "
                             f"= {sliding_window} < {what} = {span}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # [1, H, L, D] -> [L, H, D]: views, no copies.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    extra = {} if prefix_of is None else {"prefix_of": prefix_of}  # the plain call unchanged
    out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=bool(causal),
                           softmax_scale=scaling, validate=False, **extra)
    return out.unsqueeze(0), None


def packed_attention_mask(batch_size: int, *args, attention_mask: torch.Tensor | None = None,
                          **kwargs) -> None:
    """An ``AttentionMaskInterface`` function: returns None (no mask is ever built).

    Rejects what packed attention cannot express: a batch of several rows, or a 2-D padding mask
    with padding in it (an all-ones mask is accepted and dropped). Takes every keyword argument
    of the transformers versions supported (``q_length``/``cache_position``, ``kv_length``, ...).
    """
    if batch_size != 1:
        raise ValueError(f"packed attention takes one row of concatenated sequences (batch size 1), got "
                         f"batch size {batch_size}; batches with padding are not supported: pack the "
                         "sequences with agentrl_fast.models.pack and pass cu_seqlens")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("packed attention does not support padding: attention_mask has zeros; pack "
                         "the sequences with agentrl_fast.models.pack (no padding) and pass no "
                         "attention_mask")
    return None


def register_attention(name: str = ATTN_NAME) -> str:
    """Register packed attention with transformers under ``name``; returns ``name``.

    Registers :func:`packed_attention_forward` with ``AttentionInterface`` and
    :func:`packed_attention_mask` with ``AttentionMaskInterface`` (library-wide; idempotent).
    Then ``model.set_attn_implementation(name)``, or ``attn_implementation=name`` in
    ``from_pretrained``/``from_config``, selects it (or use :func:`use_packed_attention`).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, packed_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers without mask interface: no mask to replace
        pass
    else:
        AttentionMaskInterface.register(name, packed_attention_mask)
    return name


def use_packed_attention(model, name: str = ATTN_NAME):
    """Register packed attention and switch ``model`` (an HF ``PreTrainedModel``) to it; returns
    the model. Uses ``model.set_attn_implementation`` where transformers has it (it also switches
    sub-models), else sets ``config._attn_implementation``. Either way the switch is made on the
    config object, so other models built from that same config object switch too."""
    register_attention(name)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", None) != name:
        raise ValueError(f"{type(model).__name__} could not be switched to attention {name!r} "
                         f"(it uses {getattr(model.config, '_attn_implementation', None)!r}); the "
                         "model must use transformers' AttentionInterface")
    return model


# ---------------------------------------------------------------------------------------------
# The forward call.

def _consumes_cu_seqlens(name) -> bool:
    """Whether attention ``name`` reads ``cu_seq_lens_q``: ours (or a wrapper of it registered with
    our mask function), or transformers' flash-attention implementations."""
    if not isinstance(name, str):
        return False
    if "flash" in name:
        return True
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(name) is packed_attention_forward:
        return True
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    return AttentionMaskInterface._global_mapping.get(name) is packed_attention_mask


def _checked_prefix_of(name: str, prefix_of: torch.Tensor, cu_seqlens: torch.Tensor,
                       validate: bool) -> torch.Tensor:
    """``prefix_of`` checked (values too with ``validate``) and marked validated for the layers,
    on a new tensor object like ``cu_seqlens``."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(name) is not packed_attention_forward:
        raise ValueError(f"prefix_of needs the model on packed attention ({ATTN_NAME!r}), but it "
                         f"uses {name!r}, which would ignore prefix_of; call "
                         "agentrl_fast.models.use_packed_attention(model) first")
    check_prefix_of_metadata(prefix_of, cu_seqlens.numel() - 1, cu_seqlens.device)
    prefix_of = validate_prefix_of(prefix_of) if validate else prefix_of.view(-1)
    _MEMO.put(prefix_of, "validated", True)
    return prefix_of


def packed_forward(model, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                   cu_seqlens: torch.Tensor, max_seqlen: int, *,
                   prefix_of: torch.Tensor | None = None, validate: bool = True, **kwargs):
    """Run ``model`` on one packed row; returns what ``model(...)`` returns.

    Args:
        model: an HF model switched to packed attention (:func:`use_packed_attention`); an
            attention registered with :func:`packed_attention_mask` as its mask function, or one
            of transformers' flash-attention implementations, is accepted too (they read the
            same keyword arguments); any other raises ValueError.
        input_ids: ``[1, T]`` or ``[T]`` (None when ``inputs_embeds`` is in ``kwargs``).
        position_ids: ``[1, T]`` or ``[T]``, restarting at 0 per sequence (a suffix segment's
            continuing from its prefix's length); None builds them from ``cu_seqlens`` (and
            ``prefix_of``).
        cu_seqlens: int32 ``[B+1]`` (docs/design.md's packed layout; empty sequences allowed).
        max_seqlen: a Python int, at least the longest sequence.
        prefix_of: None, or int32 ``[B]``: the shared-prefix mode of ``varlen_attention``
            (:class:`~agentrl_fast.models.packing.SharedLayout`); needs our packed attention
            (transformers' flash-attention would ignore it).
        validate: check ``cu_seqlens``/``max_seqlen`` (and ``prefix_of``) values once, here,
            before the forward (a host sync each on the GPU); the layers then skip it. False
            skips it entirely.
        **kwargs: passed on to ``model`` (``use_cache`` defaults to False).
    """
    name = getattr(unwrap(model).config, "_attn_implementation", None)
    if not _consumes_cu_seqlens(name):
        raise ValueError(f"packed_forward needs the model to use packed attention, but it uses {name!r} "
                         "(which would ignore cu_seqlens and build an [L, L] mask); call "
                         "agentrl_fast.models.use_packed_attention(model) first")
    inputs_embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, T] (one packed row) or [T], got shape "
                             f"{tuple(input_ids.shape)}; pack the sequences with agentrl_fast.models.pack")
        num_tokens, device = input_ids.shape[1], input_ids.device
    elif inputs_embeds is not None:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[0] != 1:
            raise ValueError(f"inputs_embeds must be [1, T, hidden], got shape {tuple(inputs_embeds.shape)}")
        num_tokens, device = inputs_embeds.shape[1], inputs_embeds.device
    else:
        raise ValueError("packed_forward needs input_ids or inputs_embeds")
    check_cu_seqlens_metadata(cu_seqlens, device)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be a Python int, got {type(max_seqlen).__name__}")
    # Validated here (or waived by validate=False): the layers must not check again. Marked on a
    # new tensor object (the op's copy, or a view), so the caller's tensor stays unmarked.
    if validate:
        cu_seqlens = validate_cu_seqlens(cu_seqlens, num_tokens, max_seqlen)
    else:
        cu_seqlens = cu_seqlens.view(-1)
    _MEMO.put(cu_seqlens, ("validated", num_tokens, max_seqlen), True)
    if prefix_of is not None:
        prefix_of = _checked_prefix_of(name, prefix_of, cu_seqlens, validate)
        kwargs["prefix_of"] = prefix_of
    if position_ids is None:
        from agentrl_fast.models.packing import position_ids_from_cu_seqlens

        position_ids = position_ids_from_cu_seqlens(cu_seqlens, num_tokens,
                                                    prefix_of).unsqueeze(0)
    elif position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape != (1, num_tokens):
        raise ValueError(f"position_ids must be [1, T] with T = {num_tokens}, got shape "
                         f"{tuple(position_ids.shape)}")
    kwargs.setdefault("use_cache", False)
    return model(input_ids=input_ids, position_ids=position_ids, cu_seq_lens_q=cu_seqlens,
                 cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen, **kwargs)
