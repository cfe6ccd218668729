"""What a role tells the orchestrator about itself: its Register (pool, capacity, what it holds, its limits) and
its Heartbeat (progress, steps, what it holds and counts now). A mixin of Worker (disagg/roles/worker.py): it reads the
worker's spec, pool, engines and runner."""

from __future__ import annotations

import os
import time

from disagg.roles.boot import PROGRESS as BOOT
from disagg.roles.layout import describe_layout
from disagg.roles.limits import device_memory, memory_stats
from disagg.transport.wire.messages import Heartbeat, PoolInfo, Register
from disagg.transport.wire.role_stats import CacheStats, LoraStats, MemoryStats


class SelfReport:
    """Methods of Worker; see disagg/roles/worker.py for the state they read."""

    def pool_info(self) -> PoolInfo:
        advertised = {}
        for engine in self.engines.values():
            advertised.update(engine.advertise())
        return PoolInfo(
            host_id=self.spec.host_id,
            engines=list(self.engines),
            pool_name=self.pool.name,
            pool_bytes=self.pool.nbytes,
            device=self.pool.device,
            **advertised,
        )

    def register(self) -> None:
        self.register_sent = time.monotonic()
        busy, held = self.runner.registered()
        self.send(
            Register(
                role=self.spec.role,
                instance_id=self.spec.instance_id,
                pid=os.getpid(),
                host_id=self.spec.host_id,
                device=self.spec.device,
                capacity=self.spec.capacity,
                max_batch=self.spec.max_batch,
                pool=self.pool_info(),
                ready=self.ready,
                busy=busy,
                # what it holds: a restarted orchestrator resumes requests from it, or releases it
                held=held,
                restarts=self.spec.restarts,
                deployment_id=self.spec.deployment_id,
                model=self.spec.model,
                devices=self.spec.group_devices if self.spec.world > 1 else [],
                parallel=describe_layout(self.spec.parallel) if self.spec.world > 1 else "",
                identity=self.identity,
                launcher=self.spec.launcher_id,
                memory_bytes=self.spec.device_memory_bytes or device_memory(self.spec.device),
                visible_gpus=self.spec.gpu_ids[:1024],
                unavailable_engines=self.engine_problems,
                lora=self.lora_stats(),
                peer_lane=self.peers.path if self.peers is not None else "",
                **self.limits,
            )
        )

    def heartbeat(self) -> None:
        self.send(
            Heartbeat(
                instance_id=self.spec.instance_id,
                ready=self.ready,
                in_flight=self.in_flight,
                pool_free_bytes=self.pool.free_bytes,
                progress=self.runner.progress,
                components=self.components,
                steps={rid: list(done) for rid, done in list(self.runner.steps.items()) if done[1]},
                batch_steps=self.batch_steps(),
                running=list(self.runner.busy),
                computed=self.runner.computed,
                # at most as many as a Heartbeat takes (a role mapping more would be refused its every heartbeat)
                peer_pools=sorted({p for engine in self.engines.values() for p in engine.peer_pools()})[:4096],
                lora=self.lora_stats(),
                conditioning=self.conditioning_stats(),
                boot=BOOT.snapshot(),
                compile=self.compile,
                memory=self.memory_stats(),
            )
        )

    def memory_stats(self) -> MemoryStats:
        """Its device's memory: weights, pool (where it is on the device), caches, activations' peak, free."""
        cond = self.conditioning_stats()
        on_device = getattr(self.pool, "device", "").startswith("cuda")
        stage = self.runner.stage  # None while it boots: its heartbeats start before its model is loaded
        return memory_stats(self.spec.device, self.spec.dtype, self.components, stage.adapter if stage else None,
                            pool_bytes=self.pool.nbytes if on_device else 0, cache_bytes=cond.bytes if cond else 0)

    def conditioning_stats(self) -> CacheStats | None:
        """An encoder's conditioning cache (None: it has none)."""
        cache = getattr(self.runner.stage, "conditioning", None)
        return cache.stats() if cache is not None else None

    def lora_stats(self) -> LoraStats | None:
        """Its LoRA adapters (None: it applies none)."""
        bank = getattr(self.runner.stage, "loras", None)
        return bank.stats() if bank is not None else None

    def batch_steps(self) -> dict[int, int]:
        stage = self.runner.stage
        batcher = getattr(stage, "batcher", None)
        return dict(batcher.batch_sizes) if batcher is not None else {}
