"""Every message type: a round trip through msgpack, and a rejection of a malformed one."""

import msgspec
import pytest

from disagg.transport.wire import messages as m

POOL = m.PoolInfo(host_id="h", engines=["shm", "inline"], pool_name="disagg-x-encoder-0", pool_bytes=1 << 20)
SLOT = m.SlotRef(instance_id="encoder-0", offset=256, nbytes=128, tensors=[m.TensorSpec("x", "bfloat16", [2, 32], 0, 128)])
PARAMS = m.GenerationParams(prompt="a cat", width=64, height=64, seed=3)

SAMPLES = [
    (m.ClientMessage, m.Submit(request_id="r1", params=PARAMS, timeout_s=5.0)),
    (m.ClientMessage, m.StatusQuery()),
    (m.ClientMessage, m.Stop()),
    (m.ClientMessage, m.Stop(drain=True, orchestrator_id="abc123")),
    (m.ClientMessage, m.Cancel(request_id="r1")),
    (m.ClientMessage, m.RequestQuery(request_ids=["r1", "r2"])),
    (m.ClientMessage, m.GatewayBeat(url="http://127.0.0.1:8000", pid=7)),
    (m.ServerReply, m.RequestStates(states={"r1": m.RequestState(state="running", stage="denoiser", step=3, steps=28)})),
    (m.ServerReply, m.Result(request_id="r1", ok=True, num_images=1, seed=3, timings={"total": 0.5})),
    (m.ServerReply, m.Rejected(request_id="r1", reason="duplicate")),
    (m.ServerReply, m.StatusReport(orchestrator={"pid": 1}, instances=[], queues={"encoder": 0}, requests=m.RequestCounts())),
    (m.ServerReply, m.Stopping()),
    (m.RoleMessage, m.Register(role="encoder", instance_id="encoder-0", pid=5, host_id="h", device="cpu", capacity=2, pool=POOL)),
    (m.RoleMessage, m.Heartbeat(instance_id="encoder-0", ready=True, in_flight=1, pool_free_bytes=10)),
    (m.RoleMessage, m.Fetched(request_id="r1", attempt=1, fetch_s=0.001)),
    (m.RoleMessage, m.Staged(request_id="r1", attempt=1, slot=SLOT, compute_s=0.2)),
    (m.RoleMessage, m.Done(request_id="r1", attempt=1, num_images=2)),
    (m.RoleMessage, m.Failed(request_id="r1", attempt=1, error="boom")),
    (m.RoleMessage, m.Dead(instance_id="encoder-0", reason="oom")),
    (m.OrchestratorCommand, m.Registered(session=1, heartbeat_interval_s=1.0)),
    (m.OrchestratorCommand, m.Run(request_id="r1", attempt=2, params=PARAMS, source=m.Source(slot=SLOT, pool=POOL, engine="shm"))),
    (m.OrchestratorCommand, m.Release(request_id="r1", offset=256)),
    (m.OrchestratorCommand, m.Shutdown()),
    (m.OrchestratorCommand, m.Cancel(request_id="r1", attempt=2)),
    (m.RoleMessage, m.Register(role="denoiser", instance_id="denoiser-0", pid=5, host_id="h", device="cpu", capacity=1,
                               pool=POOL, deployment_id="run1", max_width=2048, max_height=2048, model="tiny")),
    (m.ServerReply, m.Result(request_id="r1", ok=False, error="stopping", stopping=True, resolved={"width": 64})),
]


@pytest.mark.parametrize("kind,msg", SAMPLES, ids=[type(s).__name__ for _, s in SAMPLES])
def test_round_trip(kind, msg):
    assert m.decode(m.encode(msg), kind) == msg


@pytest.mark.parametrize("kind,msg", SAMPLES, ids=[type(s).__name__ for _, s in SAMPLES])
def test_rejects_unknown_field(kind, msg):
    data = msgspec.msgpack.decode(m.encode(msg))
    data["surprise"] = 1
    with pytest.raises(m.MessageError, match="surprise"):
        m.decode(msgspec.msgpack.encode(data), kind)


@pytest.mark.parametrize("kind,msg", SAMPLES, ids=[type(s).__name__ for _, s in SAMPLES])
def test_rejects_wrong_kind_and_garbage(kind, msg):
    with pytest.raises(m.MessageError):
        m.decode(b"\xc1\xff garbage", kind)
    data = msgspec.msgpack.decode(m.encode(msg))
    data["type"] = "no_such_type"
    with pytest.raises(m.MessageError, match="no_such_type|Invalid value"):
        m.decode(msgspec.msgpack.encode(data), kind)


def test_role_cannot_send_client_messages():
    with pytest.raises(m.MessageError):
        m.decode(m.encode(m.Stop()), m.RoleMessage)


def test_size_limit():
    with pytest.raises(m.MessageError, match="exceeds"):
        m.decode(b"\x00" * (m.MAX_MESSAGE_BYTES + 1), m.ClientMessage)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("width", -64, "$.width"),
        ("height", 65, "$.height"),
        ("num_inference_steps", 0, "$.num_inference_steps"),
        ("seed", -2, "$.seed"),  # -1 asks for a random seed
        ("num_images_per_prompt", 99, "$.num_images_per_prompt"),
        ("guidance_scale", "high", "$.guidance_scale"),
        ("colour", "blue", "colour"),
    ],
)
def test_params_errors_name_the_field(field, value, needle):
    with pytest.raises(m.MessageError) as err:
        m.params_from_obj({"prompt": "x", field: value})
    assert needle in str(err.value)


def test_params_require_prompt():
    with pytest.raises(m.MessageError, match="prompt"):
        m.params_from_obj({"width": 64})


def test_bad_instance_id_rejected():
    msg = msgspec.msgpack.decode(m.encode(m.Heartbeat(instance_id="encoder-0")))
    msg["instance_id"] = "../../etc"
    with pytest.raises(m.MessageError, match="instance_id"):
        m.decode(msgspec.msgpack.encode(msg), m.RoleMessage)


def test_unset_request_fields_stay_off_the_wire():
    """An older orchestrator (without newer optional fields) still reads requests that do not use them."""
    import msgspec

    from disagg.transport.wire.messages import GenerationParams, Submit, encode

    raw = msgspec.msgpack.decode(encode(Submit(request_id="r1", params=GenerationParams(prompt="a cat", seed=3))))
    assert raw["params"] == {"prompt": "a cat", "seed": 3}


def test_client_ends_pending_requests_when_the_orchestrator_cannot_read_them():
    import threading

    import zmq

    from disagg.client import Client
    from disagg.launcher.ports import free_port_pair
    from disagg.transport.wire.messages import (
        ClientMessage,
        GenerationParams,
        Rejected,
        RequestCounts,
        StatusQuery,
        StatusReport,
        decode,
        encode,
    )

    port = free_port_pair()
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.bind(f"tcp://127.0.0.1:{port}")

    def serve():  # answers status, and refuses every Submit as unreadable (as an older version would)
        for _ in range(2):
            ident, payload = server.recv_multipart()
            msg = decode(payload, ClientMessage)
            reply = StatusReport(orchestrator={"id": "x"}, instances=[], queues={}, requests=RequestCounts()) if isinstance(msg, StatusQuery) else Rejected(reason="bad message: unknown field")
            server.send_multipart([ident, encode(reply)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with Client(f"tcp://127.0.0.1:{port}") as client:
        [outcome] = client.run_all([GenerationParams(prompt="a cat")], concurrency=1)
    t.join(5)
    server.close(linger=0)
    assert not outcome.ok and "unknown field" in outcome.error
