from scheduler.leases import TENANT_TURN_WAIT_SECONDS, RunningUnit, plan_redelivery, validation_wait


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


def test_requeue_waits_a_lease_or_twice_the_queue_at_the_measured_rate():
    from scheduler.leases import QueuedUnit, plan_requeue, requeue_after

    assert requeue_after(None, 60, depth=2, pack_requests=1024) == 60
    assert requeue_after(10.0, 60, depth=2, pack_requests=1024) == 2 * 2 * 1024 / 10
    assert requeue_after(1000.0, 60, depth=2, pack_requests=1024) == 60
    queued = [
        QueuedUnit(1, "fast", enqueued_at=930.0),  # 70 s > 60 s lease
        QueuedUnit(2, "fast", enqueued_at=950.0),  # 50 s: fine
        QueuedUnit(3, "slow", enqueued_at=700.0),  # 300 s < 409.6 s at 10 req/s
        QueuedUnit(4, "slow", enqueued_at=500.0),  # 500 s: lost
        QueuedUnit(5, "idle", enqueued_at=None),
    ]
    stale = plan_requeue(queued, 1000.0, {"fast": 1000.0, "slow": 10.0}, lease_seconds=60, depth=2,
                         pack_requests=1024)  # fmt: skip
    assert [u.unit_id for u in stale] == [1, 4]


def test_a_broker_that_lost_its_messages_requeues_every_unit_queued_before_now():
    from scheduler.leases import QueuedUnit, plan_requeue

    queued = [
        QueuedUnit(1, "m", enqueued_at=999.0),  # a second ago: its message went with the broker
        QueuedUnit(2, "m", enqueued_at=1001.0),  # queued after the check began: keeps its message
        QueuedUnit(3, "m", enqueued_at=None),
    ]
    options = {"lease_seconds": 60, "depth": 2, "pack_requests": 1024}
    assert plan_requeue(queued, 1000.0, {}, **options) == []
    assert [u.unit_id for u in plan_requeue(queued, 1000.0, {}, broker_lost=True, **options)] == [1]


def test_a_tenant_starts_validations_up_to_its_cap_then_waits():
    assert validation_wait(0, 2) is None
    assert validation_wait(1, 2) is None
    assert validation_wait(2, 2) == TENANT_TURN_WAIT_SECONDS  # both turns taken: ask again later
    assert validation_wait(5, 2) == TENANT_TURN_WAIT_SECONDS
    assert validation_wait(0, 1) is None and validation_wait(1, 1) is not None
    assert validation_wait(0, 0) is None  # a cap below one still lets one run: never a deadlock
    assert validation_wait(1, 2, wait=0.5) is None and validation_wait(2, 2, wait=0.5) == 0.5
