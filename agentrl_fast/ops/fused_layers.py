"""Fused elementwise layers of Llama-family decoders: RMSNorm and SwiGLU, forward and backward.

``rms_norm(x, weight, eps)`` is ``weight * (x / sqrt(mean(x^2, -1) + eps)).to(x.dtype)`` with the
mean and product in float32 (HF's ``LlamaRMSNorm`` / ``Qwen3RMSNorm``); ``swiglu(gate, up)`` is
``silu(gate) * up`` (the input of a SwiGLU MLP's down projection). Both are differentiable in
every tensor argument.

On the CPU they run our C++ kernels (``csrc/fused_layers.cpp``): one pass over memory per
direction where HF's modules run 6-10 separate elementwise kernels, which is most of the
non-matmul time of a small model's training step. Elsewhere (and for tensors the kernels do not
take: mixed dtypes) they run the same formulas as torch ops. Float64 references:
``agentrl_fast.ops.reference.rms_norm_reference`` / ``swiglu_reference``.
"""

from __future__ import annotations

import torch

from agentrl_fast.ops._checks import require_real, require_tensor

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


_HAS_KERNELS: bool | None = None


def _native(*tensors: torch.Tensor) -> bool:
    global _HAS_KERNELS
    if _HAS_KERNELS is None:
        from agentrl_fast import _native  # loads the extension
        _HAS_KERNELS = _native.has_kernel("rms_norm_cpu_out", "CPU")
    first = tensors[0]
    return (_HAS_KERNELS and first.device.type == "cpu" and first.dtype in _DTYPES
            and all(t.device == first.device and t.dtype == first.dtype for t in tensors))


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rms_norm_rows(rows: torch.Tensor, weight: torch.Tensor, eps: float):
    y = torch.empty_like(rows)
    rstd = torch.empty(rows.shape[0], dtype=torch.float64 if rows.dtype == torch.float64
                       else torch.float32)
    torch.ops.agentrl_fast.rms_norm_cpu_out(rows, weight.contiguous(), eps, y, rstd)
    return y, rstd


def _swiglu_out(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    torch.ops.agentrl_fast.swiglu_cpu_out(gate, up, out)
    return out


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = _rms_norm_rows(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, rstd = ctx.saved_tensors
        dx = torch.empty_like(rows)
        dweight = torch.empty(weight.shape[0], dtype=torch.float64 if rows.dtype == torch.float64
                              else torch.float32)
        torch.ops.agentrl_fast.rms_norm_cpu_backward_out(
            dy.reshape(rows.shape).contiguous(), rows, weight.contiguous(), rstd, dx, dweight)
        return dx.view(dy.shape), dweight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of ``x [..., D]`` with ``weight [D]`` (see the module docstring)."""
    require_tensor("x", x)
    require_tensor("weight", weight)
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    eps = require_real("eps", eps)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [D] with D = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if not _native(x, weight) or x.numel() == 0:
        return _rms_norm_torch(x, weight, eps)
    if not _needs_grad(x, weight):
        return _rms_norm_rows(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps)[0].view(x.shape)
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _swiglu_out(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        torch.ops.agentrl_fast.swiglu_cpu_backward_out(dout.contiguous(), gate, up, dgate, dup)
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for tensors of one shape."""
    require_tensor("gate", gate)
    require_tensor("up", up)
    if not (gate.is_floating_point() and up.is_floating_point()):
        raise TypeError(f"gate and up must be floating point, got {gate.dtype} and {up.dtype}")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if not _native(gate, up) or gate.numel() == 0:
        return torch.nn.functional.silu(gate) * up
    if not _needs_grad(gate, up):
        return _swiglu_out(gate.contiguous(), up.contiguous())
    return _SwiGLU.apply(gate, up)
