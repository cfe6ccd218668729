"""Typed reports (issue 45): what a role measures about itself travels as nested structs (disagg/transport/wire/role_stats.py)
from its Heartbeat to the registry's Instance to `status` and metrics, as they are, no field copied on the way."""

import msgspec
import pytest

from disagg.transport.wire import messages as m
from disagg.transport.wire.messages import (
    BootStats,
    CacheStats,
    CompileStats,
    Heartbeat,
    LoraStats,
    MemoryStats,
    StatusQuery,
)
from tests.test_router import CLIENT, Harness


def status_of(h: Harness, iid: str) -> m.InstanceStatus:
    [out] = h.router.handle_client(CLIENT, StatusQuery(), [], h.now)
    return next(i for i in out.msg.instances if i.id == iid)


def test_a_heartbeats_stats_reach_status_as_they_came_and_one_left_out_keeps_the_last():
    h = Harness()
    [enc] = h.add("encoder")
    before = status_of(h, enc)
    assert before.lora == LoraStats() and before.conditioning == CacheStats() and before.compile == CompileStats()
    lora = LoraStats(held=["A", "B"], slots=4, loads=2, hits=7, load_s=0.25, host=["C"], host_slots=2, restores=1)
    cache, boot, compiled = CacheStats(lookups=9, hits=4, entries=3), BootStats(phase=""), CompileStats(seconds=12.5)
    memory = MemoryStats(free_bytes=3 << 30, weights_bytes=1 << 30)
    h.role(enc, Heartbeat(instance_id=enc, lora=lora, conditioning=cache, boot=boot, compile=compiled, memory=memory))
    inst = h.router.registry.get(enc)
    # the registry keeps each struct as it came, and status reports that very struct
    assert inst.lora is lora and inst.conditioning is cache and inst.boot is boot and inst.compile is compiled
    assert inst.memory is memory
    now = status_of(h, enc)
    assert (now.lora, now.conditioning, now.boot, now.compile, now.memory) == (lora, cache, boot, compiled, memory)
    # a heartbeat that says nothing of one (a role without a LoRA bank, or without news) leaves the last in place
    h.role(enc, Heartbeat(instance_id=enc, conditioning=CacheStats(lookups=10, hits=5, entries=3)))
    later = status_of(h, enc)
    assert later.lora == lora and later.compile == compiled and later.conditioning.hits == 5
    # on the wire (status --json is msgspec.to_builtins of the report): nested, under the struct's own names
    doc = msgspec.to_builtins(later)
    assert doc["lora"]["loads"] == 2 and doc["conditioning"]["lookups"] == 10 and doc["compile"]["seconds"] == 12.5
    assert doc["boot"] == {"phase": "", "detail": "", "bytes": 0, "progress": 0}


def test_a_registers_lora_stats_seed_the_instance_and_host_slots_from_a_heartbeat_reach_the_host_tier():
    h = Harness()
    h.add("encoder"), h.add("decoder")
    pool = m.PoolInfo(host_id="h", engines=["shm"], pool_name="p-d", pool_bytes=1 << 20)
    h.role("denoiser-0", m.Register(role="denoiser", instance_id="denoiser-0", pid=1, host_id="h", device="cpu",
                                     capacity=1, pool=pool, lora=LoraStats(held=["A"], slots=2)))
    assert status_of(h, "denoiser-0").lora.held == ["A"]
    assert not h.router.registry.host_tier("denoiser")
    h.role("denoiser-0", Heartbeat(instance_id="denoiser-0", lora=LoraStats(held=["A"], slots=2, host_slots=4)))
    assert h.router.registry.host_tier("denoiser")  # its cache was dropped when host_slots changed


def test_nested_stats_are_checked_on_decode_naming_the_field():
    beat = Heartbeat(instance_id="denoiser-0", lora=LoraStats(held=["A"], slots=2), boot=BootStats(phase="loading"))
    assert m.decode(m.encode(beat), m.RoleMessage) == beat
    raw = msgspec.msgpack.decode(m.encode(beat))
    raw["lora"]["loads"] = -1
    with pytest.raises(m.MessageError, match=r"lora\.loads"):
        m.decode(msgspec.msgpack.encode(raw), m.RoleMessage)
    raw["lora"] = {"held": ["A"], "nonsense": 1}
    with pytest.raises(m.MessageError, match="nonsense"):
        m.decode(msgspec.msgpack.encode(raw), m.RoleMessage)


def test_the_conditioning_caches_bytes_reach_metrics_from_the_struct_the_cache_makes():
    """The example of a statistic added in three files: CacheStats.bytes (its struct), ConditioningCache.stats (where
    the role measures it), the gateway's conditioning_metrics (where a metric exposes it)."""
    import torch

    from disagg.gateway.metrics import conditioning_metrics
    from disagg.roles.extensions.conditioning import ConditioningCache

    cache = ConditioningCache(max_bytes=1 << 20)
    cache.put("k", {"prompt_embeds": torch.zeros(4, 8)})
    stats = cache.stats()
    assert stats.entries == 1 and stats.bytes == 4 * 8 * 4
    h = Harness()
    [enc] = h.add("encoder")
    h.role(enc, Heartbeat(instance_id=enc, conditioning=stats))
    [out] = h.router.handle_client(CLIENT, StatusQuery(), [], h.now)
    families = {f.name: f for f in conditioning_metrics(out.msg)}
    [sample] = families["disagg_conditioning_bytes"].samples
    assert sample.labels == {"instance": enc} and sample.value == 128
