"""The Router test harness: a Router on a fake clock, and helpers that speak for roles and clients (no sockets, no
processes). Used by the Router's tests and by benchmarks/router_bench.py and router_ab.py."""



from disagg.orchestrator.router import Router, RouterConfig
from disagg.transport.wire.messages import (
    Done,
    Fetched,
    GenerationParams,
    Heartbeat,
    PoolInfo,
    Register,
    Registered,
    Release,
    Result,
    Run,
    SlotRef,
    Staged,
    Submit,
    TensorSpec,
)

CLIENT = b"client-1"


POOL1 = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1 << 20)


class Harness:
    """A router plus a fake clock and helpers that speak for roles and clients."""

    def __init__(self, **cfg):
        self.now = 100.0
        self.router = Router(RouterConfig(**cfg), now=self.now)

    def add(self, role, n=1, capacity=1, host="h", engines=("shm", "inline"), peer_lane=False):
        """`n` ready instances of `role`; `peer_lane`: each takes Forwards (Register.peer_lane)."""
        ids = []
        for i in range(n):
            iid = f"{role}-{len(self.router.registry.of_role(role))}"
            pool = PoolInfo(host_id=host, engines=list(engines), pool_name=f"p-{iid}", pool_bytes=1 << 20)
            out = self.role(iid, Register(role=role, instance_id=iid, pid=1000 + i, host_id=host, device="cpu", capacity=capacity,
                                          pool=pool, peer_lane=f"/lanes/peer-{iid}.sock" if peer_lane else ""))
            assert isinstance(out[0].msg, Registered)
            self.role(iid, Heartbeat(instance_id=iid, ready=True))
            ids.append(iid)
        return ids

    def submit(self, rid, timeout_s=None, **params):
        params.setdefault("prompt", "a cat")
        return self.router.handle_client(CLIENT, Submit(request_id=rid, params=GenerationParams(**params), timeout_s=timeout_s), [], self.now)

    def role(self, iid, msg, frames=()):
        return self.router.handle_instance(iid, msg, list(frames), self.now)

    def tick(self, dt=0.0):
        self.now += dt
        return self.router.tick(self.now)

    def beat_all(self):
        for iid in self.router.registry.by_id:
            self.role(iid, Heartbeat(instance_id=iid))


def runs(outs):
    return [(o.to_instance, o.msg) for o in outs if isinstance(o.msg, Run)]


def staged(iid, rid, attempt=1, offset=0, nbytes=256):
    slot = SlotRef(instance_id=iid, offset=offset, nbytes=nbytes, tensors=[TensorSpec("x", "float32", [64], 0, 256)])
    return Staged(request_id=rid, attempt=attempt, slot=slot, compute_s=0.01)


def drive_one(h, rid="r1"):
    """Take a submitted request through all three stages; return the Result."""
    [(enc, run)] = runs(h.submit(rid, seed=5))
    assert run.source is None and run.params.seed == 5
    [(den, run)] = runs(h.role(enc, staged(enc, rid)))
    assert run.source.slot.instance_id == enc and run.source.engine == "shm"
    out = h.role(den, Fetched(request_id=rid, attempt=1))
    assert [(o.to_instance, type(o.msg)) for o in out] == [(enc, Release)]
    [(dec, run)] = runs(h.role(den, staged(den, rid)))
    h.role(dec, Fetched(request_id=rid, attempt=1))
    out = h.role(dec, Done(request_id=rid, attempt=1, num_images=1), [b"png"])
    [res] = [o for o in out if isinstance(o.msg, Result)]
    assert res.to_client == CLIENT and res.frames == [b"png"]
    return res.msg


def drive_rest(h, rid, enc):
    [(den, _)] = runs(h.role(enc, staged(enc, rid)))
    [(dec, _)] = runs(h.role(den, staged(den, rid)))
    out = h.role(dec, Done(request_id=rid, attempt=1, num_images=1), [b"png"])
    return [o.msg for o in out if isinstance(o.msg, Result)][0]


MC = ("shm", "mooncake", "inline")
