"""``ngram`` drafter (prompt lookup): continue the most recent earlier occurrence of the sequence's
last n tokens (n from ``max_n`` down to 1); with no match, repeat the last token."""
from __future__ import annotations

from oasiskv.spec.base import Drafter


def ngram_guess(tokens: list[int], max_n: int = 3, window: int = 8192) -> int:
    """The token that followed the latest earlier match of the last n tokens of ``tokens``."""
    recent = tokens[-window:]
    for n in range(min(max_n, len(recent) - 1), 0, -1):
        tail = recent[-n:]
        for start in range(len(recent) - n - 1, -1, -1):
            if recent[start:start + n] == tail:
                return recent[start + n]
    return tokens[-1]


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 3, window: int = 8192):
        self.max_n, self.window = max_n, window

    def propose(self, seqs):
        return [ngram_guess(s.token_ids, self.max_n, self.window) for s in seqs]
