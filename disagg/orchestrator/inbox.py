"""What clients sent, served within a budget per loop turn, so no client traffic starves roles or other clients.

The Router handles at most TURN_BUDGET client messages a loop turn, at most PEER_TURN_BUDGET of one client's.
Within those a message is handled as it is read (`spend`: the common path costs two counts); past them, or while
messages wait here, it waits in this inbox, per client, and the next turns serve the inbox first, round robin over
the clients, after the roles' messages and the tick. Bounds:
- a client's bundle carries at most CLIENT_BUNDLE_MAX messages (a client's own Outbox never bundles more);
- a client keeps at most PEER_MAX_ITEMS messages and PEER_MAX_BYTES of their frames waiting; past either, its
  messages are refused (`Rejected(code=overloaded)`), so one peer's memory here is bounded;
- a StatusQuery from a client that has one waiting already is answered by that one's report (one status per
  client per turn, whatever it asked);
- while all clients together have MAX_WAITING messages waiting the server reads no more from the frontend: the
  rest waits in ZeroMQ's queue (its high-water mark), not here.
"""

from __future__ import annotations

import collections

from disagg.transport.wire.bundle import BUNDLE_MAX_MESSAGES
from disagg.transport.wire.messages import ErrorCode, Rejected, StatusQuery

#: the most messages one client bundle may carry
CLIENT_BUNDLE_MAX = BUNDLE_MAX_MESSAGES
#: client messages the Router handles per loop turn, over all clients, and per client
TURN_BUDGET = 1024
PEER_TURN_BUDGET = 256
#: what one client may have waiting: messages, and bytes of their raw frames (images of edits)
PEER_MAX_ITEMS = 4096
PEER_MAX_BYTES = 256 * 2**20
#: all clients' waiting messages past which the frontend is not read this turn
MAX_WAITING = 16_384


class ClientInbox:
    """Per client identity, its messages waiting to be handled, in the order they came."""

    def __init__(self):
        self.queues: collections.OrderedDict[bytes, collections.deque] = collections.OrderedDict()
        self.bytes: collections.Counter[bytes] = collections.Counter()
        self.status_waiting: set[bytes] = set()
        self.waiting = 0
        #: messages refused because their client had too many waiting, and status queries folded into one
        self.refused = 0
        self.folded = 0
        #: this turn's handled messages, in all and per client, and the clients whose status query was answered
        self.turn_total = 0
        self.turn_peer: collections.Counter[bytes] = collections.Counter()
        self.turn_status: set[bytes] = set()

    def new_turn(self) -> None:
        self.turn_total = 0
        self.turn_peer.clear()
        self.turn_status.clear()

    def spend(self, identity: bytes, msg) -> bool | None:
        """Whether `identity`'s message may be handled now (counted against the turn's budgets): True; None when it
        is a StatusQuery whose client's report this turn answers already (nothing to do); False: queue it (add)."""
        if self.waiting or self.turn_total >= TURN_BUDGET or self.turn_peer[identity] >= PEER_TURN_BUDGET:
            return False
        if isinstance(msg, StatusQuery):
            if identity in self.turn_status:
                self.folded += 1
                return None
            self.turn_status.add(identity)
        self.turn_total += 1
        self.turn_peer[identity] += 1
        return True

    def __len__(self) -> int:
        return self.waiting

    @property
    def full(self) -> bool:
        return self.waiting >= MAX_WAITING

    def add(self, identity: bytes, msg, frames: list) -> Rejected | None:
        """Queue one message of `identity`'s; a Rejected to answer instead when it has too much waiting."""
        if isinstance(msg, StatusQuery):
            if identity in self.status_waiting:
                self.folded += 1
                return None  # the report of the one waiting answers this one too
            self.status_waiting.add(identity)
        queue = self.queues.get(identity)
        size = sum(map(len, frames))
        if queue is not None and (len(queue) >= PEER_MAX_ITEMS or self.bytes[identity] + size > PEER_MAX_BYTES):
            self.refused += 1
            if isinstance(msg, StatusQuery):
                self.status_waiting.discard(identity)
            return Rejected(request_id=getattr(msg, "request_id", None), code=ErrorCode.OVERLOADED,
                            reason=f"overloaded: {len(queue)} messages of this client wait already; send fewer at once")
        if queue is None:
            queue = self.queues[identity] = collections.deque()
        queue.append((msg, frames))
        self.bytes[identity] += size
        self.waiting += 1
        return None

    def take(self, budget: int | None = None):
        """Up to `budget` (the turn's budget left) (identity, message, frames), round robin over the clients,
        PEER_TURN_BUDGET each at most."""
        budget = TURN_BUDGET - self.turn_total if budget is None else budget
        taken = 0
        while self.queues and taken < budget:
            for identity in list(self.queues):
                queue = self.queues[identity]
                for _ in range(min(PEER_TURN_BUDGET, budget - taken, len(queue))):
                    msg, frames = queue.popleft()
                    self.waiting -= 1
                    self.bytes[identity] -= sum(map(len, frames))
                    if isinstance(msg, StatusQuery):
                        self.status_waiting.discard(identity)
                    taken += 1
                    yield identity, msg, frames
                if not queue:
                    del self.queues[identity]
                    del self.bytes[identity]
                else:  # served its share: the others' turn first next time
                    self.queues.move_to_end(identity)
                if taken >= budget:
                    return
