"""The Triton path of ``ppo_loss`` and ``value_loss``: launchers of the kernels of
``agentrl_fast/kernels/ppo_loss.py`` (preallocated outputs, so the interpreter tests can poison them) and the
registered ops around them (``torch.library.custom_op`` with fakes and autograd, so
``torch.compile`` traces them). The kernels compute in float32; arguments are checked by the
caller. triton is imported on the first launch, not with this module."""

from __future__ import annotations

import torch

from agentrl_fast.ops._loss_checks import KL_ESTIMATORS, PPOOptions

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Metric names, in the order of the Triton kernel's metrics columns (agentrl_fast/kernels/ppo_loss.py).
PPO_METRICS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "action_tokens", "pg_clipfrac_upper",
               "pg_clipfrac_lower", "pg_clipfrac_dual", "approx_kl", "ratio_mean", "ratio_max",
               "kl_mean", "entropy_mean")
VALUE_METRICS = ("loss", "action_tokens", "vf_clipfrac", "vf_mse")
_NUM_COLUMNS = 16



def _kernels():
    from agentrl_fast.kernels import ppo_loss as kernels  # noqa: PLC0415 (triton imported lazily)

    return kernels


def _blocks(num_tokens: int, block: int) -> int:
    return max(1, -(-num_tokens // block))


def launch_ppo_loss_forward(logprobs, old_logprobs, advantages, action_mask, weights, ref_logprobs,
                            entropy, rollout_logprobs, clip_low, clip_high, dual_clip, kl_coef,
                            kl_estimator, entropy_coef, tis_cap, token_mean, count_override,
                            *, dlogp, dentropy, partials, metrics) -> None:
    """Runs the forward and finalize kernels into preallocated outputs: ``dlogp[T]`` /
    ``dentropy[T]`` float32 (or None: not needed), ``partials[blocks, 16]`` float32,
    ``metrics[16]`` float32 (``PPO_METRICS`` order; column 15 the scale). ``kl_estimator``:
    0 none, 1..3 = k1..k3; ``dual_clip <= 0``: none."""
    k = _kernels()
    num_tokens = logprobs.shape[0]
    grid = (_blocks(num_tokens, k.BLOCK),)
    dummy = logprobs
    k.ppo_loss_forward_kernel[grid](
        logprobs, old_logprobs, advantages, action_mask.view(torch.uint8),
        dummy if weights is None else weights, dummy if ref_logprobs is None else ref_logprobs,
        dummy if entropy is None else entropy,
        dummy if rollout_logprobs is None else rollout_logprobs,
        partials if dlogp is None else dlogp, partials if dentropy is None else dentropy, partials,
        num_tokens, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tis_cap,
        HAS_WEIGHTS=weights is not None, HAS_DUAL=dual_clip > 0, KL=kl_estimator,
        HAS_ENTROPY=entropy is not None, HAS_ROLLOUT=rollout_logprobs is not None,
        NEED_GRAD_LOGP=dlogp is not None, NEED_GRAD_ENTROPY=dentropy is not None,
        BLOCK=k.BLOCK, NUM_COLUMNS=k.NUM_COLUMNS, num_warps=k.NUM_WARPS, num_stages=1)
    k.loss_finalize_kernel[(1,)](
        partials, metrics, grid[0], count_override, TOKEN_MEAN=token_mean, USED=k.PPO_USED,
        COUNT_COLUMN=k.PPO_COUNT, MAX_COLUMN=k.PPO_RATIO_MAX, SCALED=k.PPO_SCALED,
        MEANS=k.PPO_MEANS, NUM_COLUMNS=k.NUM_COLUMNS, BLOCK_ROWS=k.FINALIZE_BLOCK,
        num_warps=k.NUM_WARPS, num_stages=1)


def launch_value_loss_forward(values, old_values, returns, action_mask, weights, clip, token_mean,
                              count_override, *, dvalues, partials, metrics) -> None:
    """Value-loss forward + finalize into preallocated outputs (``VALUE_METRICS`` order;
    ``clip <= 0``: no clipping; ``dvalues`` None: not needed)."""
    k = _kernels()
    num_tokens = values.shape[0]
    grid = (_blocks(num_tokens, k.BLOCK),)
    k.value_loss_forward_kernel[grid](
        values, old_values, returns, action_mask.view(torch.uint8),
        values if weights is None else weights, partials if dvalues is None else dvalues, partials,
        num_tokens, clip, HAS_WEIGHTS=weights is not None, HAS_CLIP=clip > 0,
        NEED_GRAD=dvalues is not None, BLOCK=k.BLOCK, NUM_COLUMNS=k.NUM_COLUMNS,
        num_warps=k.NUM_WARPS, num_stages=1)
    k.loss_finalize_kernel[(1,)](
        partials, metrics, grid[0], count_override, TOKEN_MEAN=token_mean, USED=k.VALUE_USED,
        COUNT_COLUMN=k.VALUE_COUNT, MAX_COLUMN=-1, SCALED=k.VALUE_SCALED, MEANS=k.VALUE_MEANS,
        NUM_COLUMNS=k.NUM_COLUMNS, BLOCK_ROWS=k.FINALIZE_BLOCK, num_warps=k.NUM_WARPS,
        num_stages=1)


def launch_scale_gradient(d, grad_out, metrics, *, out) -> None:
    """``out[t] = d[t] * grad_out * metrics[15]`` (``out`` preallocated, any float dtype)."""
    k = _kernels()
    num_tokens = d.shape[0]
    k.scale_gradient_kernel[(_blocks(num_tokens, k.BLOCK),)](
        d, grad_out, metrics, out, num_tokens, SCALE_COLUMN=k.SCALE_COLUMN, BLOCK=k.BLOCK,
        num_warps=k.NUM_WARPS, num_stages=1)


def _num_partials(num_tokens: int) -> int:
    return _blocks(num_tokens, 1024)  # == kernels.BLOCK (kept here so fakes need no triton)


@torch.library.custom_op("agentrl_fast::ppo_loss_forward", mutates_args=())
def _ppo_loss_forward(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      action_mask: torch.Tensor, weights: torch.Tensor | None,
                      ref_logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
                      rollout_logprobs: torch.Tensor | None, clip_low: float, clip_high: float,
                      dual_clip: float, kl_coef: float, kl_estimator: int, entropy_coef: float,
                      tis_cap: float, token_mean: bool, count_override: float,
                      need_grad_logprobs: bool, need_grad_entropy: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(metrics[16], dlogp[T or 0], dentropy[T or 0])`` (float32)."""
    num_tokens = logprobs.shape[0]
    f32 = dict(dtype=torch.float32, device=logprobs.device)
    dlogp = torch.empty(num_tokens if need_grad_logprobs else 0, **f32)
    dentropy = torch.empty(num_tokens if need_grad_entropy else 0, **f32)
    partials = torch.empty(_num_partials(num_tokens), _NUM_COLUMNS, **f32)
    metrics = torch.empty(_NUM_COLUMNS, **f32)
    launch_ppo_loss_forward(logprobs, old_logprobs, advantages, action_mask, weights, ref_logprobs,
                            entropy, rollout_logprobs, clip_low, clip_high, dual_clip, kl_coef,
                            kl_estimator, entropy_coef, tis_cap, token_mean, count_override,
                            dlogp=dlogp if need_grad_logprobs else None,
                            dentropy=dentropy if need_grad_entropy else None,
                            partials=partials, metrics=metrics)
    return metrics, dlogp, dentropy


@_ppo_loss_forward.register_fake
def _ppo_loss_forward_fake(logprobs, old_logprobs, advantages, action_mask, weights, ref_logprobs,
                           entropy, rollout_logprobs, clip_low, clip_high, dual_clip, kl_coef,
                           kl_estimator, entropy_coef, tis_cap, token_mean, count_override,
                           need_grad_logprobs, need_grad_entropy):
    num_tokens = logprobs.shape[0]
    return (logprobs.new_empty(_NUM_COLUMNS, dtype=torch.float32),
            logprobs.new_empty(num_tokens if need_grad_logprobs else 0, dtype=torch.float32),
            logprobs.new_empty(num_tokens if need_grad_entropy else 0, dtype=torch.float32))


@torch.library.custom_op("agentrl_fast::loss_scale_gradient", mutates_args=())
def _scale_gradient(d: torch.Tensor, grad_metrics: torch.Tensor, metrics: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """``d * grad_metrics[0] * metrics[15]`` in ``dtype`` (the backward of the weighted sum)."""
    out = torch.empty(d.shape, dtype=dtype, device=d.device)
    launch_scale_gradient(d, grad_metrics, metrics, out=out)
    return out


@_scale_gradient.register_fake
def _scale_gradient_fake(d, grad_metrics, metrics, dtype):
    return torch.empty(d.shape, dtype=dtype, device=d.device)


def _ppo_setup_context(ctx, inputs, output):
    metrics, dlogp, dentropy = output
    ctx.save_for_backward(metrics, dlogp, dentropy)
    ctx.dtypes = (inputs[0].dtype, None if inputs[6] is None else inputs[6].dtype)
    ctx.mark_non_differentiable(dlogp, dentropy)


def _ppo_backward(ctx, grad_metrics, _grad_dlogp, _grad_dentropy):
    metrics, dlogp, dentropy = ctx.saved_tensors
    grad_metrics = grad_metrics.contiguous()
    grads = [None] * 19
    if ctx.needs_input_grad[0]:
        grads[0] = _scale_gradient(dlogp, grad_metrics, metrics, ctx.dtypes[0])
    if ctx.needs_input_grad[6]:
        grads[6] = _scale_gradient(dentropy, grad_metrics, metrics, ctx.dtypes[1])
    return tuple(grads)


_ppo_loss_forward.register_autograd(_ppo_backward, setup_context=_ppo_setup_context)


@torch.library.custom_op("agentrl_fast::value_loss_forward", mutates_args=())
def _value_loss_forward(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        action_mask: torch.Tensor, weights: torch.Tensor | None, clip: float,
                        token_mean: bool, count_override: float, need_grad: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(metrics[16], dvalues[T or 0])`` (float32)."""
    num_tokens = values.shape[0]
    f32 = dict(dtype=torch.float32, device=values.device)
    dvalues = torch.empty(num_tokens if need_grad else 0, **f32)
    partials = torch.empty(_num_partials(num_tokens), _NUM_COLUMNS, **f32)
    metrics = torch.empty(_NUM_COLUMNS, **f32)
    launch_value_loss_forward(values, old_values, returns, action_mask, weights, clip, token_mean,
                              count_override, dvalues=dvalues if need_grad else None,
                              partials=partials, metrics=metrics)
    return metrics, dvalues


@_value_loss_forward.register_fake
def _value_loss_forward_fake(values, old_values, returns, action_mask, weights, clip, token_mean,
                             count_override, need_grad):
    return (values.new_empty(_NUM_COLUMNS, dtype=torch.float32),
            values.new_empty(values.shape[0] if need_grad else 0, dtype=torch.float32))


def _value_setup_context(ctx, inputs, output):
    metrics, dvalues = output
    ctx.save_for_backward(metrics, dvalues)
    ctx.dtype = inputs[0].dtype
    ctx.mark_non_differentiable(dvalues)


def _value_backward(ctx, grad_metrics, _grad_dvalues):
    metrics, dvalues = ctx.saved_tensors
    grads = [None] * 9
    if ctx.needs_input_grad[0]:
        grads[0] = _scale_gradient(dvalues, grad_metrics.contiguous(), metrics, ctx.dtype)
    return tuple(grads)


_value_loss_forward.register_autograd(_value_backward, setup_context=_value_setup_context)


# ---------------------------------------------------------------------------------------------
# Entry points of ppo_loss / value_loss


def _prepared(x, dtypes=TRITON_DTYPES):
    """``x`` in a dtype the kernels read (float32 otherwise), contiguous; None stays None."""
    if x is None:
        return None
    return (x if x.dtype in dtypes else x.float()).contiguous()


def ppo_loss_triton(logprobs, old_logprobs, advantages, action_mask, weights, token_mean,
                    count_override, options: PPOOptions, ref_logprobs, entropy, rollout_logprobs):
    """``(loss, metrics)`` through the registered op: ``weights`` [T] float32 or None (ones;
    with ``token_mean`` the kernel divides by the action tokens, or by ``count_override`` when
    > 0)."""
    grad_enabled = torch.is_grad_enabled()
    metrics, _, _ = _ppo_loss_forward(
        _prepared(logprobs), _prepared(old_logprobs), _prepared(advantages, (torch.float32,)),
        action_mask.contiguous(), _prepared(weights, (torch.float32,)), _prepared(ref_logprobs),
        _prepared(entropy), _prepared(rollout_logprobs), options.clip_low, options.clip_high,
        0.0 if options.dual_clip is None else options.dual_clip, options.kl_coef,
        0 if ref_logprobs is None else 1 + KL_ESTIMATORS.index(options.kl_estimator),
        options.entropy_coef, 1.0 if options.tis_cap is None else options.tis_cap, token_mean,
        count_override, grad_enabled and logprobs.requires_grad,
        grad_enabled and entropy is not None and entropy.requires_grad)
    values = metrics.detach()
    return metrics[0], {name: values[i] for i, name in enumerate(PPO_METRICS) if name != "loss"}


def value_loss_triton(values, old_values, returns, action_mask, weights, clip, token_mean,
                      count_override):
    """``(loss, metrics)`` through the registered op; ``weights``, ``token_mean`` and
    ``count_override`` as in ``ppo_loss_triton``, ``clip`` None or > 0."""
    metrics, _ = _value_loss_forward(
        _prepared(values), _prepared(old_values), _prepared(returns, (torch.float32,)),
        action_mask.contiguous(), _prepared(weights, (torch.float32,)),
        0.0 if clip is None else clip, token_mean, count_override,
        torch.is_grad_enabled() and values.requires_grad)
    detached = metrics.detach()
    return metrics[0], {n: detached[i] for i, n in enumerate(VALUE_METRICS) if n != "loss"}
