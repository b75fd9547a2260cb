"""The Qwen3 chat format, as text (:func:`render_messages`) and as token ids (:class:`ChatFormat`).

:func:`render_messages` reproduces, character for character, the chat template of the original
Qwen3 release for conversations whose assistant turns carry no reasoning content:

- with tools, one system turn holds the system message (if first), then the tools header: each
  tool's JSON schema on its own line (``json.dumps(tool, ensure_ascii=False)``) inside
  ``<tools></tools>``, then the instruction to answer in ``<tool_call></tool_call>`` tags;
- an assistant turn is its content, then each call as
  ``<tool_call>\\n{"name": "<name>", "arguments": <json>}\\n</tool_call>`` (a string ``arguments``
  is inserted verbatim), with a newline before a call when content precedes it or another call
  does;
- consecutive tool results share one ``user`` turn, each in ``\\n<tool_response>\\n...\\n</tool_response>``;
- an assistant turn after the last real user query (a user turn that is not a
  ``<tool_response>`` wrapper) that is the last message, or that has reasoning, opens with a
  ``<think>`` block (empty when it has no reasoning);
- ``add_generation_prompt`` appends ``<|im_start|>assistant\\n`` (and an empty think block when
  ``enable_thinking`` is ``False``).

The template fails on a ``None`` content; here ``None`` renders as ``""`` (what HF callers
mean by it). Unknown roles, which the template drops silently, raise ``ValueError``.

:class:`ChatFormat` builds the same text as token ids, token-exact with the model's tokenizer:
the text between two special or added tokens (``<|im_start|>``, ``<tool_response>``, ...) is
tokenized as one run, as the tokenizer does on the whole rendered string (and as
``apply_chat_template``, vLLM and SGLang do), so a run that joins template text and a message
content merges across the seam (``".\n\n"`` is one Qwen3 token). Assistant output is the
model's own: in a rollout its sampled ids are kept verbatim, and for demonstrations it is
tokenized alone, as a model samples it after the generation prompt. A trajectory built turn by
turn — sampled ids, then the template and tool results up to the next generation prompt — is
thus the tokenizer's ids of the rendered conversation without it ever being re-tokenized as a
whole: every appended turn starts and ends at a special token (docs/design.md, token-in/token-out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from agentrl_fast.harness.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# The tokens a tokenizer must have, each as one id, for ChatFormat.
SPECIAL_TOKENS = (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN,
                  TOOL_RESPONSE_CLOSE)
STOP_MODES = ("tool_call", "im_end")

_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>")
_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_ROLES = ("system", "user", "assistant", "tool")

# Piece kinds: template text, message content (system/user/tool), and model output (assistant
# content and calls, the part a policy samples).
TEMPLATE, CONTENT, OUTPUT = "template", "content", "output"


def tojson(value: Any) -> str:
    """The template's ``tojson``: ``json.dumps(value, ensure_ascii=False)``."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class _Message:
    role: str
    content: str
    reasoning: str | None
    tool_calls: tuple[tuple[str, Any], ...]  # (name, arguments as given: dict or str)


def _normalize(messages: Sequence[Mapping]) -> list[_Message]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', "
                            f"got {type(m).__name__}")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}['role'] must be one of {', '.join(_ROLES)}, got {role!r}")
        content = m.get("content")
        content = "" if content is None else content
        if not isinstance(content, str):
            raise TypeError(f"{where}['content'] must be a str or None, "
                            f"got {type(content).__name__}")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise TypeError(f"{where}['reasoning_content'] must be a str or None, "
                            f"got {type(reasoning).__name__}")
        calls = []
        raw_calls = m.get("tool_calls") or []
        if raw_calls and role != "assistant":
            raise ValueError(f"{where} has tool_calls but role {role!r}; only assistant "
                             "messages carry tool_calls")
        if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, (str, bytes)):
            raise TypeError(f"{where}['tool_calls'] must be a list, got {type(raw_calls).__name__}")
        for j, call in enumerate(raw_calls):
            call_where = f"{where}['tool_calls'][{j}]"
            if not isinstance(call, Mapping):
                raise TypeError(f"{call_where} must be a dict, got {type(call).__name__}")
            if call.get("function"):
                call = call["function"]
                if not isinstance(call, Mapping):
                    raise TypeError(f"{call_where}['function'] must be a dict")
            name, arguments = call.get("name"), call.get("arguments")
            if not isinstance(name, str):
                raise TypeError(f"{call_where}: 'name' must be a str, got {type(name).__name__}")
            if "arguments" not in call:
                raise ValueError(f"{call_where} has no 'arguments' (use {{}} for none)")
            calls.append((name, arguments))
        out.append(_Message(role, content, reasoning, tuple(calls)))
    return out


