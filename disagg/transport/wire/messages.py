"""Every message on every disagg socket: typed msgspec structs, encoded as msgpack.

A message travels as the first ZeroMQ frame; raw byte frames (images, inline tensors) may
follow it. Decoding validates types, ranges and unknown fields, so a peer that sends bytes can
neither run code here nor smuggle in a malformed message.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from disagg.transport.wire.codes import ErrorCode  # noqa: F401 - messages carry it; users import it from here
from disagg.transport.wire.descriptors import (  # noqa: F401 - part of the wire schema, imported from here too
    Count,
    CudaIpcHandle,
    Held,
    HeldPreview,
    Id,
    ModelIdentity,
    PoolInfo,
    Role,
    SlotRef,
    Source,
    TensorSpec,
)
from disagg.transport.wire.params import MAX_INPUT_BYTES, GenerationParams, LoraName, LoraRef  # noqa: F401 - likewise
from disagg.transport.wire.role_messages import (  # noqa: F401 - role <-> orchestrator messages, imported from here too
    Alive,
    Dead,
    Done,
    Failed,
    Fetched,
    Forward,
    Heartbeat,
    Preview,
    Register,
    Registered,
    Release,
    Run,
    Shutdown,
    Staged,
    Withdraw,
    cache_report,
)
from disagg.transport.wire.role_stats import BootStats, CacheStats, CompileStats, LoraStats, MemoryStats  # noqa: F401 - inside Heartbeat
from disagg.transport.wire.status import (  # noqa: F401
    SLACK_BUCKETS_S,
    GatewayStatus,
    InstanceStatus,
    PairEngine,
    RebalanceStatus,
    RequestCounts,
    RoleMove,
    SloCount,
    SplitRate,
    StageTime,
    TransferCount,
)
from disagg.transport.wire.wire import Seconds, _Msg  # noqa: F401 - the base of every message

#: Largest control message we decode; anything bigger is refused before parsing (a Submit with an image
#: and a mask at their limits fits)
MAX_MESSAGE_BYTES = 2 * MAX_INPUT_BYTES + 4 * 1024 * 1024
#: Largest total of the raw frames that may follow a message (images, inline tensors).
MAX_FRAMES_BYTES = 512 * 1024 * 1024

ROLES = ("encoder", "denoiser", "decoder", "monolith")
#: every role heartbeats this often; an orchestrator's heartbeat timeout must be at least twice it
HEARTBEAT_INTERVAL_S = 1.0
#: `standby`: loaded and registered, given no work until an instance of its role dies (--standby)
STATES = ("starting", "ready", "standby", "draining", "dead")



# --- client <-> orchestrator ----------------------------------------------------------------


class Submit(_Msg, tag="submit", kw_only=True):
    """Client asks for one generation."""

    request_id: Id
    params: GenerationParams
    timeout_s: Annotated[float, Meta(gt=0, le=86_400)] | None = None
    #: sent again, under the same id, to an orchestrator that restarted since the first Submit: the roles
    #: may still hold its stages' outputs, so the new orchestrator resumes it from the furthest one
    resume: bool = False
    #: seconds since the client first sent it (a resume): its deadline (params.slo_ms) still counts from then
    age_s: Annotated[float, Meta(ge=0, le=86_400)] = 0.0


class Result(_Msg, tag="result", kw_only=True):
    """The end of a request: images (one raw frame each) on success, else an error."""

    request_id: Id
    ok: bool
    error: str | None = None
    image_format: str = "png"
    num_images: Count = 0
    seed: int | None = None
    attempts: Count = 1
    #: seconds per phase: queue_<role>, compute_<role>, fetch_<role>, total
    timings: dict[str, float] = {}
    #: the parameters the model ran with, its defaults filled in (width, height, num_inference_steps,
    #: guidance_scale, model, ...): what a manifest of the outputs records
    resolved: dict[str, str | int | float] = {}
    #: the request ended because the deployment is stopping: a client submits nothing more to it
    stopping: bool = False
    #: why it failed, for programs (disagg/transport/wire/codes.py), and the request field at fault if one is
    code: ErrorCode | None = None
    param: str | None = None


class Partial(_Msg, tag="partial", kw_only=True):
    """A live preview of a request (GenerationParams.previews): its `index`th, decoded from the latents after
    denoising step `step` of `steps`. One raw frame follows: the image, in `image_format`."""

    request_id: Id
    index: Annotated[int, Meta(ge=0, le=2)]
    step: Count
    steps: Count
    image_format: str = "png"
    #: when the denoiser staged its latents (Unix time, the denoiser's clock)
    staged_at: float = 0.0


class Rejected(_Msg, tag="rejected", kw_only=True):
    """A message the orchestrator would not take, with the reason."""

    request_id: str | None = None
    reason: str
    #: why, for programs (disagg/transport/wire/codes.py); `param`: the request field at fault, if one is
    code: ErrorCode = ErrorCode.INVALID_REQUEST
    param: str | None = None


class StatusQuery(_Msg, tag="status_query", kw_only=True):
    """Client asks for a stats snapshot."""


class StatusReport(_Msg, tag="status_report", kw_only=True):
    """The orchestrator's stats snapshot."""

    orchestrator: dict[str, str | int | float]
    instances: list[InstanceStatus]
    queues: dict[str, int]
    requests: RequestCounts
    throughput_rps: float = 0.0
    #: bytes moved between stages, per edge and engine
    transfers: list[TransferCount] = []
    #: per pair of instances that handed data over: the engine chosen for it (per host: mooncake across); the
    #: 1,024 pairs that handed over most recently
    pairs: list[PairEngine] = []
    #: the HTTP gateways serving this deployment
    gateways: list[GatewayStatus] = []
    #: per role and phase (queue, compute, fetch): requests and their seconds summed, every client's
    stage_times: list[StageTime] = []
    #: the LoRA adapters requests may name (loras.dir, loras.adapters), sorted; at most 4096. `any_lora`: a sim
    #: model, which takes any adapter name
    loras: list[str] = []
    any_lora: bool = False
    #: `schedule`: fifo or slo; per role, the least slack (seconds) of the requests waiting in its queue that
    #: have a deadline; per priority, deadlines met and missed (SloCount). "" only from an orchestrator that does
    #: not say (the setting's default is the schema's, disagg/settings/schema.py)
    schedule: str = ""
    queue_slack: dict[str, float] = {}
    slo: list[SloCount] = []
    #: `rebalance` advise/auto: the recommended split and the moves in progress (None: rebalance off)
    rebalance: RebalanceStatus | None = None
    #: the last warnings an operator should see (an inline transfer between hosts, ...), oldest first; a
    #: launcher prints each new one on its console
    warnings: list[str] = []


