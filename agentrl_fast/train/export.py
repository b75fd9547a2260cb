"""Exports Hugging Face tools load: ``save_pretrained`` into a folder, atomically."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from agentrl_fast.train.durable import (as_path, done_tmp_dir, fsync_tree, install, new_tmp_dir,
                                        remove)


def export_pretrained(model, directory: str | os.PathLike, tokenizer=None) -> Path:
    """``model.save_pretrained`` (safetensors) into ``directory``, atomically; return it.

    Written into a temporary sibling ``.tmp-<name>-<pid>``, fsynced, then renamed (an existing
    export is replaced), so ``directory`` is either the previous export or the complete new one.
    ``tokenizer`` (optional) is saved alongside with its ``save_pretrained``.
    """
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(f"model must have save_pretrained (a transformers PreTrainedModel), got "
                        f"{type(model).__name__}")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer must have save_pretrained or be None, got "
                        f"{type(tokenizer).__name__}")
    directory = as_path("directory", directory).absolute()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_tmp_dir(directory.parent, directory.name)
    try:
        kwargs = {}
        try:
            if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
                kwargs["safe_serialization"] = True  # transformers < 5; >= 5 always uses it
        except (TypeError, ValueError):
            pass
        model.save_pretrained(tmp, **kwargs)
        if not any(tmp.rglob("*.safetensors")):
            raise ValueError(f"{type(model).__name__}.save_pretrained wrote no .safetensors file "
                             f"into {tmp}; export needs a model that saves safetensors")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
        install(tmp, directory)
    except BaseException:
        remove(tmp)
        raise
    finally:
        done_tmp_dir(tmp)
    return directory
