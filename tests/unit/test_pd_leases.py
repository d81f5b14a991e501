"""The leases a decode-host cache keeps (``server.disagg._Leases``), pure bookkeeping: renewed
every 10 s or a quarter of their length, counted from when a renewal was sent; lost when the
worker refuses, or when renewals keep failing until less than a read's deadline might be left;
a lease let go while its renewal was in flight is neither renewed nor lost."""
from oasiskv.server.disagg import RENEW_S, _Leases

A, B = ("http://a", "1"), ("http://b", "2")


def test_renewals_are_due_on_time_and_count_from_their_sending():
    leases = _Leases(timeout_s=10.0)
    leases.add(A, sent=100.0, length=60.0)
    leases.add(B, sent=100.0, length=20.0)  # a short lease: every quarter of it
    assert leases.due(100.0 + 5.0) == [B]
    assert leases.due(100.0 + RENEW_S) == [A, B]
    assert not leases.answered(A, sent=110.0, renewed=True, now=115.0)
    assert leases.held[A] == (110.0 + RENEW_S, 110.0, 60.0)  # from when it was sent


def test_a_refused_renewal_loses_the_lease_at_once():
    leases = _Leases(timeout_s=10.0)
    leases.add(A, sent=0.0, length=60.0)
    assert leases.answered(A, sent=10.0, renewed=False, now=10.5)
    assert A not in leases.held


def test_failing_renewals_are_retried_until_too_little_might_be_left():
    leases = _Leases(timeout_s=10.0)
    leases.add(A, sent=0.0, length=60.0)
    assert not leases.answered(A, sent=10.0, renewed=None, now=20.0)
    assert leases.held[A] == (21.0, 0.0, 60.0)  # tried again in a second, still from 0
    assert not leases.answered(A, sent=40.0, renewed=None, now=49.9)
    assert leases.answered(A, sent=45.0, renewed=None, now=50.0)  # 60 - 10 s: lost
    assert A not in leases.held


def test_a_lease_let_go_meanwhile_is_neither_renewed_nor_lost():
    leases = _Leases(timeout_s=10.0)
    leases.add(A, sent=0.0, length=60.0)
    leases.drop(A)
    assert not leases.answered(A, sent=10.0, renewed=False, now=11.0)
    assert not leases.answered(A, sent=10.0, renewed=True, now=11.0)
    assert A not in leases.held and leases.due(1000.0) == []
