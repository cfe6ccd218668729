"""The orchestrator's client inbox (disagg/orchestrator/inbox.py): a budget per turn, round robin, bounded per client."""

from disagg.orchestrator.inbox import PEER_MAX_ITEMS, PEER_TURN_BUDGET, ClientInbox
from disagg.transport.wire.messages import Cancel, ErrorCode, StatusQuery


def test_clients_take_turns_within_the_budget_and_each_keeps_its_order():
    inbox = ClientInbox()
    for i in range(PEER_TURN_BUDGET + 10):
        inbox.add(b"flood", Cancel(request_id=f"f{i}"), [])
    inbox.add(b"quiet", Cancel(request_id="q0"), [])
    first = [(who, m.request_id) for who, m, _ in inbox.take(budget=PEER_TURN_BUDGET + 1)]
    # the flooding client's share, then the quiet one's message: not after the whole flood
    assert first[:PEER_TURN_BUDGET] == [(b"flood", f"f{i}") for i in range(PEER_TURN_BUDGET)]
    assert first[-1] == (b"quiet", "q0") and len(inbox) == 10
    assert [m.request_id for _, m, _ in inbox.take()] == [f"f{i}" for i in range(PEER_TURN_BUDGET, PEER_TURN_BUDGET + 10)]
    assert len(inbox) == 0 and not inbox.queues


def test_a_client_with_too_much_waiting_is_refused_and_status_queries_fold():
    inbox = ClientInbox()
    assert inbox.add(b"c", StatusQuery(), []) is None and inbox.add(b"c", StatusQuery(), []) is None
    assert len(inbox) == 1 and inbox.folded == 1  # one report answers both
    for i in range(PEER_MAX_ITEMS - 1):
        assert inbox.add(b"c", Cancel(request_id=f"r{i}"), []) is None
    refused = inbox.add(b"c", Cancel(request_id="over"), [])
    assert refused.code == ErrorCode.OVERLOADED and refused.request_id == "over" and len(inbox) == PEER_MAX_ITEMS
    assert inbox.add(b"other", Cancel(request_id="x"), []) is None  # another client is not held back
    list(inbox.take(budget=10**6))
    assert inbox.add(b"c", StatusQuery(), []) is None and len(inbox) == 1  # answered: a new query waits again


def test_within_the_turns_budget_messages_are_handled_at_once_and_past_it_they_wait():
    inbox = ClientInbox()
    assert inbox.spend(b"c", StatusQuery()) is True and inbox.spend(b"c", StatusQuery()) is None  # one report a turn
    for i in range(PEER_TURN_BUDGET - 1):
        assert inbox.spend(b"c", Cancel(request_id=f"r{i}")) is True
    assert inbox.spend(b"c", Cancel(request_id="over")) is False  # its share of the turn is spent: it waits
    assert inbox.spend(b"d", Cancel(request_id="d0")) is True  # another client's is not
    inbox.add(b"c", Cancel(request_id="over"), [])
    assert inbox.spend(b"d", Cancel(request_id="d1")) is False  # while any wait, nobody overtakes them
    inbox.new_turn()
    assert [m.request_id for _, m, _ in inbox.take()] == ["over"] and inbox.spend(b"d", Cancel(request_id="d1"))
