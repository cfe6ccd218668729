"""disagg/roles/turns.py: a denoiser's held requests take the device by urgency, handed over at step boundaries."""

from __future__ import annotations

import threading
import time

from disagg.roles.turns import Ticket, Turns


def run(turns: Turns, ticket: Ticket, steps: int, log: list, started: threading.Event | None = None,
        step_s: float = 0.002) -> threading.Thread:
    """A compute of `steps` steps on `turns`, logging which request each step was."""

    def work():
        with turns.hold(ticket):
            for _ in range(steps):
                if started is not None:
                    started.set()
                time.sleep(step_s)
                log.append(ticket.request_id)
                turns.step(ticket)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t


def test_a_more_urgent_request_takes_the_device_at_the_next_step_and_gives_it_back():
    turns = Turns(aging_s=60)
    log: list[str] = []
    started = threading.Event()
    long = run(turns, Ticket("long", steps=200), 200, log, started)
    assert started.wait(5)
    short = run(turns, Ticket("short", priority=1, steps=3), 3, log)
    short.join(5)
    long.join(10)
    first_short = log.index("short")
    assert log[first_short:first_short + 3] == ["short"] * 3, "the short request ran its steps back to back"
    assert 0 < first_short < 100, "it took over long before the long request ended"
    assert log.count("long") == 200 and log[-1] == "long"
    assert turns.switches >= 1


def test_earliest_deadline_first_and_a_request_that_would_make_others_miss_is_set_aside():
    turns = Turns(aging_s=60)
    now = time.monotonic()
    roomy = Ticket("roomy", deadline=now + 10, steps=10)
    tight = Ticket("tight", deadline=now + 1, steps=10)
    late = Ticket("late", deadline=now - 1, steps=10)
    none = Ticket("none", steps=10)

    def names(ts):
        return [t.request_id for t in ts]

    # nothing measured yet (no step time): earliest deadline first, the late one after those without one
    assert names(turns.order([none, late, roomy, tight], now)) == ["tight", "roomy", "none", "late"]
    # at 0.5 s a step, tight (5 s) cannot make its 1 s: set aside, roomy still can
    turns.step_s[None] = 0.5
    assert names(turns.order([none, late, roomy, tight], now)) == ["roomy", "none", "late", "tight"]
    # at 1.1 s a step none can: the one without a deadline first, then the late ones by least slack
    turns.step_s[None] = 1.1
    assert names(turns.order([none, late, roomy, tight], now)) == ["none", "late", "tight", "roomy"]


def test_a_long_request_with_a_near_deadline_is_set_aside_for_short_ones_that_then_all_make_theirs():
    """Least slack first would run the long one (slack 0.2 s) and let three short ones miss; setting the
    longest aside meets three deadlines instead of one."""
    turns = Turns(aging_s=60)
    now = time.monotonic()
    turns.step_s.update({"long": 0.1, "short": 0.1})
    long = Ticket("long", deadline=now + 3.2, steps=30, shape="long")
    shorts = [Ticket(f"short{k}", deadline=now + 0.7 + 0.4 * k, steps=4, shape="short") for k in range(3)]
    ranked = [t.request_id for t in turns.order([long, *shorts], now)]
    assert ranked == ["short0", "short1", "short2", "long"]


def test_aging_lets_a_waiting_request_of_lower_priority_through():
    turns = Turns(aging_s=0.05)
    log: list[str] = []
    started = threading.Event()
    high = run(turns, Ticket("high", priority=1, steps=300), 300, log, started)
    assert started.wait(5)
    low = run(turns, Ticket("low", steps=2), 2, log)
    low.join(10)
    high.join(10)
    assert "low" in log and log.index("low") < len(log) - 2, "the low-priority request did not wait for the end"


def test_the_turn_passes_to_the_waiting_request_on_release():
    turns = Turns(aging_s=60)
    holder = Ticket("holder")
    turns.acquire(holder)
    waiter = Ticket("waiter")
    err = []

    def wait():
        try:
            turns.acquire(waiter)
        except KeyboardInterrupt as exc:
            err.append(exc)

    # an exception while waiting (as Cancelled raised elsewhere would unwind) must not leave it queued
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.05)
    assert waiter in turns._waiting
    turns.release(holder)
    t.join(2)
    assert turns._holder is waiter
    turns.release(waiter)
    assert turns._holder is None and not turns._waiting


def test_a_waiting_request_whose_check_raises_stops_waiting_when_woken():
    turns = Turns(aging_s=60)
    holder = Ticket("holder")
    turns.acquire(holder)
    cancelled = threading.Event()
    waiter = Ticket("waiter")

    def check():
        if cancelled.is_set():
            raise RuntimeError("cancelled")

    waiter.check = check
    errors = []

    def wait():
        try:
            turns.acquire(waiter)
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.05)
    cancelled.set()
    turns.wake()
    t.join(2)
    assert errors and not t.is_alive(), "it still waits for the device"
    assert turns._holder is holder and waiter not in turns._waiting
