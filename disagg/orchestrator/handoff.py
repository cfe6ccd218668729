"""Whether a stage's output must travel inline (inside the orchestrator's messages) because some consumer cannot
pull it from the producer's pool with any transfer engine (disagg/transport/data/selection.py)."""

from __future__ import annotations

from disagg.orchestrator.requests import next_stage
from disagg.settings.choices import Transfer
from disagg.transport.data.selection import choose_engine


class InlineNeeds:
    """needs_inline's answers, cached per kind of pool (host, engines, device) on both ends, so a role of a thousand
    instances costs a few checks; cleared whenever instances change (`clear`)."""

    def __init__(self, registry, transfer: Transfer):
        self.registry = registry
        self.transfer = transfer
        #: (consumer role, producer pool kind) -> whether some consumer needs its output inline
        self.answers: dict[tuple, bool] = {}
        #: role -> its ready consumers' kinds of pool
        self.kinds: dict[str, dict] = {}
        #: producer id -> its answer (asked on every Run)
        self.by_producer: dict[str, bool] = {}

    def clear(self) -> None:
        self.answers.clear()
        self.kinds.clear()
        self.by_producer.clear()

    def __call__(self, producer) -> bool:
        """Whether some ready consumer of `producer`'s output can only be reached inline."""
        cached = self.by_producer.get(producer.id)
        if cached is None:
            cached = self.by_producer[producer.id] = self._answer(producer)
        return cached

    def _answer(self, producer) -> bool:
        role = next_stage(producer.role)
        if role is None:
            return False
        key = (role, producer.pool.host_id, tuple(producer.pool.engines), producer.pool.device)
        cached = self.answers.get(key)
        if cached is None:
            kinds = self.kinds.get(role)
            if kinds is None:
                kinds = self.kinds[role] = {
                    (c.pool.host_id, tuple(c.pool.engines), c.pool.device): c.pool
                    for c in self.registry.of_role(role) if c.state == "ready"}
            cached = any(choose_engine(self.transfer, producer.pool, pool)[0] == Transfer.INLINE
                         for pool in kinds.values())
            self.answers[key] = cached
        return cached
