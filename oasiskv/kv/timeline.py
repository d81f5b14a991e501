"""ByteTimeline: the bytes a worker reads from its remote tier, as a bandwidth timeline of fixed
time bins, and ``rate_summary``, its mean and 99th-percentile rate over an interval.

A transfer's bytes are spread uniformly over its ``[start, end]`` interval (seconds of one clock,
``time.monotonic`` in a server): each bin it overlaps gets the share of its bytes that its overlap
is of the interval (a transfer of zero length puts them all in its start's bin). Bin ``k`` covers
``[k * bin_s, (k + 1) * bin_s)``. The timeline keeps the latest ``keep_s`` seconds in a ring of
bins (its memory is bounded: 8 bytes a bin); bytes of older bins are dropped. Bins no transfer
overlapped are idle (0): a link busy in bursts shows a mean far below its peaks, which is what a
99th percentile over the bins measures (a transfer rate, bytes over the seconds transfers took,
does not).

``add`` and ``window`` may be called from several threads. The timeline does not know where a
transfer's times come from: a caller records a transfer once it has completed, from its start to
when its completion was seen.
"""
from __future__ import annotations

import math
import threading

import numpy as np

#: seconds a bin covers
BIN_S = 0.01
#: seconds of bins kept (with ``BIN_S``: 360,000 bins, 2.9 MB)
KEEP_S = 3600.0


class ByteTimeline:
    def __init__(self, bin_s: float = BIN_S, keep_s: float = KEEP_S):
        if bin_s <= 0 or keep_s < bin_s:
            raise ValueError(f"bins of {bin_s} s kept for {keep_s} s")
        self.bin_s = bin_s
        self._ring = np.zeros(math.ceil(keep_s / bin_s))
        self._last: int | None = None  # the latest bin the ring holds (bins before: ring order)
        self._lock = threading.Lock()
        #: bytes of every transfer added (dropped bins' too)
        self.total = 0.0

    @property
    def kept_s(self) -> float:
        return len(self._ring) * self.bin_s

    def _bin(self, t: float) -> int:
        return math.floor(t / self.bin_s)

    def _advance(self, k: int) -> None:
        """Make bin ``k`` the latest held: bins after the last held one are idle so far."""
        n = len(self._ring)
        if self._last is None or k - self._last >= n:
            self._ring[:] = 0.0
        elif k > self._last:
            slots = np.arange(self._last + 1, k + 1) % n
            self._ring[slots] = 0.0
        else:
            return
        self._last = k

    def add(self, start: float, end: float, nbytes: float) -> None:
        """A transfer of ``nbytes`` from ``start`` to ``end``."""
        if end < start:
            raise ValueError(f"a transfer ends ({end}) before it starts ({start})")
        first, last = self._bin(start), self._bin(end)
        if end == start or first == last:
            shares = np.array([float(nbytes)])
        else:
            edges = np.arange(first, last + 2, dtype=np.float64) * self.bin_s
            edges[0], edges[-1] = start, end
            shares = np.diff(edges) * (nbytes / (end - start))
        with self._lock:
            self.total += nbytes
            self._advance(last)
            oldest = self._last - len(self._ring) + 1
            if first < oldest:  # (its start is no longer kept)
                shares, first = shares[oldest - first:], oldest
            if shares.size:
                np.add.at(self._ring, np.arange(first, first + shares.size) % len(self._ring),
                          shares)

    def window(self, start: float, end: float, now: float) -> tuple[float, np.ndarray]:
        """The bins from the one holding ``start`` to the one holding ``end`` (both included;
        ``end`` at most ``now``, the clock's time): (the first bin's start, bytes per bin).
        ``ValueError`` when ``start`` is after ``end`` or no longer kept."""
        if start > end or end > now:
            raise ValueError(f"not an interval up to now ({now}): [{start}, {end}]")
        first, last = self._bin(start), self._bin(end)
        with self._lock:
            self._advance(self._bin(now))
            if first <= self._last - len(self._ring):
                raise ValueError(f"the timeline keeps the last {self.kept_s:.0f} s only")
            bins = self._ring[np.arange(first, last + 1) % len(self._ring)]
        return first * self.bin_s, bins


def rate_summary(bins, bin_s: float) -> tuple[float, float]:
    """(mean, 99th percentile) of the rate over ``bins`` (bytes per bin, idle ones included), in
    bytes per second. The mean is every byte over the bins' span; the percentile is a bin's rate,
    the nearest rank (the ``ceil(0.99 n)``-th smallest of n)."""
    rates = np.sort(np.asarray(bins, dtype=np.float64)) / bin_s
    if rates.size == 0:
        raise ValueError("no bins")
    return float(rates.mean()), float(rates[math.ceil(0.99 * rates.size) - 1])
