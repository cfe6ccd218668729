"""The clients' shared request state (disagg/client/core.py), without sockets: both clients run on it."""

from __future__ import annotations

import pytest

from disagg.client.core import ORCHESTRATOR_SILENCE_S, PROBE_INTERVAL_S, RequestBook
from disagg.client.errors import BadRequest, GenerationFailed, RetryLater
from disagg.transport.wire.messages import (
    ErrorCode,
    GenerationParams,
    Rejected,
    RequestCounts,
    Result,
    StatusQuery,
    StatusReport,
    Submit,
)

P = GenerationParams(prompt="a red circle on the left")


def report(oid: str) -> StatusReport:
    return StatusReport(orchestrator={"id": oid}, instances=[], queues={}, requests=RequestCounts())


def test_a_request_is_submitted_once_and_ended_by_its_answer():
    book = RequestBook("tcp://x:1")
    msg = book.submit("r1", P, 5.0, now=0.0)
    assert isinstance(msg, Submit) and msg.timeout_s == 5.0
    assert book.submit("r1", P, 5.0, now=0.1) is None  # the same again: it joins the run
    dup = book.submit("r1", GenerationParams(prompt="other"), None, now=0.1)
    assert dup.code == ErrorCode.DUPLICATE_REQUEST_ID and not dup.ok
    ended, _ = book.on_reply(Result(request_id="r1", ok=True, num_images=1), [b"png"], now=1.0)
    assert [(o.request_id, o.ok, o.images, o.latency_s) for o in ended] == [("r1", True, [b"png"], 1.0)]
    assert not book.pending


def test_a_successor_orchestrator_gets_the_pending_requests_again_as_resumed():
    book = RequestBook("tcp://x:1")
    book.on_reply(report("o1"), [], now=0.0)
    book.submit("r1", P, None, now=0.0)
    assert book.on_reply(report("o1"), [], now=0.5) == ([], [])
    _, resend = book.on_reply(report("o2"), [], now=1.0)
    # with its age, so its deadline (slo_ms) still counts from the first Submit
    assert [(m.request_id, m.resume, m.age_s) for m in resend] == [("r1", True, 1.0)]


def test_refusals_carry_their_code_and_raise_by_family():
    book = RequestBook("tcp://x:1")
    for rid in ("a", "b", "c"):
        book.submit(rid, P, None, now=0.0)
    [a], _ = book.on_reply(Rejected(request_id="a", reason="overloaded: ...", code=ErrorCode.OVERLOADED), [], 0.1)
    with pytest.raises(RetryLater):
        a.raise_for_error()
    [b], _ = book.on_reply(Rejected(request_id="b", reason="width ...", code=ErrorCode.OVER_LIMIT, param="width"), [], 0.1)
    with pytest.raises(BadRequest) as info:
        b.raise_for_error()
    assert info.value.param == "width"
    [c], _ = book.on_reply(Result(request_id="c", ok=False, error="boom", code=ErrorCode.GENERATION_FAILED), [], 0.1)
    with pytest.raises(GenerationFailed):
        c.raise_for_error()


def test_a_message_the_orchestrator_could_not_read_ends_everything_pending():
    book = RequestBook("tcp://x:1")
    book.submit("a", P, None, now=0.0), book.submit("b", P, None, now=0.0)
    ended, _ = book.on_reply(Rejected(reason="bad message", code=ErrorCode.INVALID_REQUEST), [], 0.1)
    assert sorted(o.request_id for o in ended) == ["a", "b"] and not book.pending


def test_silence_probes_then_loses_the_requests():
    book = RequestBook("tcp://x:1")
    book.submit("a", P, None, now=0.0)
    assert book.tick(0.5) == ([], [])
    _, probe = book.tick(PROBE_INTERVAL_S + 0.1)
    assert probe and isinstance(probe[0], StatusQuery)
    ended, _ = book.tick(ORCHESTRATOR_SILENCE_S + 1)
    assert [o.code for o in ended] == [ErrorCode.UNREACHABLE]


def test_a_stopping_deployment_is_noted():
    book = RequestBook("tcp://x:1")
    book.submit("a", P, None, now=0.0)
    book.on_reply(Rejected(request_id="a", reason="draining: finishing", code=ErrorCode.UNAVAILABLE), [], 0.1)
    assert book.stopping == "draining"
