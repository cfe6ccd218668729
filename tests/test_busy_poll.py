"""When the orchestrator's loop busy-polls after a turn (disagg/orchestrator/server.py `busy_polls`): only around
requests in flight, never for the heartbeats of an idle deployment. Its cost: `benchmarks/idle_beats.py`."""

import pytest

from disagg.orchestrator.server import busy_polls


@pytest.mark.parametrize(("before", "after", "polls"), [
    (0, 0, False),  # an idle deployment's turn (heartbeats, a status query): sleep in poll
    (0, 1, True),  # a Submit admitted: its encoder's report comes soon
    (1, 1, True),  # a stage report: the next one comes soon
    (1, 0, True),  # the last request ended: a closed-loop client's next Submit comes soon
    (4, 4, True),
    (4, 5, False),  # more than busy_poll.max_in_flight: messages arrive close together anyway
    (9, 3, True),
])
def test_a_turn_opens_a_busy_poll_window_only_around_requests_in_flight(before, after, polls):
    assert busy_polls(before, after, 4) is polls


def test_max_in_flight_zero_polls_only_after_the_last_request_ended():
    assert busy_polls(1, 0, 0) and not busy_polls(0, 1, 0) and not busy_polls(0, 0, 0)
