"""The registry of ``varlen_attention`` backends, apart from the backends and the dispatch so
that both can import it (``varlen_attention`` registers the built-in backends, in this order:
reference, native, cpu_flash, torch, flash_attn, triton)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Backend:
    """One way to compute varlen attention.

    ``unavailable(device) -> str | None`` says why the backend cannot run on a device (None: it
    can). Kind ``"op"``: ``forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic,
    out, lse)`` fills ``out[T, Hq, D]`` and ``lse[Hq, T]`` (float32); ``backward(dout, q, k, v,
    out, lse, cu_seqlens, max_seqlen, causal, scale, deterministic, dq, dk, dv)`` fills the
    gradients. Kind ``"autograd"``: ``run(q, k, v, cu_seqlens, max_seqlen, causal, scale,
    deterministic, need_lse) -> (out, lse or None)``, differentiable by itself.

    Prefix-shared mode (``prefix_of``; optional, kind ``"op"`` only, causal implied):
    ``prefix_forward(q, k, v, cu_seqlens, prefix_of, max_seqlen, scale, deterministic, out,
    lse)`` fills ``out`` and ``lse`` (over the prefix's keys and the own causal keys);
    ``prefix_backward(dout, q, k, v, out, lse, cu_seqlens, prefix_of, max_seqlen, scale,
    deterministic, dq, dk, dv)`` fills the gradients, a prefix's dk/dv summed over its own
    queries and all its suffixes' queries. A backend without them runs the generic LSE-merge
    path over its plain forward/backward (``_varlen_attention_prefix``).
    """

    name: str
    kind: str
    unavailable: Callable[[torch.device], str | None]
    forward: Callable | None = None
    backward: Callable | None = None
    run: Callable | None = None
    # unsupported(q, k) -> str | None: why these inputs (dtype, head_dim, ...) are out of the
    # backend's reach; "auto" skips such backends, an explicit choice raises with the reason.
    unsupported: Callable[[torch.Tensor, torch.Tensor], str | None] = lambda q, k: None
    # Native prefix-shared mode (see above); None: the generic LSE-merge path.
    prefix_forward: Callable | None = None
    prefix_backward: Callable | None = None


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend."""
    if backend.kind not in ("op", "autograd"):
        raise ValueError(f"backend kind must be 'op' or 'autograd', got {backend.kind!r}")
    BACKENDS[backend.name] = backend
