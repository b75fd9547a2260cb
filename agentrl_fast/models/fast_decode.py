"""A lean forward for sampling from Llama-family HF decoders (Qwen3, Qwen2, Llama: RMSNorm,
rotary, grouped-query attention, SwiGLU) over a preallocated KV cache.

HF's ``forward`` rebuilds masks, rotary tables and cache objects on every call; for the small
policies this library trains on a CPU that bookkeeping costs more than the arithmetic of a decode
step (about 6 ms against well under 1 ms for a 2-layer model). :class:`FastDecoder` runs the same
arithmetic on the model's own parameters (q/k/v and gate/up fused into one matrix each, rebuilt
when a parameter changes), the way an inference engine keeps its own model code: one tensor per
layer for keys and one for values, written in place, and one boolean mask of the columns each
row may read. :func:`fast_decoder` returns ``None`` for a model it does not cover, and
:class:`~agentrl_fast.generators.torch_generator.TorchGenerator` then runs HF's ``forward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrl_fast.ops.fused_layers import rms_norm, swiglu


def fast_decoder(model: torch.nn.Module) -> "FastDecoder | None":
    """A :class:`FastDecoder` for ``model`` if it is a causal LM of the Llama family that the
    lean forward reproduces (full attention in every layer, SiLU MLP, bias-free MLP and output
    projection), else ``None``."""
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if config is None or base is None or not isinstance(head, torch.nn.Linear):
        return None
    if getattr(config, "model_type", None) not in ("qwen3", "qwen2", "llama"):
        return None
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(base, name) for name in needed):
        return None
    if getattr(config, "hidden_act", None) != "silu":
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    for layer in base.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or mlp is None:
            return None
        if getattr(attention, "sliding_window", None) is not None:
            return None
        projections = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, torch.nn.Linear) for p in projections):
            return None
        if any(p.bias is not None for p in projections[3:]):
            return None
        if not hasattr(layer, "input_layernorm") or not hasattr(layer, "post_attention_layernorm"):
            return None
    return FastDecoder(model)


class FastDecoder:
    """The decode-time forward of a model :func:`fast_decoder` accepts.

    :meth:`start` takes a left-padded batch and returns a :class:`DecodeState` holding the KV
    cache; :meth:`forward` appends tokens to it and returns the logits of each row's last new
    token."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self._stamp = None
        self._layers: list[dict] = []

    def refresh(self, stamp: tuple) -> None:
        """Rebuild the fused matrices if the model's parameters changed (``stamp``:
        :func:`~agentrl_fast.generators.base.parameter_stamp` of the model, taken by the
        caller once per batch)."""
        if stamp != self._stamp:
            layers = []
            for layer in self.model.model.layers:
                a, m = layer.self_attn, layer.mlp
                biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
                qkv_bias = None
                if any(b is not None for b in biases):
                    qkv_bias = torch.cat([b if b is not None else torch.zeros(p.out_features,
                                          device=p.weight.device, dtype=p.weight.dtype)
                                          for b, p in zip(biases, (a.q_proj, a.k_proj, a.v_proj))])
                layers.append(dict(
                    norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                    qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                    qkv_bias=None if qkv_bias is None else qkv_bias.detach(),
                    q_norm=getattr(getattr(a, "q_norm", None), "weight", None),
                    k_norm=getattr(getattr(a, "k_norm", None), "weight", None),
                    o=a.o_proj.weight, scaling=getattr(a, "scaling", self.head_dim ** -0.5),
                    gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                    down=m.down_proj.weight))
            self._layers, self._stamp = layers, stamp

    def start(self, batch: int, columns: int, device: torch.device) -> "DecodeState":
        """An empty cache of ``columns`` positions for ``batch`` rows."""
        shape = (len(self.model.model.layers), 2, batch, self.kv_heads, columns, self.head_dim)
        return DecodeState(
            torch.zeros(shape, device=device, dtype=self.model.lm_head.weight.dtype),
            torch.zeros((batch, columns), dtype=torch.bool, device=device))

    @torch.no_grad()
    def forward(self, state: "DecodeState", input_ids: torch.Tensor, position_ids: torch.Tensor,
                real: torch.Tensor) -> torch.Tensor:
        """Append ``input_ids [B, W]`` (at ``position_ids [B, W]``; ``real [B, W]`` marks the
        non-padding ones) at the cache's next ``W`` columns; returns ``[B, V]`` logits of each
        row's last column."""
        if self._stamp is None:
            raise RuntimeError("FastDecoder.forward: call refresh(parameter_stamp(model)) first")
        batch, width = input_ids.shape
        start = state.length
        stop = start + width
        state.valid[:, start:stop] = real
        state.length = stop
        base = self.model.model
        x = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(x, position_ids)
        cos, sin = cos[:, :, None], sin[:, :, None]
        half = self.head_dim // 2
        # Row j of the new block reads the valid columns up to its own; a padding query also
        # reads itself, so no row of the softmax is empty.
        mask = state.valid[:, None, None, :stop].expand(batch, 1, width, stop)
        if width > 1:
            causal = torch.ones(width, stop, dtype=torch.bool, device=x.device).tril(start)
            diagonal = torch.zeros(width, stop, dtype=torch.bool, device=x.device)
            diagonal[:, start:].fill_diagonal_(True)
            mask = (mask & causal) | diagonal
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim

        def rotate(t: torch.Tensor) -> torch.Tensor:
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

        for w, (keys, values) in zip(self._layers, state.cache):
            h = rms_norm(x, w["norm"], self.eps)
            qkv = F.linear(h, w["qkv"], w["qkv_bias"])
            q = qkv[..., :q_size].view(batch, width, self.heads, self.head_dim)
            k = qkv[..., q_size:q_size + kv_size].view(batch, width, self.kv_heads, self.head_dim)
            v = qkv[..., q_size + kv_size:].view(batch, width, self.kv_heads, self.head_dim)
            if w["q_norm"] is not None:
                q = rms_norm(q, w["q_norm"], self.eps)
            if w["k_norm"] is not None:
                k = rms_norm(k, w["k_norm"], self.eps)
            keys[:, :, start:stop] = rotate(k).transpose(1, 2)
            values[:, :, start:stop] = v.transpose(1, 2)
            attended = F.scaled_dot_product_attention(
                rotate(q).transpose(1, 2), keys[:, :, :stop], values[:, :, :stop], attn_mask=mask,
                scale=w["scaling"], enable_gqa=self.kv_heads != self.heads)
            x = x + F.linear(attended.transpose(1, 2).reshape(batch, width, q_size), w["o"])
            gate, up = F.linear(rms_norm(x, w["post_norm"], self.eps), w["gate_up"]).chunk(2, -1)
            x = x + F.linear(swiglu(gate, up), w["down"])
        last = rms_norm(x[:, -1], base.norm.weight, self.eps)
        return self.model.lm_head(last)


class DecodeState:
    """The KV cache of one batch: ``cache [layers, 2, B, H_kv, columns, D]`` (keys, then
    values), ``valid [B, columns]`` (the columns each row may read), and ``length`` (columns
    written)."""

    def __init__(self, cache: torch.Tensor, valid: torch.Tensor):
        self.cache, self.valid = cache, valid
        self.length = 0

    def write_prefix(self, row: int, kv: torch.Tensor, stop: int) -> None:
        """Put kept keys and values (``[layers, 2, H_kv, n, D]``) into ``row`` at columns
        ``[stop - n, stop)``."""
        n = kv.shape[-2]
        self.cache[:, :, row, :, stop - n:stop] = kv
        self.valid[row, stop - n:stop] = True

    def row(self, row: int) -> torch.Tensor:
        """``row``'s keys and values over its valid columns (a copy), ``[layers, 2, H_kv, n,
        D]``."""
        columns = self.valid[row, :self.length].nonzero()[:, 0]
        return self.cache[:, :, row].index_select(-2, columns)

    def select(self, index: torch.Tensor) -> None:
        """Keep only rows ``index`` (in that order)."""
        self.cache = self.cache.index_select(2, index)
        self.valid = self.valid[index]
