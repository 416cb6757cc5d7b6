from scheduler.leases import RunningUnit, plan_redelivery


def test_redelivery_after_lease_and_give_up_after_attempts():
    running = [
        RunningUnit(1, "m", heartbeat_at=95.0, attempts=1),  # fresh
        RunningUnit(2, "m", heartbeat_at=10.0, attempts=1),  # stale
        RunningUnit(3, "m", heartbeat_at=None, attempts=1),  # never beat
        RunningUnit(4, "m", heartbeat_at=10.0, attempts=3),  # stale, out of attempts
    ]
    retry, give_up = plan_redelivery(running, now=100.0, lease_seconds=30, max_attempts=3)
    assert [u.unit_id for u in retry] == [2, 3]
    assert [u.unit_id for u in give_up] == [4]
