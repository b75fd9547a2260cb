"""The backends of ``varlen_attention`` that call other libraries' flash kernels (CUDA), both
of kind ``"autograd"`` (registered ops of their own libraries, so ``torch.compile`` traces
them): ``TORCH`` (``torch.nn.attention.varlen``) and ``FLASH_ATTN`` (flash-attn's
``flash_attn_varlen_func``, when installed)."""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

from agentrl_fast.ops._attention_backends import Backend


def _flash_kernel_unsupported(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """What flash-attention kernels (torch's varlen, flash-attn) do not take."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"its flash kernels take float16/bfloat16 only, got {q.dtype}"
    if q.shape[2] % 8 != 0:
        return f"its flash kernels need head_dim % 8 == 0, got {q.shape[2]}"
    if q.shape[0] == 0:
        return "its flash kernels need at least one token"
    return None


# ---------------------------------------------------------------------------------------------
# The "torch" backend: torch.nn.attention.varlen (flash kernels, CUDA only).

@functools.lru_cache(maxsize=None)
def _torch_varlen_parameters() -> frozenset[str] | None:
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    fn = getattr(varlen, "varlen_attn", None)
    return None if fn is None else frozenset(inspect.signature(fn).parameters)


def _torch_unavailable(device: torch.device) -> str | None:
    if _torch_varlen_parameters() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if device.type != "cuda":
        return "torch's varlen attention runs on CUDA only"
    return None


def _torch_run(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, need_lse):
    from torch.nn.attention import varlen

    params = _torch_varlen_parameters()
    kwargs = {"scale": scale}
    # The causal flag moved: torch 2.10/2.11 take is_causal, later ones a window (-1, 0).
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        raise ValueError("this torch's varlen_attn supports no causal mask; use another backend")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older torch: expand the KV heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    if deterministic and "num_splits" in params:
        kwargs["num_splits"] = 1
    if need_lse and hasattr(varlen, "AuxRequest"):
        out, lse = varlen.varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      return_aux=varlen.AuxRequest(lse=True), **kwargs)
        return out, lse.detach().float()  # the LSE is not differentiable (its grad is dropped)
    if need_lse:
        raise ValueError("this torch's varlen_attn cannot return the LSE; use another backend")
    out = varlen.varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    return out, None


TORCH = Backend("torch", "autograd", _torch_unavailable, run=_torch_run,
                unsupported=_flash_kernel_unsupported)


# ---------------------------------------------------------------------------------------------
# The "flash_attn" backend (optional dependency).

def _flash_attn_unavailable(device: torch.device) -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    if device.type != "cuda":
        return "flash-attn runs on CUDA only"
    return None


def _flash_attn_run(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, need_lse):
    from flash_attn import flash_attn_varlen_func

    result = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                    softmax_scale=scale, causal=causal, deterministic=deterministic,
                                    return_attn_probs=need_lse)
    if need_lse:
        out, lse = result[0], result[1]
        return out, lse.detach().float()  # the LSE is not differentiable (its grad is dropped)
    return result, None


FLASH_ATTN = Backend("flash_attn", "autograd", _flash_attn_unavailable, run=_flash_attn_run,
                     unsupported=_flash_kernel_unsupported)
