"""Tiny HF models built from a config in code (nothing downloaded): the default policy of the
built-in environment, and what tests and examples train on the CPU."""

from __future__ import annotations

import torch


def tiny_qwen3(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
               intermediate_size: int | None = None, max_positions: int = 2048,
               seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``Qwen3ForCausalLM`` (float32, untied LM head, GQA when
    ``num_kv_heads < num_heads``), the same weights for the same ``seed``."""
    import transformers

    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_positions, tie_word_embeddings=False)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = transformers.Qwen3ForCausalLM(config).float()
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def with_token_bias(model: torch.nn.Module, biases: dict[int, float]) -> torch.nn.Module:
    """Give ``model``'s LM head a bias (``token id -> logit offset``, 0 elsewhere), in place.

    A random tiny model picks stop tokens about once per vocabulary size; biasing it towards
    them makes turns short, so tests and benchmarks of multi-turn rollouts see many turns,
    parse errors fed back, compaction and limits."""
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True,
                             device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        for token, value in biases.items():
            biased.bias[token] = value
    model.set_output_embeddings(biased)
    return model


def with_stop_direction(model: torch.nn.Module, plus_id: int, minus_id: int,
                        logit: float = 6.0) -> torch.nn.Module:
    """Set the LM head rows of ``plus_id`` and ``minus_id`` to ``+-c * u`` (``u`` the unit mean
    row, ``c`` scaled so the logits are about ``logit``), in place: one of the two tokens is
    likely at most positions, so a random model's turns are short. Unlike
    :func:`with_token_bias` it changes weights only, so the model stays a plain checkpoint
    (vLLM serves it)."""
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        u = head.mean(0)
        u = u / u.norm()
        scale = logit * head.shape[1] ** 0.5 / 4
        head[plus_id] = scale * u
        head[minus_id] = -scale * u
    return model
