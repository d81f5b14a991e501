"""ByteTimeline (``kv/timeline.py``): transfers spread over fixed bins, idle bins counted, a bounded
ring that forgets old bins and never shows a stale one; ``rate_summary``'s mean and nearest-rank
99th percentile. Every number here is computed by hand."""
import pytest

from oasiskv.kv.timeline import ByteTimeline, rate_summary


def test_a_transfer_is_spread_over_the_bins_it_overlaps():
    t = ByteTimeline(bin_s=0.01, keep_s=1.0)
    # 3000 bytes over 30 ms (100,000 B/s): half of bin 10, bins 11 and 12, half of bin 13
    t.add(0.105, 0.135, 3000)
    t.add(0.112, 0.118, 600)  # inside bin 11
    t.add(0.142, 0.142, 50)  # no length: all in its bin (14)
    first, bins = t.window(0.08, 0.159, now=0.2)  # bins 8 .. 15
    assert first == pytest.approx(0.08)
    assert bins.tolist() == pytest.approx([0, 0, 500, 1600, 1000, 500, 50, 0])
    assert t.total == 3650
    # 3650 bytes over 8 bins of 10 ms; the top bin (8 bins: rank 8) at 1600 bytes per 10 ms
    mean, p99 = rate_summary(bins, 0.01)
    assert mean == pytest.approx(3650 / 0.08)
    assert p99 == pytest.approx(160_000)


def test_the_99th_percentile_is_the_nearest_rank_over_idle_bins_too():
    bins = [0.0] * 196 + [4.0, 1.0, 3.0, 2.0]  # 200 bins: rank ceil(0.99 * 200) = 198 -> 2
    mean, p99 = rate_summary(bins, 0.5)
    assert p99 == pytest.approx(2.0 / 0.5)
    assert mean == pytest.approx(10.0 / (200 * 0.5))
    # 100 bins: rank 99 of [0 x 98, 7, 9] -> 7; one bin: itself
    assert rate_summary([0.0] * 98 + [9.0, 7.0], 1.0)[1] == 7.0
    assert rate_summary([5.0], 0.01) == pytest.approx((500.0, 500.0))
    with pytest.raises(ValueError):
        rate_summary([], 0.01)


def test_the_ring_keeps_the_latest_bins_only_and_shows_none_stale():
    t = ByteTimeline(bin_s=0.01, keep_s=1.0)  # 100 bins
    t.add(0.503, 0.503, 10)  # bin 50
    t.add(1.0, 1.995, 995)  # bins 100 .. 199: 10 bytes each, 5 in the last (half of it)
    with pytest.raises(ValueError, match="keeps the last"):
        t.window(0.505, 1.5, now=1.999)  # bin 50 is gone
    first, bins = t.window(1.005, 1.995, now=1.999)
    assert len(bins) == 100 and bins.tolist() == pytest.approx([10.0] * 99 + [5.0])
    # 1500 bytes over 1.5 s ending at bin 300: bins 201 .. 299 are kept (990 bytes), the start's
    # share before them dropped
    t.add(1.5, 3.0, 1500)
    first, bins = t.window(2.015, 2.995, now=3.0)
    assert bins.sum() == pytest.approx(990.0)
    # later, with nothing read meanwhile: bins 201 .. 250 are gone, and the slots of bins
    # 301 .. 350, which held them, read idle
    with pytest.raises(ValueError, match="keeps the last"):
        t.window(2.015, 3.505, now=3.505)
    first, bins = t.window(2.515, 3.505, now=3.505)  # bins 251 .. 350
    assert len(bins) == 100 and bins.tolist() == pytest.approx([10.0] * 49 + [0.0] * 51)
    assert t.total == 10 + 995 + 1500


def test_a_window_is_an_interval_up_to_now():
    t = ByteTimeline(bin_s=0.01, keep_s=1.0)
    with pytest.raises(ValueError):
        t.window(0.5, 0.4, now=1.0)
    with pytest.raises(ValueError):
        t.window(0.5, 1.5, now=1.0)
    with pytest.raises(ValueError):
        t.add(0.2, 0.1, 5)
    with pytest.raises(ValueError):
        ByteTimeline(bin_s=0.01, keep_s=0.001)
    first, bins = t.window(0.5, 0.5, now=1.0)  # nothing read yet: one idle bin
    assert bins.tolist() == [0.0]
