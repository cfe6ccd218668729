"""The same-host fast lane: control messages over a Unix SOCK_SEQPACKET connection.

A ZeroMQ message between two processes goes through four threads (each side's application
thread and ZeroMQ I/O thread), and on a small VM every wake of an idle thread costs tens of
microseconds: a round trip measured 267 µs with 1 ms of idle between pings, against 60 µs for a
Unix socket polled by the same loop (`benchmarks/zmq_idle_rtt.py` prints both). A request's
control messages cross eight such hops, so on one host they take the lane: the orchestrator
listens on a Unix socket next to its ZeroMQ ports, and a role or client on the same host connects
to it after its ZeroMQ handshake. ZeroMQ stays the way in (registration, first contact, other
hosts) and carries any message too big for one packet (images, inline tensors) or sent when the
lane is gone.

One packet is one message with its raw frames: a little-endian u16 frame count, a u32 length per
frame, then the frames. The socket file lives in a directory only this user can enter, and the
first packet on a connection names who connects and which orchestrator it expects.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import tempfile

#: the orchestrator's answer to an accepted introduction; a peer sends on the lane only after it
WELCOME = b"welcome"
#: the largest packet sent on a lane; a bigger message takes ZeroMQ
LANE_MAX_PACKET = 60 * 1024
#: how long a send waits for room in a full lane before giving the lane up (the peer is stuck)
LANE_SEND_WAIT_S = 0.1
_SNDBUF = 1024 * 1024


class LaneClosed(ConnectionError):
    """The peer closed the lane, or it broke."""


class LaneError(ValueError):
    """A packet that is not a well-formed message."""


def lane_folder() -> str:
    """This user's private folder of lanes under the temp dir (the orchestrators' and the roles' peer lanes)."""
    return os.path.join(tempfile.gettempdir(), f"disagg-{os.getuid()}")


def lane_path(port: int) -> str:
    """Where the orchestrator listening on `port` puts its lane (a private directory under the temp dir)."""
    return os.path.join(lane_folder(), f"lane-{port}.sock")


def _private_folder(path: str) -> None:
    """Make the lane's folder, and refuse one that another user could write into (they could swap
    our socket for theirs)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{folder} is not private to this user (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")


#: frame count -> the packet header's Struct (a message has a handful of frames: a few entries)
_HEADERS: dict[int, struct.Struct] = {}


def pack(frames: list) -> bytes:
    n = len(frames)
    header = _HEADERS.get(n)
    if header is None:
        header = _HEADERS[n] = struct.Struct(f"<H{n}I")
    return header.pack(n, *map(len, frames)) + b"".join(frames)


def unpack(packet: bytes) -> list[bytes]:
    if len(packet) < 2:
        raise LaneError("lane packet shorter than its header")
    (count,) = struct.unpack_from("<H", packet)
    start = 2 + 4 * count
    if count == 0 or len(packet) < start:
        raise LaneError(f"lane packet header claims {count} frames")
    lengths = struct.unpack_from(f"<{count}I", packet, 2)
    if start + sum(lengths) != len(packet):
        raise LaneError(f"lane packet of {len(packet)} bytes, frames claim {sum(lengths)}")
    frames = []
    for n in lengths:
        frames.append(packet[start : start + n])
        start += n
    return frames


class Lane:
    """One end of a lane connection (non-blocking; poll its fileno())."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()  # kept: a closed socket's fileno() is -1, but pollers know it by this
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        except OSError:
            pass
        self.closed = False

    def fileno(self) -> int:
        return self.fd

    def fits(self, frames: list) -> bool:
        return 2 + 4 * len(frames) + sum(map(len, frames)) <= LANE_MAX_PACKET

    def send(self, frames: list) -> bool:
        """Send one message; False if it is too big or the lane is (now) closed: send it another way."""
        if self.closed or not self.fits(frames):
            return False
        packet = pack(frames)
        try:
            try:
                self.sock.send(packet)
            except BlockingIOError:
                # full: the peer is behind. Wait a little; a peer that stays stuck loses its lane.
                if not select.select([], [self.sock], [], LANE_SEND_WAIT_S)[1]:
                    self.close()
                    return False
                self.sock.send(packet)
        except OSError:
            self.close()
            return False
        return True

    def recv(self, most: int = 256) -> list[list[bytes]]:
        """The messages waiting (up to `most`); raises LaneClosed when the peer is gone.
        A malformed packet comes back as a LaneError in its place."""
        if self.closed:
            raise LaneClosed("lane closed")
        out = []
        for _ in range(most):
            try:
                packet = self.sock.recv(LANE_MAX_PACKET + 1)
            except BlockingIOError:
                break
            except OSError as exc:
                self.close()
                raise LaneClosed(str(exc)) from None
            if not packet:
                self.close()
                if out:
                    break
                raise LaneClosed("peer closed the lane")
            try:
                out.append(unpack(packet))
            except LaneError as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


def connect(path: str, hello: list[bytes]) -> Lane | None:
    """A lane to the orchestrator listening at `path`, introduced by `hello`; None if there is none here."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        sock.send(pack(hello))
    except OSError:
        sock.close()
        return None
    return Lane(sock)


def lane_in_use(path: str) -> bool:
    """Whether an orchestrator listens on the lane at `path` (a file left by a killed one is not)."""
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class LaneListener:
    """The orchestrator's end (or a role's peer lane: disagg/roles/peers.py): a listening socket that accepts lanes."""

    def __init__(self, path: str):
        self.path = path
        _private_folder(path)
        if lane_in_use(path):  # e.g. an orchestrator on another address with the same port: its lane stays its own
            raise OSError(f"{path} is in use by another process")
        try:
            os.unlink(path)  # an orchestrator before us on this port is gone (we hold the port now)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(256)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> list[Lane]:
        lanes = []
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return lanes
            except OSError:
                return lanes
            lanes.append(Lane(conn))

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LaneLink:
    """A role's or a client's end of a lane: it carries messages only once the orchestrator has
    welcomed it. An orchestrator that is not the one we meant closes it without a word, so nothing
    is sent on it before the welcome, and nothing is lost."""

    def __init__(self, lane: Lane):
        self.lane = lane
        self.fd = lane.fd
        self.welcomed = False

    @classmethod
    def open(cls, path: str, hello: list[bytes]) -> LaneLink | None:
        lane = connect(path, hello)
        return cls(lane) if lane is not None else None

    @property
    def closed(self) -> bool:
        return self.lane.closed

    def send(self, frames: list) -> bool:
        """Send one message; False before the welcome, when too big, or when the lane is gone."""
        return self.welcomed and self.lane.send(frames)

    def recv(self, most: int = 256) -> list:
        """As Lane.recv, with the welcome taken off the front; raises LaneClosed when the
        orchestrator refused us or went away."""
        packets = self.lane.recv(most)
        if not self.welcomed and packets:
            if packets.pop(0) != [WELCOME]:
                self.close()
                raise LaneClosed("the orchestrator did not welcome us on its lane")
            self.welcomed = True
        return packets

    def close(self) -> None:
        self.lane.close()
