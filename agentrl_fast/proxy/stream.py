"""Token-by-token streaming for the proxy: the content a client may see while a reply is still
being sampled.

The reply's final form (:func:`~agentrl_fast.proxy.session.make_reply`) is known only
once the last id is in: a ``stop`` string cuts the text where it starts, valid ``<tool_call>``
blocks leave the content and the rest is stripped. :class:`ContentStream` therefore sends a
prefix of the text only while it is certain to begin the final content, and
:meth:`ContentStream.finish` sends the rest. Held back: the last id's text (a multi-byte
character or a merge may still change it), anything from the first ``<tool_call>`` (or a
partial one) on, anything from where a stop string starts (or may start), trailing whitespace,
and all of a text that starts with whitespace (stripped or not, depending on what follows).
A reply whose ``tool_choice`` forced a call is all held: its ids continue the call's head.
"""

from __future__ import annotations

from typing import Sequence

from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.tool_calls import TOOL_CALL_OPEN

__all__ = ["ContentStream"]


def _held_from(text: str, marker: str) -> int:
    """Where a suffix of ``text`` that begins ``marker`` starts; ``len(text)`` if none."""
    for start in range(max(len(text) - len(marker) + 1, 0), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)


class ContentStream:
    """The content deltas of one reply as its ids arrive: :meth:`feed` new ids, get the text to
    send now; :meth:`finish` with the final reply's content gets the rest. The deltas always
    add up to the final content. Decoding is incremental (each id is decoded with the few
    before it, as vLLM's detokenizer does), so a long reply costs linear time."""

    def __init__(self, chat_format: ChatFormat, stop: Sequence[str] = (),
                 parse_calls: bool = True, forced_call: bool = False):
        self.chat_format = chat_format
        self.markers = [*stop, *([TOOL_CALL_OPEN] if parse_calls else [])]
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:_read]: whole characters, never its last id's
        self._context = 0  # ids[_context:_read] are decoded again before the new ones
        self._read = 0
        self.sent = ""
        # For good, until the end: a marker came, or leading whitespace, or the reply opens
        # inside a call the request forced (its ids continue the call's head, not content).
        self.held = forced_call

    def _decode_new(self) -> None:
        """Extend :attr:`text` by the new ids but the last (whose text may still change), once
        they end on a whole character and leave the text before them as it was."""
        upto = len(self.ids) - 1
        if upto <= self._read:
            return
        before = self.chat_format.decode(self.ids[self._context:self._read])
        window = self.chat_format.decode(self.ids[self._context:upto])
        if len(window) > len(before) and window.startswith(before) \
                and not window.endswith("\ufffd"):
            self.text += window[len(before):]
            self._context, self._read = self._read, upto

    def feed(self, ids: Sequence[int]) -> str:
        """Take newly sampled ``ids``; return the content that became certain (maybe "")."""
        self.ids.extend(ids)
        self._decode_new()
        text = self.text
        if self.held or not text:
            return ""
        if text[0].isspace():  # stripped or not, depending on what follows
            self.held = True
            return ""
        end = len(text)
        for marker in self.markers:
            # No marker starts inside what was sent (it ends before any), so look after it.
            found = text.find(marker, max(len(self.sent) - len(marker) + 1, 0))
            if found >= 0:
                self.held = True
            end = min(end, found if found >= 0 else _held_from(text, marker))
        safe = text[:end]
        while safe and (safe[-1].isspace() or safe[-1] == "\ufffd"):  # stripped, or unfinished
            safe = safe[:-1]
        if len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, content: str | None) -> str:
        """The rest of the final ``content`` (the reply's), after what was sent."""
        content = content or ""
        if not content.startswith(self.sent):  # a bug here would corrupt every streamed reply
            raise RuntimeError(f"streamed content {self.sent!r} does not begin the reply's "
                               f"content {content[:200]!r}")
        rest, self.sent = content[len(self.sent):], content
        return rest
