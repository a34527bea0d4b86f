"""The worker-replacement policy: backoff between attempts doubles and is capped, and the
start-up deadline is far longer than the default health-ping timeout."""

from miles.supervisor import STARTUP_DEADLINE_S, backoff_s


def test_backoff_doubles_and_is_capped() -> None:
    delays = [backoff_s(n) for n in range(1, 12)]
    assert delays[0] > 0 and all(b == 2 * a or b == 30.0 for a, b in zip(delays, delays[1:]))
    assert max(delays) == 30.0 and backoff_s(100) == 30.0


def test_startup_deadline_exceeds_the_health_ping_timeout() -> None:
    ping_timeout = max(5.0, 5 * 1.0)  # the driver's, at the default --health-check-interval-s
    assert STARTUP_DEADLINE_S > 10 * ping_timeout
