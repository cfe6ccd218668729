"""The orchestrator loop's timing decisions (disagg/orchestrator/server.py): when it busy-polls after a turn
(`busy_polls`: only around requests in flight, never for the heartbeats of an idle deployment), and that the
heartbeats' answers (Alive) leave together at the next tick while everything else leaves in its turn. Their cost:
`benchmarks/idle_beats.py`."""

import pytest

from disagg.orchestrator.outbox import to_instance
from disagg.orchestrator.router import Router
from disagg.orchestrator.server import OrchestratorServer, busy_polls
from disagg.transport.wire.messages import Alive, Release
from tests.conftest import free_port_pair


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


def test_alives_wait_for_the_tick_and_the_rest_leaves_in_its_turn():
    server = OrchestratorServer(Router(), port=free_port_pair())
    try:
        alive = to_instance("encoder-0", Alive(orchestrator_id="abc"))
        release = to_instance("encoder-1", Release(request_id="r1", offset=0))
        server.send([alive, release])
        sent = []
        server.outbox.flush(lambda destination, frames: sent.append(destination))
        assert sent == [(False, b"encoder-1")]
        server.send_alives()  # what the next tick does
        server.outbox.flush(lambda destination, frames: sent.append(destination))
        assert sent[1:] == [(False, b"encoder-0")]
    finally:
        server.close()
