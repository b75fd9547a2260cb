"""The backends of ``varlen_attention`` that call other libraries' flash kernels (CUDA), both
of kind ``"autograd"`` (registered ops of their own libraries, so ``torch.compile`` traces
them): ``TORCH`` (``torch.nn.attention.varlen``) and ``FLASH_ATTN`` (flash-attn's
``flash_attn_varlen_func``, when installed).

Their prefix-shared mode (``prefix_of``) is the generic LSE-merge path
(``_varlen_attention_prefix``) over their raw varlen kernels, called with separate query and key
bounds (``cu_seqlens_q != cu_seqlens_k``) for the cross pass, inside our registered prefix ops:
the backward calls each raw backward with the merged out and LSE and sums the prefix's
gradients.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

from agentrl_fast.ops._attention_backends import Backend
from agentrl_fast.ops._varlen_attention_prefix import (generic_prefix_backward,
                                                       generic_prefix_forward, varlen_passes)


def _flash_kernel_unsupported(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """What flash-attention kernels (torch's varlen, flash-attn) do not take."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"its flash kernels take float16/bfloat16 only, got {q.dtype}"
    if q.shape[2] % 8 != 0:
        return f"its flash kernels need head_dim % 8 == 0, got {q.shape[2]}"
    return None


# The flash kernels reject T = 0 (no token to attend from or to); these are the results there.

def _no_tokens_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool):
    """``(out[0, Hq, D], lse[Hq, 0] | None)`` of an empty batch, ``out`` still a function of
    q, k, v so their (empty) gradients exist as for every other backend."""
    out = q * 0 + (k.sum() + v.sum()) * 0
    return out, (q.new_zeros((q.shape[1], 0), dtype=torch.float32) if need_lse else None)


def _no_tokens_forward(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A raw pass with no query or no key row: ``out`` zeros, ``lse`` -inf (it sees no key)."""
    return (q.new_zeros(q.shape),
            torch.full((q.shape[1], q.shape[0]), -torch.inf, device=q.device))


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

    if q.shape[0] == 0:
        return _no_tokens_run(q, k, v, need_lse)

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


def _torch_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic):
    """torch's flash kernel with separate query and key bounds (``aten::_flash_attention_forward``,
    what ``varlen_attn`` runs; called directly so the LSE format is always flash's, never
    cuDNN's): ``(out[Tq, Hq, D], lse[Hq, Tq] float32)``. GQA is native to the kernel."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _no_tokens_forward(q, k)
    kwargs = {"scale": scale}
    if deterministic and "num_splits" in _aten_parameters("_flash_attention_forward"):
        kwargs["num_splits"] = 1
    result = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal,
        False, **kwargs)
    return result[0], result[1]


def _torch_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                           deterministic):
    """``aten::_flash_attention_backward`` with separate bounds: ``(dq, dk, dv)``. Its kernel
    is deterministic under ``torch.use_deterministic_algorithms(True)``."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # No dropout: the RNG state is not read (torch's varlen_attn passes zeros as well).
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
        lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale)
    return dq, dk, dv


@functools.cache
def _aten_parameters(name: str) -> frozenset[str]:
    return frozenset(a.name for a in getattr(torch.ops.aten, name).default._schema.arguments)


_TORCH_PASSES = varlen_passes(_torch_varlen_forward, _torch_varlen_backward)
TORCH = Backend("torch", "autograd", _torch_unavailable, run=_torch_run,
                unsupported=_flash_kernel_unsupported,
                prefix_forward=functools.partial(generic_prefix_forward, _TORCH_PASSES),
                prefix_backward=functools.partial(generic_prefix_backward, _TORCH_PASSES))


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

    if q.shape[0] == 0:
        return _no_tokens_run(q, k, v, need_lse)
    result = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                    softmax_scale=scale, causal=causal, deterministic=deterministic,
                                    return_attn_probs=need_lse)
    if need_lse:
        out, lse = result[0], result[1]
        return out, lse.detach().float()  # the LSE is not differentiable (its grad is dropped)
    return result, None


def _flash_attn_raw():
    """flash-attn's raw varlen forward and backward (its torch ops, flash-attn >= 2.6)."""
    from flash_attn import flash_attn_interface as interface

    forward = getattr(interface, "_wrapped_flash_attn_varlen_forward", None)
    backward = getattr(interface, "_wrapped_flash_attn_varlen_backward", None)
    if forward is None or backward is None:
        raise ValueError("the flash_attn backend's prefix mode (prefix_of) needs flash-attn >= "
                         "2.6 (its _wrapped_flash_attn_varlen_forward/_backward)")
    return forward, backward


def _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic):
    """``_flash_attn_varlen_forward`` (what ``flash_attn_varlen_func`` runs) with separate
    query and key bounds: ``(out[Tq, Hq, D], lse[Hq, Tq] float32)``; GQA native."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _no_tokens_forward(q, k)
    forward, _ = _flash_attn_raw()
    result = forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k,
                     0.0, scale, causal, window_size_left=-1, window_size_right=-1,
                     softcap=0.0, alibi_slopes=None, return_softmax=False)
    return result[0], result[1]


def _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal,
                                scale, deterministic):
    """``_flash_attn_varlen_backward`` with separate bounds: ``(dq, dk, dv)`` (it fills the
    buffers it is given; deterministic when asked)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _, backward = _flash_attn_raw()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), dq, dk, dv, cu_q,
             cu_k, max_q, max_k, 0.0, scale, causal, -1, -1, 0.0, None, deterministic,
             rng_state=None)
    return dq, dk, dv


_FLASH_ATTN_PASSES = varlen_passes(_flash_attn_varlen_forward, _flash_attn_varlen_backward)
FLASH_ATTN = Backend("flash_attn", "autograd", _flash_attn_unavailable, run=_flash_attn_run,
                     unsupported=_flash_kernel_unsupported,
                     prefix_forward=functools.partial(generic_prefix_forward, _FLASH_ATTN_PASSES),
                     prefix_backward=functools.partial(generic_prefix_backward,
                                                       _FLASH_ATTN_PASSES))
