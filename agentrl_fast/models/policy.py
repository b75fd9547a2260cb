"""Policy log-probs on packed batches, by docs/design.md's position convention.

Every per-token quantity at position ``t`` is about emitting token ``t``: ``logp[t] = log
pi(x_t | x_<t)``, read from the model's output at position ``t - 1`` of the same sequence; the
first token of a sequence has none (0 here). :func:`rows_to_tokens` moves per-row outputs to the
token they are about (the critic's values use it too).

With a :class:`~agentrl_fast.models.packing.SharedLayout` (``layout=``) the model runs on the
shared rows (each shared prefix once) and every output comes back in the plain packing's token
order, equal to the plain computation: token ``t``'s is read from row ``layout.prev_rows[t]``
(gradients of a prefix row sum over the tokens reading it).

Log-probs use the fused op: the backbone's hidden states times the LM head's weight through
``linear_token_logprobs``, so ``[T, V]`` logits never exist at once (a head with a bias, or
with tied scaling, falls back to the logits path).
"""

from __future__ import annotations

import torch

from agentrl_fast.models.attention import packed_forward
from agentrl_fast.models.packing import SharedLayout
from agentrl_fast.models.wrappers import is_sharded, unwrap
from agentrl_fast.ops import linear_token_logprobs, token_logprobs

IGNORE_INDEX = -100


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``labels[r] = input_ids[r + 1]`` when row ``r + 1`` is in the same sequence, else
    ``IGNORE_INDEX``: row ``r`` predicts the next token of its own sequence only.
    ``input_ids [T]`` int64, ``cu_seqlens [B+1]`` int32 -> ``[T]`` int64."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    if input_ids.numel() > 1:
        labels[:-1] = input_ids[1:]
    ends = cu_seqlens[1:].long() - 1
    ends = ends[(ends >= 0) & (cu_seqlens[1:] > cu_seqlens[:-1])]
    labels[ends] = IGNORE_INDEX
    return labels


def rows_to_tokens(per_row: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move per-row outputs to the token they are about: ``out[t] = per_row[t - 1]`` within
    each sequence, 0 at each sequence's first token. ``per_row [T]`` -> ``[T]``."""
    out = torch.zeros_like(per_row)
    if per_row.numel() > 1:
        out[1:] = per_row[:-1]
    starts = cu_seqlens[:-1].long()
    starts = starts[cu_seqlens[1:] > cu_seqlens[:-1]]
    out[starts] = 0
    return out


def packed_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, layout: SharedLayout | None) -> dict:
    """``packed_forward``'s arguments: the plain packing's (``input_ids [1, T]``), or with
    ``layout`` (which must describe those ``T`` tokens) its shared rows' and ``prefix_of``."""
    if layout is None:
        return {"input_ids": input_ids, "position_ids": position_ids, "cu_seqlens": cu_seqlens,
                "max_seqlen": max_seqlen}
    if layout.num_tokens != input_ids.shape[1]:
        raise ValueError(f"layout describes {layout.num_tokens} tokens but input_ids has "
                         f"{input_ids.shape[1]}; build it from the same sequences (pack_shared)")
    return dict(zip(("input_ids", "position_ids", "cu_seqlens", "max_seqlen"),
                    layout.model_inputs()), prefix_of=layout.attention_prefix_of)


