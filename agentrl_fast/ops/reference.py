"""Float64 references for every op, used by the tests and the benchmarks alike.

They are written for clarity, straight from DESIGN.md, with Python loops where the definition
is a loop; none of them shares code with the kernels they check.
"""

import torch


def gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    action_mask: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a packed batch, float64 ``(advantages[T], returns[T])`` on the CPU.

    Within each sequence only action tokens are steps: for action token ``t`` with next action
    token ``n``, ``delta = r_t + gamma * V_n - V_t`` and ``A_t = delta + gamma * lam * A_n``;
    the last action token uses the sequence's bootstrap value and ``A = 0``. Returns are
    ``A + V`` on action tokens; both are 0 elsewhere.
    """
    r = rewards.detach().to("cpu", torch.float64).tolist()
    v = values.detach().to("cpu", torch.float64).tolist()
    cu = [int(x) for x in cu_seqlens.tolist()]
    num_tokens = len(r)
    mask = [True] * num_tokens if action_mask is None else action_mask.detach().cpu().tolist()
    boot = [0.0] * (len(cu) - 1) if bootstrap_values is None else (
        bootstrap_values.detach().to("cpu", torch.float64).tolist())
    advantages = [0.0] * num_tokens
    returns = [0.0] * num_tokens
    for b in range(len(cu) - 1):
        next_value, next_advantage = boot[b], 0.0
        for t in range(cu[b + 1] - 1, cu[b] - 1, -1):
            if not mask[t]:
                continue
            delta = r[t] + gamma * next_value - v[t]
            advantages[t] = delta + gamma * lam * next_advantage
            returns[t] = advantages[t] + v[t]
            next_value, next_advantage = v[t], advantages[t]
    return (torch.tensor(advantages, dtype=torch.float64),
            torch.tensor(returns, dtype=torch.float64))


def gae_padded_reference(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``compute_gae_advantage_return`` recurrence over padded ``[B, L]`` rows, in
    float64, before whitening: ``(returns - values, returns)`` at every position (on masked
    positions these hold verl's carried-over values)."""
    r = rewards.detach().to("cpu", torch.float64)
    v = values.detach().to("cpu", torch.float64)
    m = mask.detach().to("cpu", torch.float64)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64)
    running = torch.zeros(r.shape[0], dtype=torch.float64)
    advantages = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * running
        next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        running = candidate * m[:, t] + (1 - m[:, t]) * running
        advantages[:, t] = running
    returns = advantages + v
    return advantages, returns


def whiten_reference(advantages: torch.Tensor, action_mask: torch.Tensor, shift_mean: bool = True,
                     eps: float = 1e-8) -> torch.Tensor:
    """Float64 whitening over the action tokens (unbiased variance), 0 elsewhere."""
    x = advantages.detach().to("cpu", torch.float64)
    m = action_mask.detach().cpu()
    selected = x[m]
    out = torch.zeros_like(x)
    if selected.numel() == 0:
        return out
    mean = selected.mean()
    variance = selected.var(unbiased=True) if selected.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    whitened = (selected - mean) / torch.sqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    out[m] = whitened
    return out


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(out[T, Hq, D], lse[Hq, T])`` of attention within each packed sequence.

    Query head ``h`` reads KV head ``h // (Hq // Hk)``; with ``causal`` token ``i`` of a sequence
    sees tokens ``0..i`` of it. Differentiable (float64 autograd) for gradient references.
    """
    q64, k64, v64 = (x.to("cpu", torch.float64) for x in (q, k, v))
    num_tokens, num_heads_q, head_dim = q64.shape
    group = num_heads_q // k64.shape[1]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    outs, lses = [], []
    cu = [int(x) for x in cu_seqlens.tolist()]
    for start, end in zip(cu[:-1], cu[1:]):
        if start == end:
            continue
        head_outs, head_lses = [], []
        for h in range(num_heads_q):
            qh = q64[start:end, h]                      # [L, D]
            kh = k64[start:end, h // group]
            vh = v64[start:end, h // group]
            scores = (qh @ kh.T) * scale                # [L, L]
            if causal:
                length = end - start
                allowed = torch.ones(length, length, dtype=torch.bool).tril()
                scores = scores.masked_fill(~allowed, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)
            head_outs.append(torch.softmax(scores, dim=-1) @ vh)
            head_lses.append(lse)
        outs.append(torch.stack(head_outs, dim=1))      # [L, Hq, D]
        lses.append(torch.stack(head_lses, dim=0))      # [Hq, L]
    if not outs:
        return (q64.new_zeros(num_tokens, num_heads_q, v64.shape[2]),
                q64.new_zeros(num_heads_q, num_tokens))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


# --- token_logprobs / linear_token_logprobs ------------------------------------------------
def token_logprobs_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``logp[...]`` (and ``entropy[...]``), float64 on the device of ``logits``.

    ``logits: [..., V]``, ``labels: [...]`` (already aligned with the rows). With
    ``z = logits / temperature``: ``logp = log_softmax(z)[label]``,
    ``entropy = -sum_j p_j log p_j`` (terms with ``p_j = 0`` count 0). Rows whose label is
    ``ignore_index`` give 0 for both (and no gradient).
    """
    z = logits.to(torch.float64) / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    ignored = labels == ignore_index
    safe_labels = torch.where(ignored, torch.zeros_like(labels), labels).long()
    logp = log_probs.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(ignored, torch.zeros_like(logp), logp)
    if not return_entropy:
        return logp
    probs = log_probs.exp()
    finite = torch.isfinite(log_probs)
    terms = torch.where(finite, probs * torch.where(finite, log_probs, 0.0), 0.0)
    entropy = -terms.sum(-1)
    entropy = torch.where(ignored, torch.zeros_like(entropy), entropy)
    return logp, entropy


def linear_token_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The same from ``hidden[T, H]`` and the LM head ``weight[V, H]``: ``logits = hidden @
    weight.T`` in float64, then ``token_logprobs_reference``."""
    logits = hidden.to(torch.float64) @ weight.to(torch.float64).T
    return token_logprobs_reference(logits, labels, temperature=temperature,
                                    return_entropy=return_entropy, ignore_index=ignore_index)
