"""A small byte-level BPE tokenizer with the Qwen3 special tokens, built in code (nothing is
downloaded) for the built-in environments and tiny models.

Byte-level, so every string round-trips (unicode, JSON, code); trained with the ``tokenizers``
library's BPE trainer on the chat template's own text plus a caller's corpus (an environment's
prompts, tool schemas and outputs). Merges may cross word boundaries (no word pre-split), so the
fixed text every sub-trace repeats — the tools header, the JSON around a call — becomes a
handful of tokens and the sequences a tiny CPU model reads stay short. ``words`` (an
environment's entity names) are whole tokens wherever they appear, so a name is the same id in
a task, a call and a tool result and copying it is one token. Training is deterministic: the
same corpus, words and ``vocab_size`` give the same vocabulary.

Token layout: ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of a turn, the
end-of-sequence token) are special tokens; ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` are added tokens that decode
as text, as in Qwen3's tokenizer.
"""

from __future__ import annotations

from typing import Iterable

from agentrl_fast.harness.chat_format import (IM_END, IM_START, THINK_CLOSE, THINK_OPEN,
                                              TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN,
                                              render_messages)
from agentrl_fast.harness.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

PAD = "<|endoftext|>"
CONTROL_TOKENS = (PAD, IM_START, IM_END)
TAG_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE,
              THINK_OPEN, THINK_CLOSE)


def _template_corpus() -> list[str]:
    """Text the chat template itself writes: the tools header, a call, a result, the turns."""
    example_tool = {"type": "function", "function": {
        "name": "example", "description": "An example tool.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string",
                                                                 "description": "A key."}},
                       "required": ["key"]}}}
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Use the tools to answer the question."},
        {"role": "assistant", "content": "",
         "tool_calls": [{"name": "example", "arguments": {"key": "value"}}]},
        {"role": "tool", "content": "Error: invalid arguments"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    return [render_messages(conversation, tools=[example_tool])]


def build_tokenizer(corpus: Iterable[str] = (), vocab_size: int = 1024,
                    words: Iterable[str] = ()):
    """A ``transformers`` fast tokenizer (``PreTrainedTokenizerFast``) trained on the template
    text and ``corpus``, with each of ``words`` as one token.

    ``vocab_size``: the most ids (special tokens, the 256 byte symbols and ``words`` included);
    a small corpus yields fewer. ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
    round-trip it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(corpus, str):
        raise TypeError("build_tokenizer: corpus must be an iterable of strings, not one string; "
                        "wrap it in a list")
    corpus = list(corpus)
    for i, text in enumerate(corpus):
        if not isinstance(text, str):
            raise TypeError(f"build_tokenizer: corpus[{i}] must be a str, got {type(text).__name__}")
    words = list(dict.fromkeys(words))
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word:
            raise TypeError(f"build_tokenizer: words[{i}] must be a non-empty str, got {word!r}")
    minimum = 256 + len(CONTROL_TOKENS) + len(TAG_TOKENS) + len(words)
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"build_tokenizer: vocab_size must be an int >= {minimum} (256 byte "
                         f"symbols, the special tokens and the words), got {vocab_size!r}")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS) - len(words), special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
        show_progress=False)
    # Tags and words are cut out before the BPE model sees the text, as at encode time.
    texts = _template_corpus() + corpus
    for piece_break in TAG_TOKENS + CONTROL_TOKENS + tuple(words):
        texts = [piece for text in texts for piece in text.split(piece_break)]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False)
                          for tag in TAG_TOKENS + tuple(words)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=IM_END, pad_token=PAD,
                                   clean_up_tokenization_spaces=False)