def _head_rows(input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
               token_mask: torch.Tensor | None, layout: SharedLayout | None):
    """``(rows [N], tokens [N], labels [N])``: the model rows that go through the LM head and
    the token each one is about (its label); ``(None, None, labels [T])`` for every row of the
    plain packing. ``input_ids [T]``."""
    if token_mask is not None and (token_mask.shape != input_ids.shape
                                   or token_mask.dtype != torch.bool):
        raise ValueError(f"token_mask must be a bool tensor of shape {tuple(input_ids.shape)} "
                         f"(one per token), got {token_mask.dtype} {tuple(token_mask.shape)}")
    if layout is not None:
        wanted = layout.prev_rows >= 0
        if token_mask is not None:
            wanted = wanted & token_mask
        tokens = torch.nonzero(wanted).squeeze(1)
        return layout.prev_rows[tokens], tokens, input_ids[tokens]
    labels = next_token_labels(input_ids, cu_seqlens)
    if token_mask is None:
        return None, None, labels
    wanted = torch.zeros_like(token_mask)
    wanted[:-1] = token_mask[1:]
    rows = torch.nonzero(wanted & (labels != IGNORE_INDEX)).squeeze(1)
    return rows, rows + 1, labels[rows]  # row r is about token r + 1


def policy_logprobs(policy: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    cu_seqlens: torch.Tensor, max_seqlen: int, *, temperature: float = 1.0,
                    return_entropy: bool = False, return_hidden: bool = False,
                    token_mask: torch.Tensor | None = None, layout: SharedLayout | None = None):
    """``logp [T]`` float32 (then ``entropy [T]`` with ``return_entropy``, then the backbone's
    last hidden states ``[T, H]`` with ``return_hidden``, for a shared value head) of each token
    under ``policy`` (an HF causal LM on packed attention) at ``temperature``; 0 at each
    sequence's first token. ``input_ids``/``position_ids`` ``[1, T]``.

    ``token_mask [T]`` (bool): only these tokens' log-probs (and entropies) are computed, the
    others are 0 — the LM head and the softmax run on their rows alone. RL passes the action
    mask: in a multi-turn trace most tokens are prompt and tool output (about 9 in 10 in the
    built-in environment), whose log-probs no loss reads.

    ``layout``: the same sequences with shared prefixes (:func:`pack_shared`); the model runs
    on its rows, the outputs (hidden states included: ``hidden[t]`` is token ``t``'s row) are in
    the plain packing's token order as without it."""
    module = unwrap(policy)
    head = module.get_output_embeddings()
    backbone = getattr(module, getattr(module, "base_model_prefix", "model"), None)
    inputs = packed_inputs(input_ids, position_ids, cu_seqlens, max_seqlen, layout)
    rows, tokens, labels = _head_rows(input_ids[0], cu_seqlens, token_mask, layout)
    # A sharded or wrapped model runs whole (its forward gathers the shards / syncs gradients).
    plain_head = (not is_sharded(policy) and backbone is not None
                  and isinstance(head, torch.nn.Linear)
                  and getattr(module.config, "logit_scale", None) is None
                  and getattr(module.config, "final_logit_softcapping", None) is None)
    hidden = None
    if plain_head:
        hidden = packed_forward(backbone, **inputs, validate=False).last_hidden_state[0]
        picked = hidden if rows is None else hidden.index_select(0, rows)
        if head.bias is None:  # fused: the [T, V] logits never exist at once
            out = linear_token_logprobs(picked, head.weight.to(hidden.dtype), labels,
                                        temperature=temperature, return_entropy=return_entropy)
        else:
            out = token_logprobs(head(picked), labels, temperature=temperature,
                                 return_entropy=return_entropy)
    else:
        if return_hidden:
            raise ValueError("return_hidden needs an unsharded policy with a linear LM head "
                             "without logit scaling or softcapping (a shared value head reads the "
                             "backbone's hidden states)")
        logits = packed_forward(policy, **inputs, validate=False).logits[0]
        out = token_logprobs(logits if rows is None else logits.index_select(0, rows), labels,
                             temperature=temperature, return_entropy=return_entropy)
    out = list(out) if return_entropy else [out]
    if tokens is None:
        out = [rows_to_tokens(x, cu_seqlens) for x in out]
    else:
        out = [x.new_zeros(input_ids.shape[1]).index_put((tokens,), x) for x in out]
    if return_hidden:
        out.append(hidden if layout is None else hidden.index_select(0, layout.rows))
    return out[0] if len(out) == 1 else tuple(out)
