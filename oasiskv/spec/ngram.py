"""``ngram`` drafter (prompt lookup): continue the most recent earlier occurrence of the sequence's
last n tokens (n from ``max_n`` down to 1); with no match, repeat the last token.

Each sequence keeps an index (n-gram -> the token that followed its latest occurrence), extended by
the tokens added since the last step: O(max_n) per token instead of a scan of the whole sequence.
"""
from __future__ import annotations

from oasiskv.spec.base import Drafter


class NgramIndex:
    """Followers of every n-gram (n <= ``max_n``) of one growing token list, latest occurrence
    wins."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.follower: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens[:indexed] have their followers recorded

    def guess(self, tokens: list[int]) -> int:
        """The token that followed the latest earlier match of the last n tokens of ``tokens``
        (which extends the list seen before)."""
        follower, max_n, size = self.follower, self.max_n, len(tokens)
        # token p follows the n-grams ending at p - 1: the suffixes of the window before it
        for p in range(max(1, self.indexed), size):
            window = tuple(tokens[max(0, p - max_n):p])
            for i in range(len(window)):
                follower[window[i:]] = tokens[p]
        self.indexed = size
        tail = tuple(tokens[max(1, size - max_n):])  # the last n tokens, n < size
        for i in range(len(tail)):  # longest first
            hit = follower.get(tail[i:])
            if hit is not None:
                return hit
        return tokens[-1]


def ngram_guess(tokens: list[int], max_n: int = 3) -> int:
    """One-off guess for ``tokens`` (a fresh index)."""
    return NgramIndex(max_n).guess(tokens)


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._index: dict[int, NgramIndex] = {}

    def propose(self, seqs):
        return [self._index.setdefault(s.seq_id, NgramIndex(self.max_n)).guess(s.token_ids)
                for s in seqs]

    def release(self, seq) -> None:
        self._index.pop(seq.seq_id, None)
