"""The same-host fast lane (disagg/transport/wire/lane.py) and message bundles (disagg/transport/wire/messages.py), piece by piece.

The lane between real orchestrator, role and client processes is exercised by every end-to-end
test (tests/test_e2e.py checks that each instance uses it, and that a deployment without it works).
"""

from __future__ import annotations

import socket
import struct

import pytest

from disagg.transport.wire.bundle import BUNDLE_MAX_BYTES, BUNDLE_MAX_MESSAGES, Outbox, bundle_frames, decode_frames
from disagg.transport.wire.lane import (
    LANE_MAX_PACKET,
    WELCOME,
    Lane,
    LaneClosed,
    LaneError,
    LaneListener,
    connect,
    pack,
    unpack,
)
from disagg.transport.wire.messages import (
    Bundle,
    Done,
    MessageError,
    OrchestratorCommand,
    Release,
    RoleMessage,
    Shutdown,
    encode,
)


def pair() -> tuple[Lane, Lane]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return Lane(a), Lane(b)


def test_pack_unpack_round_trip():
    frames = [b"head", b"", b"x" * 1000, memoryview(b"view")]
    assert unpack(pack(frames)) == [b"head", b"", b"x" * 1000, b"view"]


@pytest.mark.parametrize(
    "packet, why",
    [
        (b"", "shorter than its header"),
        (struct.pack("<H", 0), "claims 0 frames"),
        (struct.pack("<H", 3) + b"\0\0", "claims 3 frames"),
        (struct.pack("<HI", 1, 10) + b"abc", "frames claim 10"),
        (struct.pack("<HI", 1, 1) + b"abc", "frames claim 1"),
    ],
)
def test_malformed_packets_are_refused_with_the_cause(packet, why):
    with pytest.raises(LaneError, match=why):
        unpack(packet)


def test_lane_sends_and_receives_messages_in_order():
    a, b = pair()
    for i in range(50):
        assert a.send([b"m", str(i).encode()])
    got = b.recv(most=1000)
    assert got == [[b"m", str(i).encode()] for i in range(50)]
    assert b.recv() == []  # nothing more: does not block


def test_a_message_too_big_for_a_packet_is_left_to_zeromq():
    a, b = pair()
    assert not a.fits([b"x" * LANE_MAX_PACKET])
    assert not a.send([b"x" * LANE_MAX_PACKET])
    assert not a.closed  # the lane itself is fine
    assert a.send([b"x" * (LANE_MAX_PACKET - 100)])
    assert len(b.recv()[0][0]) == LANE_MAX_PACKET - 100


def test_a_bad_packet_comes_back_in_its_place_and_the_rest_are_served():
    raw_a, raw_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b = Lane(raw_b)
    raw_a.send(pack([b"one"]))
    raw_a.send(b"\xff")
    raw_a.send(pack([b"two"]))
    got = b.recv()
    assert got[0] == [b"one"] and isinstance(got[1], LaneError) and got[2] == [b"two"]


def test_a_closed_peer_is_reported_and_sends_fail():
    a, b = pair()
    a.send([b"last"])
    a.close()
    assert b.recv() == [[b"last"]]  # what was sent before the close still arrives
    with pytest.raises(LaneClosed):
        b.recv()
    assert b.closed and not b.send([b"x"])


def test_a_peer_that_stops_reading_loses_its_lane(monkeypatch):
    monkeypatch.setattr("disagg.transport.wire.lane.LANE_SEND_WAIT_S", 0.01)
    a, _b = pair()
    sent = 0
    while a.send([b"x" * 4096]):
        sent += 1
        assert sent < 100_000
    assert a.closed and sent > 0


