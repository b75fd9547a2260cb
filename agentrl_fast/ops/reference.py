"""Float64 references for every op, used by the tests and the benchmarks alike.

They are written for clarity, straight from docs/design.md, with Python loops where the definition
is a loop; none of them shares code with the kernels they check.
"""

import math

import torch


def gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    action_mask: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a packed batch, float64 ``(advantages[T], returns[T])`` on the CPU.

    Within each sequence only action tokens are steps: for action token ``t`` with next action
    token ``n``, ``delta = r_t + gamma * V_n - V_t`` and ``A_t = delta + gamma * lam * A_n``;
    the last action token uses the sequence's bootstrap value and ``A = 0``. Returns are
    ``A + V`` on action tokens; both are 0 elsewhere. ``lam`` may be ``[B]``: sequence ``b``
    uses ``lam[b]``.
    """
    r = rewards.detach().to("cpu", torch.float64).tolist()
    v = values.detach().to("cpu", torch.float64).tolist()
    cu = [int(x) for x in cu_seqlens.tolist()]
    num_tokens = len(r)
    mask = [True] * num_tokens if action_mask is None else action_mask.detach().cpu().tolist()
    boot = [0.0] * (len(cu) - 1) if bootstrap_values is None else (
        bootstrap_values.detach().to("cpu", torch.float64).tolist())
    lams = (lam.detach().to("cpu", torch.float64).tolist() if isinstance(lam, torch.Tensor)
            else [float(lam)] * (len(cu) - 1))
    advantages = [0.0] * num_tokens
    returns = [0.0] * num_tokens
    for b in range(len(cu) - 1):
        lam = lams[b]
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


# --- loss_weights / ppo_loss / value_loss ---------------------------------------------------
def loss_weights_reference(mode: str, action_mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                           rollout_ids: torch.Tensor | None = None, norm_constant: float | None = None,
                           global_tokens: float | None = None,
                           global_sequences: float | None = None) -> torch.Tensor:
    """Per-token weights ``w[T]`` (float64, CPU): 0 on non-action tokens; on action tokens

    - ``token-mean``: ``1 / N_tokens``;  ``token-sum``: ``1``;
    - ``seq-mean-token-sum``: ``1 / N_seq``;  ``seq-mean-token-mean``: ``1 / (n_seq * N_seq)``;
    - ``seq-mean-token-sum-norm``: ``1 / (norm_constant * N_seq)``;
    - ``rollout-mean``: ``1 / (n_rollout * N_rollouts)``, sequences grouped by ``rollout_ids[B]``;

    where ``n_seq`` / ``n_rollout`` count a sequence's / rollout's action tokens and ``N_seq`` /
    ``N_rollouts`` count sequences / rollouts with at least one action token (overridden by
    ``global_tokens`` / ``global_sequences``, which for rollout-mean counts rollouts).
    """
    mask = [bool(x) for x in action_mask.detach().cpu().tolist()]
    num_tokens = len(mask)
    w = [0.0] * num_tokens
    if mode == "token-sum":
        return torch.tensor([1.0 if m else 0.0 for m in mask], dtype=torch.float64)
    if mode == "token-mean":
        n = sum(mask) if global_tokens is None else float(global_tokens)
        return torch.tensor([1.0 / n if m else 0.0 for m in mask], dtype=torch.float64)
    cu = [int(x) for x in cu_seqlens.tolist()]
    spans = list(zip(cu[:-1], cu[1:]))
    counts = [sum(mask[s:e]) for s, e in spans]
    if mode == "rollout-mean":
        ids = [int(x) for x in rollout_ids.tolist()]
        per_rollout: dict[int, int] = {}
        for rid, n in zip(ids, counts):
            per_rollout[rid] = per_rollout.get(rid, 0) + n
        units = sum(1 for n in per_rollout.values() if n > 0)
        units = units if global_sequences is None else float(global_sequences)
        for (s, e), rid in zip(spans, ids):
            for t in range(s, e):
                if mask[t]:
                    w[t] = 1.0 / (per_rollout[rid] * units)
        return torch.tensor(w, dtype=torch.float64)
    units = sum(1 for n in counts if n > 0)
    units = units if global_sequences is None else float(global_sequences)
    for (s, e), n in zip(spans, counts):
        for t in range(s, e):
            if not mask[t]:
                continue
            if mode == "seq-mean-token-sum":
                w[t] = 1.0 / units
            elif mode == "seq-mean-token-mean":
                w[t] = 1.0 / (n * units)
            elif mode == "seq-mean-token-sum-norm":
                w[t] = 1.0 / (float(norm_constant) * units)
            else:
                raise ValueError(f"unknown mode {mode!r}")
    return torch.tensor(w, dtype=torch.float64)


def _f64(x):
    return None if x is None else x.to("cpu", torch.float64)


def _kl_reference(logp, ref, estimator):
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    log_ratio = torch.clamp(ref - logp, -20.0, 20.0)  # verl's low_var_kl
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def ppo_loss_reference(logprobs, old_logprobs, advantages, action_mask, *, weights, clip_low=0.2,
                       clip_high=0.2, dual_clip=None, ref_logprobs=None, kl_coef=0.0,
                       kl_estimator="k3", entropy=None, entropy_coef=0.0, rollout_logprobs=None,
                       tis_cap=None):
    """``(loss, metrics)`` in float64: ``loss = sum_t w_t * l_t`` over action tokens, with
    ``l_t = pg_t * tis_t + kl_coef * KL_t - entropy_coef * entropy_t`` and ``weights`` from
    ``loss_weights_reference`` (or any token weights). Differentiable in ``logprobs`` and
    ``entropy`` when they are float64 leaves that require grad. Metrics are plain means over
    action tokens (``ratio_max`` a max)."""
    logp, old, adv = _f64(logprobs), _f64(old_logprobs), _f64(advantages)
    mask = action_mask.cpu().bool()
    w = _f64(weights)
    total = logp.new_zeros(())
    n = int(mask.sum())
    sums = {k: 0.0 for k in ("clip_upper", "clip_lower", "clip_dual", "approx_kl", "ratio", "kl",
                              "entropy", "pg", "kl_loss", "entropy_loss")}
    ratio_max = 0.0
    for t in torch.nonzero(mask).flatten().tolist():
        ratio = torch.exp(torch.clamp(logp[t] - old[t], -20.0, 20.0))
        clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        pg = torch.maximum(-adv[t] * ratio, -adv[t] * clipped)
        r, a = float(ratio.detach()), float(adv[t])
        sums["clip_upper"] += float(a > 0 and r > 1.0 + clip_high)
        sums["clip_lower"] += float(a < 0 and r < 1.0 - clip_low)
        if dual_clip is not None and a < 0:
            sums["clip_dual"] += float(-a * dual_clip < float(pg.detach()))
            pg = torch.minimum(pg, -adv[t] * dual_clip)
        if rollout_logprobs is not None:
            tis = min(math.exp(min(float(old[t]) - float(rollout_logprobs[t]), 20.0)), tis_cap)
            pg = pg * tis
        term = pg
        sums["pg"] += float(w[t] * pg.detach())
        if ref_logprobs is not None:
            kl = _kl_reference(logp[t], _f64(ref_logprobs)[t], kl_estimator)
            term = term + kl_coef * kl
            sums["kl"] += float(kl.detach())
            sums["kl_loss"] += float(w[t] * kl.detach())
        if entropy is not None:
            ent = _f64(entropy)[t]
            term = term - entropy_coef * ent
            sums["entropy"] += float(ent.detach())
            sums["entropy_loss"] += float(w[t] * ent.detach())
        total = total + w[t] * term
        sums["approx_kl"] += float(old[t] - logp[t].detach())
        sums["ratio"] += r
        ratio_max = max(ratio_max, r)
    d = max(n, 1)
    metrics = {
        "pg_loss": sums["pg"], "kl_loss": sums["kl_loss"], "entropy_loss": sums["entropy_loss"],
        "pg_clipfrac_upper": sums["clip_upper"] / d, "pg_clipfrac_lower": sums["clip_lower"] / d,
        "pg_clipfrac_dual": sums["clip_dual"] / d, "approx_kl": sums["approx_kl"] / d,
        "ratio_mean": sums["ratio"] / d, "ratio_max": ratio_max, "kl_mean": sums["kl"] / d,
        "entropy_mean": sums["entropy"] / d, "action_tokens": float(n),
    }
    return total, {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}


def value_loss_reference(values, old_values, returns, action_mask, *, weights, clip=None):
    """``(loss, metrics)`` in float64: ``sum_t w_t * 0.5 * max((v - R)^2, (clip(v, v_old - clip,
    v_old + clip) - R)^2)`` over action tokens (no clipping when ``clip`` is None);
    ``vf_clipfrac``: fraction of action tokens whose clipped term is the larger."""
    v, old, ret = _f64(values), _f64(old_values), _f64(returns)
    mask = action_mask.cpu().bool()
    w = _f64(weights)
    total = v.new_zeros(())
    n = int(mask.sum())
    clipped_count, err = 0.0, 0.0
    for t in torch.nonzero(mask).flatten().tolist():
        loss = (v[t] - ret[t]) ** 2
        if clip is not None:
            vc = torch.clamp(v[t], float(old[t]) - clip, float(old[t]) + clip)
            loss2 = (vc - ret[t]) ** 2
            clipped_count += float(float(loss2.detach()) > float(loss.detach()))
            loss = torch.maximum(loss, loss2)
        total = total + w[t] * 0.5 * loss
        err += float((v[t].detach() - ret[t]) ** 2)
    d = max(n, 1)
    metrics = {"vf_clipfrac": clipped_count / d, "vf_mse": err / d, "action_tokens": float(n)}
    return total, {k: torch.tensor(v_, dtype=torch.float64) for k, v_ in metrics.items()}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float64: ``weight * x / sqrt(mean(x^2) + eps)``."""
    x, weight = x.detach().double(), weight.detach().double()
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float64, ``silu(g) = g / (1 + exp(-g))``."""
    gate, up = gate.detach().double(), up.detach().double()
    return gate / (1 + torch.exp(-gate)) * up
