"""A user's checkpoint: a Hugging Face causal LM (a folder or a hub id) and its own tokenizer,
checked against each other and against the Qwen3 chat format before any training starts."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)``; a ValueError naming ``path`` when it cannot."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"cannot load a tokenizer from {path!r}: "
                         f"{_first_line(error)}") from None


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype`` (``"auto"``: the
    checkpoint's own), its own config (eos/pad ids, generation config) kept for the export."""
    from transformers import AutoModelForCausalLM
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype="auto" if dtype == "auto" else DTYPES[dtype])
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"cannot load a causal LM from {path!r}: "
                         f"{_first_line(error)}") from None
    return model


def check_vocabulary(model: torch.nn.Module, tokenizer) -> None:
    """A ValueError when the tokenizer has ids the model's embeddings cannot look up (after
    ``tokenizer.add_tokens`` without ``model.resize_token_embeddings``)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's embeddings "
                         f"only {rows} rows: grow them with "
                         "model.resize_token_embeddings(len(tokenizer)) and save the model again")


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]