def test_listener_accepts_and_connect_introduces(tmp_path):
    path = str(tmp_path / "lane.sock")
    listener = LaneListener(path)
    try:
        assert connect(str(tmp_path / "nothing-here.sock"), [b"role"]) is None
        client = connect(path, [b"client", b"orch-id"])
        (server,) = listener.accept()
        assert server.recv() == [[b"client", b"orch-id"]]
        server.send([WELCOME])
        assert client.recv() == [[WELCOME]]
        # a second listener on the same path takes over from a dead one
        listener.close()
        listener = LaneListener(path)
        assert connect(path, [b"x"]) is not None
    finally:
        listener.close()


# --- bundles ----------------------------------------------------------------------------------


def test_one_message_travels_bare_several_as_a_bundle():
    one = bundle_frames([(encode(Shutdown()), [])])
    assert one == [encode(Shutdown())]
    frames = bundle_frames([(encode(Release(request_id="a", offset=1)), []),
                            (encode(Done(request_id="b", attempt=1, num_images=2)), [b"img1", b"img2"]),
                            (encode(Shutdown()), [])])
    assert len(frames) == 3
    items = decode_frames(frames, RoleMessage)
    # Release is not a role message: it comes back as an error in its place, the others are served
    assert isinstance(items[0][0], MessageError) and items[0][1] == []
    assert items[1] == (Done(request_id="b", attempt=1, num_images=2), [b"img1", b"img2"])
    assert isinstance(items[2][0], MessageError)


def test_a_bundle_whose_frame_counts_do_not_add_up_is_refused():
    bad = encode(Bundle(messages=[], frames=[]))
    with pytest.raises(MessageError):
        decode_frames([bad], OrchestratorCommand)  # no messages at all
    import msgspec

    lying = encode(Bundle(messages=[msgspec.Raw(encode(Shutdown()))], frames=[2]))
    with pytest.raises(MessageError, match="claims 2 frames"):
        decode_frames([lying, b"only one"], OrchestratorCommand)
    nested = encode(Bundle(messages=[msgspec.Raw(lying)], frames=[0]))
    ((item, _),) = decode_frames([nested], OrchestratorCommand)
    assert isinstance(item, MessageError)  # a bundle never holds a bundle


def test_outbox_sends_one_message_per_destination_in_order_and_bounded():
    box = Outbox()
    for i in range(BUNDLE_MAX_MESSAGES + 5):
        box.add("a", Release(request_id=f"r{i}", offset=i))
    box.add("b", Shutdown())
    big = b"x" * (BUNDLE_MAX_BYTES + 1)
    box.add("b", Done(request_id="d", attempt=1, num_images=1), [big])
    box.add("b", Shutdown())
    sent = []
    box.flush(lambda dest, frames: sent.append((dest, frames)))
    assert not box
    to_a = [decode_frames(f, OrchestratorCommand) for d, f in sent if d == "a"]
    assert [len(x) for x in to_a] == [BUNDLE_MAX_MESSAGES, 5]
    assert [m.offset for batch in to_a for m, _ in batch] == list(range(BUNDLE_MAX_MESSAGES + 5))
    to_b = [f for d, f in sent if d == "b"]
    assert len(to_b) == 3  # the big Done travels alone, between the two small ones
    assert to_b[1][1] is big


def test_a_folder_others_can_write_into_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(OSError, match="not private"):
        LaneListener(str(folder / "lane.sock"))
    folder.chmod(0o700)
    LaneListener(str(folder / "lane.sock")).close()


def test_an_orchestrator_without_a_lane_still_serves(tmp_path, monkeypatch, caplog):
    """A socket path too long for AF_UNIX (a long TMPDIR) costs the lane, not the orchestrator."""
    from disagg.orchestrator.router import Router
    from disagg.orchestrator.server import OrchestratorServer
    from tests.conftest import free_port_pair

    long_tmp = tmp_path / ("x" * 120)
    long_tmp.mkdir()
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(long_tmp))
    server = OrchestratorServer(Router(), port=free_port_pair())
    try:
        assert server.lane_listener is None and server.router.lane == ""
        assert "no fast lane" in caplog.text
    finally:
        server.close()
