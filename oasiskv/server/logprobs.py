"""Token text for the API: each token id's raw bytes, its display string, and logprob formatting.

``TokenTable`` is built once from the tokenizer before the engine thread starts and is read-only
afterwards, so request handlers never call the tokenizer (which the engine thread uses). A token's
display string is its UTF-8 text, or ``"bytes:\\xe2\\x80"`` when it holds part of a character
(OpenAI's spelling). ``CompletionLogprobsBuilder`` and ``chat_logprobs`` turn the engine's
``TokenLogprobs`` into the completions (legacy) and chat shapes.
"""
from __future__ import annotations

import codecs
import re

from oasiskv.engine.sequence import TokenLogprobs
from oasiskv.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins: bytes that are printable Latin-1 stand for themselves,
    the others (in byte order) for ``chr(256)``, ``chr(257)``, ..."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


class TokenTable:
    """Raw bytes of every token id in ``[0, vocab_size)``; empty for ids the tokenizer lacks."""

    def __init__(self, tokenizer, vocab_size: int):
        self.token_bytes: list[bytes] = [b""] * vocab_size
        if tokenizer is None:
            return
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        special = (set(tokenizer.all_special_ids)
                   | set(getattr(tokenizer, "added_tokens_decoder", {})))
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab_size)))):
            if piece is None:
                continue
            if i in special:
                self.token_bytes[i] = piece.encode()
            elif alphabet is not None and all(c in alphabet for c in piece):
                self.token_bytes[i] = bytes(alphabet[c] for c in piece)
            elif m := _BYTE_TOKEN.fullmatch(piece):
                self.token_bytes[i] = bytes([int(m[1], 16)])
            else:
                self.token_bytes[i] = tokenizer.decode([i]).encode()

    def piece(self, token_id: int) -> str:
        """Display string; ``"token_id:N"`` for ids without text (no tokenizer, or beyond its
        vocab)."""
        raw = self.token_bytes[token_id]
        if not raw:
            return f"token_id:{token_id}"
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def text(self, token_ids: list[int]) -> str:
        """The ids' text (partial characters become U+FFFD)."""
        return b"".join(self.token_bytes[t] for t in token_ids).decode("utf-8", errors="replace")


class CompletionLogprobsBuilder:
    """Builds the legacy ``logprobs`` object of one choice, piece by piece (one call per stream
    chunk); ``text_offset`` continues across calls, starting at ``start_offset`` characters."""

    def __init__(self, table: TokenTable, start_offset: int = 0):
        self.table = table
        self.offset = start_offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, entries: list[TokenLogprobs | None],
            first_token: int | None = None) -> CompletionLogprobs:
        """``entries`` in token order; ``first_token`` prepends a token without a logprob (the first
        prompt token under ``echo``)."""
        out = CompletionLogprobs()
        if first_token is not None:
            self._token(out, first_token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        for e in entries:
            self._token(out, e.token_id)
            out.token_logprobs.append(e.logprob)
            top = {self.table.piece(t): lp for t, lp in e.top}
            top.setdefault(self.table.piece(e.token_id), e.logprob)
            out.top_logprobs.append(top)
        return out

    def _token(self, out: CompletionLogprobs, token_id: int) -> None:
        out.tokens.append(self.table.piece(token_id))
        out.text_offset.append(self.offset)
        self.offset += len(self._utf8.decode(self.table.token_bytes[token_id]))


def chat_logprobs(table: TokenTable, entries: list[TokenLogprobs]) -> ChatLogprobs:
    def top(t: int, lp: float) -> TopLogprob:
        return TopLogprob(token=table.piece(t), logprob=lp, bytes=list(table.token_bytes[t]))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                         top_logprobs=[top(t, lp) for t, lp in e.top])
        for e in entries])