class Cancel(_Msg, tag="cancel", kw_only=True):
    """A client gives up a request it sent (queued: it leaves its queue; running: its role stops at
    the next denoising step or after the current stage); no Result follows. The orchestrator sends
    the same message, with the attempt, to the role running it."""

    request_id: Id
    attempt: Count | None = None


class RequestQuery(_Msg, tag="request_query", kw_only=True):
    """A client asks where its requests are (the HTTP gateway's video jobs report progress from it)."""

    request_ids: Annotated[list[Id], Meta(max_length=1024)]


class RequestState(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where one request is: queued or running in `stage`; `step` of `steps` denoising steps done
    (as its denoiser last reported, once a second). `unknown`: ended, or never seen."""

    state: Literal["queued", "running", "unknown"]
    stage: str = ""
    step: Count = 0
    steps: Count = 0
    #: seconds from now until it is predicted to finish (from measured stage times); None: no estimate yet
    finish_in_s: float | None = None
    #: its deadline (slo_ms after arrival) less now and less that prediction; None: no deadline
    slack_s: float | None = None


class RequestStates(_Msg, tag="request_states", kw_only=True):
    """The orchestrator's answer to a RequestQuery."""

    states: dict[str, RequestState]


class GatewayBeat(_Msg, tag="gateway_beat", kw_only=True):
    """An HTTP gateway says it serves this deployment (every second; no answer): `status` lists it."""

    url: Annotated[str, Meta(max_length=512)]
    pid: Count
    restarts: Count = 0


class Stop(_Msg, tag="stop", kw_only=True):
    """Client asks the deployment to shut down; with drain, after in-flight work finishes."""

    drain: bool = False
    #: stop only if this is the orchestrator's id (a launcher stops the one it started, never a
    #: successor that took its port); empty = whichever answers
    orchestrator_id: Annotated[str, Meta(max_length=64)] = ""


class StopHost(_Msg, tag="stop_host", kw_only=True):
    """Stop the instances of one host only (a join host's Ctrl-C, `disagg stop --host H`). Without drain
    they are shut down now and their work moves elsewhere; with drain they get no new work and are
    shut down once what they run and hold is done. Answered with Stopping (or Rejected: no such host)."""

    host_id: Annotated[str, Meta(min_length=1, max_length=256)]
    drain: bool = False
    #: only the instances this launcher started (Register.launcher): a join launcher's Ctrl-C stops what it
    #: started, never the other instances of its host (the head's own, when both run on one machine)
    launcher: Annotated[str, Meta(max_length=128)] = ""


class Stopping(_Msg, tag="stopping", kw_only=True):
    """Orchestrator acknowledges a Stop."""


class Bundle(_Msg, tag="bundle", kw_only=True):
    """Several messages for one peer in one ZeroMQ message (any direction).

    Under load a loop turn has many messages for the same peer; sending them as one costs one
    trip through ZeroMQ instead of one each. `messages[i]` is one encoded message of the kind the
    socket carries, and the next `frames[i]` raw frames after the bundle belong to it. A bundle
    never holds a bundle; one message alone always travels bare."""

    messages: Annotated[list[msgspec.Raw], Meta(min_length=1, max_length=65_536)]
    frames: list[Count]


class IdleDevice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A launcher's device between two roles: `instance_id` (of role `role`) exited there for a move."""

    instance_id: Id
    role: Role


class LauncherPoll(_Msg, tag="launcher_poll", kw_only=True):
    """A launcher asks for its orders (`rebalance: auto`), about twice a second; answered with Reroles. It also
    tells the orchestrator this launcher is there to take them: only instances of a launcher heard from in the
    last few seconds are moved."""

    launcher: Annotated[str, Meta(min_length=1, max_length=128)]
    #: every instance id this launcher started in this deployment, running or ended: a move never takes one
    #: (a successor orchestrator knows nothing of the ids its predecessor retired)
    ids: Annotated[list[Id], Meta(max_length=4096)] = []
    #: its devices whose instance exited to change role (Shutdown.move) and that no Rerole has given one yet: an
    #: orchestrator that restarted during the move gives them one
    idle: Annotated[list[IdleDevice], Meta(max_length=4096)] = []


class Rerole(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Start `new_id` as `role` on the device instance `instance_id` had: that instance was drained and told to
    exit, so its process ends (or has ended) with status 0."""

    instance_id: Id
    new_id: Id
    role: Role


class Reroles(_Msg, tag="reroles", kw_only=True):
    """The orders of the launcher that sent LauncherPoll (the same order again until its instance registered)."""

    orders: Annotated[list[Rerole], Meta(max_length=4096)] = []


ClientMessage = Union[Submit, StatusQuery, Stop, StopHost, Cancel, RequestQuery, GatewayBeat, LauncherPoll]
ServerReply = Union[Result, Partial, Rejected, StatusReport, Stopping, RequestStates, Reroles]
RoleMessage = Union[Register, Heartbeat, Fetched, Staged, Preview, Done, Failed, Dead, Forward]
OrchestratorCommand = Union[Registered, Alive, Run, Release, Shutdown, Rejected, Cancel, Withdraw]
#: what one role sends another on its peer lane (disagg/roles/peers.py)
PeerMessage = Union[Forward]
KINDS = (ClientMessage, ServerReply, RoleMessage, OrchestratorCommand, PeerMessage)

_encoder = msgspec.msgpack.Encoder()
#: by the union's id: hashing a typing.Union costs more than the lookup it serves (decode runs per message)
_decoders = {id(kind): msgspec.msgpack.Decoder(kind) for kind in KINDS}


class MessageError(ValueError):
    """A frame that is not a valid message of the expected kind."""


def encode(msg: msgspec.Struct) -> bytes:
    """Serialise one message to msgpack bytes."""
    return _encoder.encode(msg)


def decode(data: bytes | memoryview, kind=ClientMessage):
    """Parse and validate one message of `kind` (a union above); raise MessageError if bad."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return _decoders[id(kind)].decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MessageError(str(exc)) from None


#: a request's `seed` that asks for a random one, as diffusers' users write it (the same as leaving it out)
RANDOM_SEED = -1


#: the names other tools give a request's fields: an unknown field among them is answered with ours
FIELD_ALIASES = {"steps": "num_inference_steps", "num_steps": "num_inference_steps", "cfg": "guidance_scale",
                 "cfg_scale": "guidance_scale", "guidance": "guidance_scale", "negative": "negative_prompt",
                 "n": "num_images_per_prompt", "num_images": "num_images_per_prompt", "batch_size": "num_images_per_prompt",
                 "frames": "num_frames", "size": "width and height", "lora": "loras"}


def _explained(message: str) -> str:
    """msgspec's message for request parameters, with what it leaves out: the field an unknown one probably
    meant ("did you mean num_inference_steps?"), and `seed`'s -1 beside its bound."""
    import difflib
    import re

    m = re.fullmatch(r"Object contains unknown field `([^`]+)`", message)
    if m:
        name = m.group(1)
        meant = FIELD_ALIASES.get(name.lower()) or next(iter(difflib.get_close_matches(
            name, GenerationParams.__struct_fields__, n=1, cutoff=0.6)), None)
        return f"{message} (did you mean {meant}?)" if meant else message
    if message.endswith("- at `$.seed`") and ">= 0" in message:
        return message.replace(">= 0", f">= 0, or {RANDOM_SEED} for a random seed", 1)
    return message


def params_from_obj(obj: object) -> GenerationParams:
    """Validate a decoded JSON object as request parameters; errors name the field. `seed: -1` is a random seed
    (the orchestrator picks one and reports it)."""
    if isinstance(obj, dict) and obj.get("seed") == RANDOM_SEED:
        obj = {k: v for k, v in obj.items() if k != "seed"}
    try:
        return msgspec.convert(obj, GenerationParams)
    except msgspec.ValidationError as exc:
        raise MessageError(_explained(str(exc))) from None


#: exit status of a process that failed before it was ready (bad config, missing model):
#: the launcher stops with its error instead of restarting it
BOOT_ERROR_EXIT = 78
#: a role's exit status when it exits to change role (Shutdown.move): not restarted, its device awaits a Rerole
MOVE_EXIT = 79