def _last_query_index(messages: list[_Message]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        m = messages[index]
        if m.role == "user" and not (m.content.startswith(TOOL_RESPONSE_OPEN)
                                     and m.content.endswith(TOOL_RESPONSE_CLOSE)):
            return index
    return len(messages) - 1


def tool_call_text(name: str, arguments: Any) -> str:
    """One call as the template renders it (and a model trained on it writes it)."""
    arguments_text = arguments if isinstance(arguments, str) else tojson(arguments)
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {arguments_text}}}\n{TOOL_CALL_CLOSE}'


def render_pieces(messages: Sequence[Mapping], tools: Iterable[Mapping] | None = None,
                  add_generation_prompt: bool = False, enable_thinking: bool | None = None, *,
                  as_generated: bool = False) -> list[tuple[str, str]]:
    """:func:`render_messages` as ``(kind, text)`` pieces, kind one of ``"template"``,
    ``"content"`` (system/user/tool text) and ``"output"`` (an assistant's content and calls).
    Joined, the texts are the rendered conversation. ``as_generated``: each assistant turn as
    a rollout builds it instead of the template's think-block rule — the generation prompt
    (``enable_thinking``'s), then the output, a given reasoning as the output's think block."""
    msgs = _normalize(messages)
    tools = list(tools) if tools else []
    pieces: list[tuple[str, str]] = []
    add = pieces.append
    first_is_system = bool(msgs) and msgs[0].role == "system"
    if tools:
        add((TEMPLATE, f"{IM_START}system\n"))
        if first_is_system:
            add((CONTENT, msgs[0].content))
            add((TEMPLATE, "\n\n"))
        add((TEMPLATE, _TOOLS_INTRO + "".join("\n" + tojson(t) for t in tools) + _TOOLS_OUTRO))
        add((TEMPLATE, f"{IM_END}\n"))
    elif first_is_system:
        add((TEMPLATE, f"{IM_START}system\n"))
        add((CONTENT, msgs[0].content))
        add((TEMPLATE, f"{IM_END}\n"))
    last_query = _last_query_index(msgs)
    for index, m in enumerate(msgs):
        is_last = index == len(msgs) - 1
        if m.role == "user" or (m.role == "system" and index > 0):
            add((TEMPLATE, f"{IM_START}{m.role}\n"))
            add((CONTENT, m.content))
            add((TEMPLATE, f"{IM_END}\n"))
        elif m.role == "assistant":
            content, reasoning = m.content, ""
            if m.reasoning is not None:
                reasoning = m.reasoning
            elif THINK_CLOSE in m.content:
                content = m.content.split(THINK_CLOSE)[-1].lstrip("\n")
                reasoning = m.content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1]
                reasoning = reasoning.lstrip("\n")
            output = content
            if as_generated:
                add((TEMPLATE, generation_prompt(enable_thinking)))
                if reasoning and enable_thinking is not False:
                    output = (f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n"
                              + content.lstrip("\n"))
            else:
                add((TEMPLATE, f"{IM_START}assistant\n"))
            if not as_generated and index > last_query and (is_last or reasoning):
                add((TEMPLATE, f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n"))
                output = content.lstrip("\n")
            for j, (name, arguments) in enumerate(m.tool_calls):
                if j > 0 or content:
                    output += "\n"
                output += tool_call_text(name, arguments)
            add((OUTPUT, output))
            add((TEMPLATE, f"{IM_END}\n"))
        elif m.role == "tool":
            if index == 0 or msgs[index - 1].role != "tool":
                add((TEMPLATE, f"{IM_START}user"))
            add((TEMPLATE, f"\n{TOOL_RESPONSE_OPEN}\n"))
            add((CONTENT, m.content))
            add((TEMPLATE, f"\n{TOOL_RESPONSE_CLOSE}"))
            if is_last or msgs[index + 1].role != "tool":
                add((TEMPLATE, f"{IM_END}\n"))
    if add_generation_prompt:
        add((TEMPLATE, generation_prompt(enable_thinking)))
    # Empty outputs stay: the <|im_end|> after them is still the model's.
    return [(kind, text) for kind, text in pieces if text or kind == OUTPUT]


def generation_prompt(enable_thinking: bool | None = None) -> str:
    """What ``add_generation_prompt`` appends: the open assistant turn."""
    empty_think = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n" if enable_thinking is False else ""
    return f"{IM_START}assistant\n{empty_think}"


def render_messages(messages: Sequence[Mapping], tools: Iterable[Mapping] | None = None,
                    add_generation_prompt: bool = False, enable_thinking: bool | None = None) -> str:
    """The conversation as the original Qwen3 chat template renders it (see the module doc).

    ``messages``: HF-style dicts (``role`` system/user/assistant/tool, ``content``, assistant
    ``tool_calls`` as ``[{"name", "arguments"}]`` or ``[{"function": {...}}]``, ``arguments`` a
    dict or a JSON string); ``tools``: JSON-schema dicts (``{"type": "function", ...}``).
    """
    return "".join(text for _, text in render_pieces(messages, tools, add_generation_prompt,
                                                     enable_thinking))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is written as
    in a byte-level vocabulary -> the byte (printable Latin-1 bytes stand for themselves, the
    others for characters from U+0100 on, in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    out, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            out[chr(byte)] = byte
        else:
            out[chr(256 + shifted)] = byte
            shifted += 1
    return out


_BYTE_OF_CHAR = _byte_level_alphabet()


def chat_token_ids(tokenizer) -> dict[str, int]:
    """The id of each of Qwen3's chat tokens (``SPECIAL_TOKENS``) in ``tokenizer``, or a
    ValueError listing those it lacks as single tokens and how to add them."""
    ids = {token: tokenizer.encode(token, add_special_tokens=False) for token in SPECIAL_TOKENS}
    missing = [token for token, token_ids in ids.items() if len(token_ids) != 1]
    if missing:
        # As in Qwen3's tokenizer: the turn markers special, the tags plain added tokens (a
        # server that skips special tokens in its text would otherwise drop the tags).
        special = [t for t in missing if t in (IM_START, IM_END)]
        tags = [t for t in missing if t not in special]
        how = " and ".join(
            ([f"tokenizer.add_special_tokens({{'additional_special_tokens': {special!r}}})"]
             if special else []) + ([f"tokenizer.add_tokens({tags!r})"] if tags else []))
        raise ValueError(
            f"the tokenizer lacks Qwen3's chat tokens {missing} (each must encode to one id; "
            f"they encode to {[len(ids[t]) for t in missing]} ids). Add them with {how}, and "
            "grow the model's embeddings to match (model.resize_token_embeddings(len(tokenizer)); "
            "the new rows are untrained, so fine-tune on the chat format before RL), then save "
            "both with save_pretrained")
    return {token: token_ids[0] for token, token_ids in ids.items()}


class ChatFormat:
    """Token-level Qwen3 rendering with any HF tokenizer that has the Qwen3 special tokens.

    ``stop_mode`` (docs/design.md): ``"tool_call"`` — the model stops at its first ``</tool_call>``
    (or at ``<|im_end|>`` when it answers without a call) and the harness closes the turn with
    ``<|im_end|>`` as template tokens; ``"im_end"`` — the model stops at ``<|im_end|>`` only and
    may make several calls per turn. ``enable_thinking`` as in the template's generation prompt.
    """

    def __init__(self, tokenizer, stop_mode: str = "tool_call",
                 enable_thinking: bool | None = None):
        if stop_mode not in STOP_MODES:
            raise ValueError(f"stop_mode must be one of {', '.join(STOP_MODES)}, got {stop_mode!r}")
        for method in ("encode", "decode", "convert_tokens_to_ids"):
            if not callable(getattr(tokenizer, method, None)):
                raise TypeError(f"tokenizer must be a Hugging Face tokenizer (it has no {method}()), "
                                f"got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.stop_mode = stop_mode
        self.enable_thinking = enable_thinking
        self.token_ids = chat_token_ids(tokenizer)
        self.im_end_id = self.token_ids[IM_END]
        self.tool_call_close_id = self.token_ids[TOOL_CALL_CLOSE]
        self.stop_ids = ((self.tool_call_close_id, self.im_end_id) if stop_mode == "tool_call"
                         else (self.im_end_id,))
        self._template_cache: dict[str, list[int]] = {}
        self._backend = self._plain_backend(tokenizer)

    @staticmethod
    def _plain_backend(tokenizer):
        """The ``tokenizers`` backend of a fast tokenizer when it encodes exactly as the wrapper
        does (probed on template, tool-call and plain text), to skip the wrapper's per-call
        overhead; else ``None``."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode"):
            return None
        probes = (f"{IM_START}system\nYou are here.{IM_END}\n", "hello  world\n\n 42 ",
                  f'{TOOL_CALL_OPEN}\n{{"name": "f", "arguments": {{"a": "x y"}}}}\n{TOOL_CALL_CLOSE}',
                  " leading space, trailing tab\t", "ünïcödé ✓")
        try:
            same = all(backend.encode(text, add_special_tokens=False).ids
                       == list(tokenizer.encode(text, add_special_tokens=False)) for text in probes)
        except Exception:  # noqa: BLE001 - any backend quirk: keep the wrapper
            return None
        return backend if same else None

    def encode(self, text: str) -> list[int]:
        """``text`` alone as ids (no BOS/EOS added)."""
        if not text:
            return []
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _template(self, text: str) -> list[int]:
        ids = self._template_cache.get(text)
        if ids is None:
            ids = self._template_cache.setdefault(text, self.encode(text))
        return list(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids back to text, special tokens included."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one id stands for (part of a character, maybe) when the tokenizer is
        byte-level (GPT-2 style, as Qwen3's), else ``None``; an added token's are its text's."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        if token_id in added:
            return str(added[token_id]).encode("utf-8")
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        return bytes(_BYTE_OF_CHAR[char] for char in token)

    def encode_messages(self, messages: Sequence[Mapping], tools: Iterable[Mapping] | None = None,
                        add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """``(ids, action_mask)`` of the conversation as a rollout builds it, for supervised
        warm-start data: each assistant turn opens with the generation prompt (not the
        template's think-block rule: a rollout never writes one), the text between assistant
        outputs is tokenized as a whole (runs split at special tokens), each output alone; the
        mask is 1 on assistant output and on the stop token that ends it (``</tool_call>`` in
        ``"tool_call"`` mode when the output ends with a call, else ``<|im_end|>``) — the tokens
        a policy samples."""
        pieces = render_pieces(messages, tools, add_generation_prompt, self.enable_thinking,
                               as_generated=True)
        return self._encode_pieces(pieces)

    def _encode_pieces(self, pieces: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        pending: list[str] = []  # template and content text since the last output
        samples_im_end = False  # the text after the last output opens with a sampled <|im_end|>
        for kind, text in pieces + [(OUTPUT, None)]:
            if kind != OUTPUT:
                pending.append(text)
                continue
            context = self.encode("".join(pending))
            ids += context
            mask += [1] * min(samples_im_end, len(context)) + [0] * (len(context) - samples_im_end)
            if text is None:
                break
            output = self.encode(text)
            ids += output
            mask += [1] * len(output)
            pending, samples_im_end = [], self._samples_im_end(text)
        return ids, mask

    def _samples_im_end(self, output: str) -> bool:
        """Whether the model samples the ``<|im_end|>`` after ``output`` (else it stopped at
        ``</tool_call>`` and the harness appends ``<|im_end|>``)."""
        return self.stop_mode == "im_end" or not output.endswith(TOOL_CALL_CLOSE)

    def render_ids(self, messages: Sequence[Mapping], tools: Iterable[Mapping] | None = None,
                   add_generation_prompt: bool = False) -> list[int]:
        """The ids of ``render_messages(messages, tools, add_generation_prompt)`` (the
        template's own think-block rule; outputs tokenized alone)."""
        pieces = render_pieces(messages, tools, add_generation_prompt, self.enable_thinking)
        return self._encode_pieces(pieces)[0]

    def generation_prompt_ids(self) -> list[int]:
        return self._template(generation_prompt(self.enable_thinking))

    def turn_end_ids(self, sampled_ids: Sequence[int]) -> list[int]:
        """Template ids that close an assistant turn after the model's sampled ids: ``\\n`` when
        it stopped at ``<|im_end|>``, else ``<|im_end|>\\n`` (it stopped at ``</tool_call>``, or
        ran out of tokens)."""
        if len(sampled_ids) and sampled_ids[-1] == self.im_end_id:
            return self._template("\n")
        return self._template(f"{IM_END}\n")

    def tool_results_ids(self, contents: Sequence[str]) -> list[int]:
        """The user turn carrying tool results, tokenized as the whole turn's text."""
        return self.encode(f"{IM_START}user" + "".join(
            f"\n{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}" for content in contents)
            + f"{IM_END}\n")

    def user_ids(self, content: str) -> list[int]:
        """A user turn, tokenized as the whole turn's text."""
        return self.encode(f"{IM_START}user\n{content}{IM_END}\n")
