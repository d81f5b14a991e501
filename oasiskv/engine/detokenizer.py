"""Incremental detokenization and stop-string detection for one request.

Text is decoded a few tokens at a time with a little context before them (so byte-level BPE pieces
and leading spaces come out right) and never emits a partial UTF-8 character. While a request runs,
the last ``len(longest stop) - 1`` characters are held back from streaming so a stop string that is
still forming is never shown.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token_id: int) -> str | None:
        """Add a token's text. Returns the stop string that ended the text, if one appeared."""
        if self.tokenizer is None:
            return None
        self._before_push = (len(self.ids), self.prefix_offset, self.read_offset, self.text)
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset],
                                       skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None  # an unfinished character, or a token with no text (e.g. special)
        searched_from = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, searched_from)) >= 0]
        if not hits:
            return None
        at, s = min(hits)
        self.text = self.text[:at]
        return s

    def undo_push(self) -> None:
        """Forget the last ``push`` (its token is being replaced)."""
        if self.tokenizer is not None:
            count, self.prefix_offset, self.read_offset, self.text = self._before_push
            del self.ids[count:]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: everything once finished, else all but the held-back tail."""
        return (self.text if finished or not self.hold
                else self.text[: max(0, len(self.text) - self.hold)])
