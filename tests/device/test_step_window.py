"""The decision of when a launched bucket may be stepped (csrc/step_window.h), driven directly:
hand-written cases, then random backwards (random readiness, window sizes, host progress or
device order) checked against the rules the Reducer relies on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leanddp._extension import _C


def _never(_: int) -> bool:
    return False


def _always(_: int) -> bool:
    return True


def test_host_progress_steps_what_is_ready_and_waits_only_when_full() -> None:
    w = _C._testing.StepWindow(2, False)
    w.launched_one()
    assert w.next("after_hook", _never) is None  # not ready: nothing blocks
    assert w.next("before_launch", _never) is None  # room for a second bucket
    w.launched_one()
    assert w.next("before_launch", _never) == ("step_waiting", 0)  # full: the oldest first
    w.stepped_one()
    assert (w.stepped, w.finished, w.in_flight) == (1, 1, 1)  # a host step is finished
    assert w.next("before_launch", _never) is None
    w.launched_one()
    assert w.next("after_hook", _always) == ("step", 1)
    w.stepped_one()
    assert w.next("after_hook", _always) == ("step", 2)
    w.stepped_one()
    assert w.next("after_hook", _always) is None
    assert w.next("end", _never) is None


def test_device_order_steps_at_once_and_finishes_only_when_full() -> None:
    w = _C._testing.StepWindow(2, True)
    for b in range(2):
        assert w.next("before_launch", _always) is None
        w.launched_one()
        assert w.next("after_hook", _always) == ("step", b)  # ordered on the side stream
        w.stepped_one()
    assert (w.stepped, w.finished, w.in_flight) == (2, 0, 2)
    assert w.next("before_launch", _always) == ("finish", 0)  # the host waits for bucket 0 only
    w.finished_one()
    assert w.next("before_launch", _always) is None
    w.launched_one()
    assert w.next("after_hook", _never) is None  # its future is not complete yet (gloo on CUDA)
    assert w.next("end", _never) == ("step_waiting", 2)
    w.stepped_one()
    assert w.next("end", _never) is None  # the end orders the caller's stream; no host wait


def test_full_window_with_unstepped_oldest_steps_it_before_finishing() -> None:
    w = _C._testing.StepWindow(1, True)
    w.launched_one()
    assert w.next("before_launch", _never) == ("step_waiting", 0)
    w.stepped_one()
    assert w.next("before_launch", _never) == ("finish", 0)
    w.finished_one()
    assert w.next("before_launch", _never) is None


def test_unfinished_device_steps_carry_into_the_next_backward() -> None:
    """A host that reaches the next backward before the device finished the last one's steps
    finishes those first: the window bounds buckets in flight across iterations too."""
    w = _C._testing.StepWindow(2, True)
    for b in range(2):
        w.launched_one()
        assert w.next("after_hook", _always) == ("step", b)
        w.stepped_one()
    assert w.next("end", _always) is None  # both queued on the side stream, none waited for
    w.reset(carried=w.stepped - w.finished)
    assert (w.carried, w.in_flight) == (2, 2)
    assert w.next("before_launch", _always) == ("finish", None)  # last backward's oldest step
    w.finished_one()
    assert (w.carried, w.in_flight) == (1, 1)
    assert w.next("before_launch", _always) is None  # room for one
    w.launched_one()
    assert w.next("before_launch", _always) == ("finish", None)
    w.finished_one()
    assert (w.carried, w.in_flight) == (0, 1)
    assert w.next("before_launch", _always) is None
    assert w.next("after_hook", _always) == ("step", 0)
    host = _C._testing.StepWindow(2, False)
    with pytest.raises(RuntimeError, match="only device steps"):
        host.reset(carried=1)


def test_bad_use_raises() -> None:
    with pytest.raises(RuntimeError, match="at least one bucket"):
        _C._testing.StepWindow(0, False)
    w = _C._testing.StepWindow(2, True)
    with pytest.raises(RuntimeError, match="not launched"):
        w.stepped_one()
    w.launched_one()
    with pytest.raises(RuntimeError, match="not stepped"):
        w.finished_one()
    with pytest.raises(RuntimeError, match="unknown phase"):
        w.next("later", _always)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    capacity=st.integers(1, 4),
    device=st.booleans(),
    buckets=st.integers(1, 12),
    # per bucket: after how many hooks (counted from its launch) its reduction is ready
    delays=st.lists(st.integers(0, 6), min_size=12, max_size=12),
    hooks=st.lists(st.integers(1, 3), min_size=12, max_size=12),
)
def test_random_backwards_keep_the_rules(
    capacity: int, device: bool, buckets: int, delays: list[int], hooks: list[int]
) -> None:
    w = _C._testing.StepWindow(capacity, device)
    clock = 0  # hooks so far
    launched_at: list[int] = []
    steps: list[int] = []
    finishes: list[int] = []
    carried = 0  # device steps of the previous backward not finished when it ended

    def ready(b: int) -> bool:
        return clock - launched_at[b] >= delays[b]

    def run(phase: str) -> None:
        while (decision := w.next(phase, ready)) is not None:
            action, b = decision
            if action == "finish":
                assert device, "host progress never waits for a finish"
                assert phase == "before_launch"
                if b is None:  # the previous backward's, oldest first
                    assert w.carried > 0
                else:
                    assert w.carried == 0 and b == len(finishes) and b < len(steps)
                    finishes.append(b)
                w.finished_one()
                continue
            assert b == len(steps) < len(launched_at), "steps follow launch order"
            if action == "step":
                assert phase == "after_hook" and ready(b), "a plain step never waits"
            else:
                assert phase != "after_hook", "a hook alone never waits"
            steps.append(b)
            w.stepped_one()

    for _ in range(2):  # the second starts with the first's unfinished steps
        w.reset(carried=carried)
        clock, launched_at, steps, finishes = 0, [], [], []
        for b in range(buckets):
            for _ in range(hooks[b]):  # the hooks that fill bucket b
                clock += 1
                run("after_hook")
            run("before_launch")
            assert w.in_flight < capacity, "the launch keeps the window, across backwards too"
            w.launched_one()
            launched_at.append(clock)
            assert w.in_flight <= capacity
            run("after_hook")
        run("end")
        assert steps == list(range(buckets)), "every bucket stepped once, in order"
        assert w.launched == w.stepped == buckets
        assert finishes == list(range(len(finishes)))
        assert w.finished == (len(finishes) if device else buckets)
        carried = w.in_flight  # queued on the device still: the next backward's to finish
        assert carried <= capacity and (device or carried == 0)
