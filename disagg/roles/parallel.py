"""One denoiser instance over several ranks (processes, one device each): CFG-parallel and context-parallel.

Rank 0 is the role process the orchestrator knows: it pulls a request's inputs, shares them with the other
ranks over torch.distributed (gloo on the CPU, NCCL on GPUs), runs its part, and stages the output. The
other ranks (followers) never talk to the orchestrator: each waits for the next shared request and runs
the same pipeline call in lockstep, its part only.

- ulysses / ring: diffusers' context parallelism (`ContextParallelConfig`, `enable_parallelism`) shards
  the transformer's sequence over the ranks of those mesh dimensions.
- cfg: the classifier-free guidance batch (negative and positive rows, which SD3's and SDXL's pipelines
  put through one forward) is split over the ranks of that dimension, each forward's output gathered.

Every rank asks rank 0 at each denoising step whether to go on, so a cancelled request stops on all ranks
together. Nothing here is pickled: a request travels as msgpack bytes and raw tensors.

Two process groups: the request channel (gloo, on the CPU), over which rank 0 tells the followers what comes
next (a request, or stop), and the compute group (gloo on the CPU, NCCL on GPUs: the request's tensors, each
step's go-on, the attention's and CFG's collectives). A follower waits for the next request on the channel,
which has no practical timeout (IDLE_WAIT_S): an idle instance is not a broken one. Inside a request every
collective keeps COLLECTIVE_TIMEOUT_S, so a rank that hangs mid-request is found.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from unittest import mock

import msgspec
import torch
import torch.distributed as dist

from disagg.roles.errors import GroupBroken
from disagg.roles.layout import KINDS, describe_layout, world_of
from disagg.transport.data.manifest import dtype_name, dtype_of
from disagg.transport.wire.messages import GenerationParams

log = logging.getLogger("disagg.role")

#: how long a rank waits for the others in a collective of a request before it gives up (a dead rank is found
#: sooner: the launcher stops the whole group when one of its processes dies). Read when a Group is made.
COLLECTIVE_TIMEOUT_S = 120

#: how long a follower waits on the request channel for the next request: idleness is no failure (a year: gloo
#: takes no "never"; a rank 0 that dies closes its sockets, which ends the wait at once)
IDLE_WAIT_S = 365 * 86400

#: the attention backend ring attention runs on a GPU: diffusers' default `native` refuses `return_lse=True`,
#: which the ring's merge of partial results needs; `_native_cudnn` (torch's cuDNN SDPA, in every CUDA build)
#: returns it, takes attention masks (Qwen-Image passes one; flash-attn 2 refuses them) and runs context parallel
RING_BACKEND = "_native_cudnn"


def is_group_failure(exc: BaseException) -> bool:
    """An error of the ranks' communication (gloo, NCCL), not of the request: every rank fails a bad
    request alike and stays in step, but a lost rank breaks the group."""
    if isinstance(exc, GroupBroken) or isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed"))


class Shared(msgspec.Struct, array_like=True):
    """What rank 0 tells the other ranks before a request: its parameters and its input tensors' layout."""

    params: GenerationParams | None  # None: stop serving
    tensors: list[tuple[str, str, list[int]]] = []


class Group:
    """This process's place in its instance's ranks, and the collectives they run together."""

    def __init__(self, layout: dict[str, int], rank: int, init_method: str, device: str):
        self.layout = {k: int(layout.get(k, 1)) for k in KINDS}
        self.world = world_of(self.layout)
        self.rank = rank
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        #: what comes next (a request's header, or stop): waited on between requests, so no timeout to speak of
        self.channel = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_WAIT_S))
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, tuple(self.layout[k] for k in KINDS), mesh_dim_names=KINDS)
        log.info("rank %d of %d (%s) joined its group", rank, self.world, describe_layout(self.layout))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # --- what runs on every rank ---------------------------------------------------------------------

    def apply(self, model: torch.nn.Module) -> None:
        """Make the denoising model run its part: context-parallel attention, a CFG-split batch."""
        cp = self.layout["ulysses"] * self.layout["ring"]
        if cp > 1:
            from diffusers import ContextParallelConfig

            u, r = self.layout["ulysses"], self.layout["ring"]
            if r > 1:  # before enable_parallelism, which checks that the backend runs context parallel
                backend = ring_backend(self.device.type, next(model.parameters()).dtype)
                model.set_attention_backend(backend)
                log.info("ring %d: attention backend %s (it returns the log-sum-exp the ring merges with)", r, backend)
            # "anything": sequence lengths (a prompt's tokens, an image's) that the degree does not divide
            config = ContextParallelConfig(ulysses_degree=u, ring_degree=r, mesh=self.mesh["ring", "ulysses"],
                                           ulysses_anything=u > 1 and r == 1, ring_anything=r > 1 and u == 1)
            # diffusers places each rank on accelerator `rank % device_count()`: none on a CPU host, where
            # every rank is on the one CPU device
            patch = (mock.patch.object(torch.accelerator, "device_count", lambda: 1)
                     if self.device.type == "cpu" else contextlib.nullcontext())
            with patch:
                model.enable_parallelism(config=config)
            log.info("context parallel: %s over %d ranks (%s)", describe_layout(self.layout), self.world,
                     type(model).__name__)
        if self.layout["cfg"] > 1:
            split_cfg(model, self.mesh["cfg"].get_group(), self.layout["cfg"], self.mesh["cfg"].get_local_rank())

    def go_on(self, stop: bool = False) -> bool:
        """At each denoising step: rank 0 says whether the request goes on (False: it was cancelled)."""
        flag = torch.tensor([1 if stop else 0], dtype=torch.int64, device=self._comm_device)
        self._collective(dist.broadcast, flag, src=0)
        return not bool(flag.item())

    # --- sharing a request ------------------------------------------------------------------------------

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _collective(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise RuntimeError and DistBackendError
            raise GroupBroken(f"the instance's ranks lost each other ({type(exc).__name__}: {exc})") from None

    def _send_bytes(self, data: bytes) -> None:
        """On the request channel (CPU tensors, gloo)."""
        n = torch.tensor([len(data)], dtype=torch.int64)
        self._collective(dist.broadcast, n, src=0, group=self.channel)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._collective(dist.broadcast, buf, src=0, group=self.channel)

    def _recv_bytes(self) -> bytes:
        """On the request channel: the wait for the next request, as long as the instance stays idle."""
        n = torch.zeros(1, dtype=torch.int64)
        self._collective(dist.broadcast, n, src=0, group=self.channel)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        self._collective(dist.broadcast, buf, src=0, group=self.channel)
        return bytes(buf.numpy())

    def share(self, params: GenerationParams, inputs: dict[str, torch.Tensor]) -> None:
        """Rank 0: send the request to the other ranks (they run it with us)."""
        specs = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in inputs.items()]
        self._send_bytes(msgspec.msgpack.encode(Shared(params, specs)))
        for name, _, _ in specs:
            t = inputs[name].contiguous().to(self._comm_device)
            self._collective(dist.broadcast, t.view(torch.uint8) if t.dtype == torch.bool else t, src=0)

    def receive(self) -> tuple[GenerationParams | None, dict[str, torch.Tensor]]:
        """The other ranks: the next request rank 0 shares (None: stop)."""
        shared = msgspec.msgpack.decode(self._recv_bytes(), type=Shared)
        inputs = {}
        for name, dtype, shape in shared.tensors:
            t = torch.empty(shape, dtype=dtype_of(dtype), device=self._comm_device)
            self._collective(dist.broadcast, t.view(torch.uint8) if t.dtype == torch.bool else t, src=0)
            inputs[name] = t
        return shared.params, inputs

    def stop(self) -> None:
        """Rank 0, leaving: the other ranks stop too."""
        try:
            self._send_bytes(msgspec.msgpack.encode(Shared(None)))
        except GroupBroken:
            pass

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def ring_backend(device_type: str, dtype: torch.dtype) -> str:
    """The attention backend ring attention runs on (RING_BACKEND); a ValueError says why it cannot run here."""
    if device_type != "cuda":
        raise ValueError(f"ring attention needs an attention backend that returns its log-sum-exp ({RING_BACKEND}, "
                         f"cuDNN's, on GPUs); none does on {device_type}: use ulysses")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"ring attention on GPUs runs {RING_BACKEND} (cuDNN), which takes bfloat16 or float16, and "
                         f"this model's weights are {dtype_name(dtype)}: set dtype bfloat16 (a checkpoint), or use ulysses")
    return RING_BACKEND


def split_cfg(model: torch.nn.Module, group, degree: int, rank: int) -> None:
    """Each forward: this rank computes its share of the batch rows (CFG's negative and positive halves),
    and every rank gets the whole output back (all_gather). A batch that does not divide runs whole."""
    forward = model.forward

    def part(x, b: int, n: int):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == b:
            return x[rank * n:(rank + 1) * n]
        if isinstance(x, dict):
            return {k: part(v, b, n) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(part(v, b, n) for v in x)
        return x

    def cfg_forward(*args, **kw):
        hidden = kw.get("hidden_states", kw.get("sample", args[0] if args else None))
        b = hidden.shape[0]
        if b % degree:
            return forward(*args, **kw)
        n = b // degree
        if not split_cfg.logged:
            split_cfg.logged = True
            log.info("cfg %d: a forward's %d rows split, rows %d-%d on this rank", degree, b, rank * n, (rank + 1) * n - 1)
        out = forward(*part(args, b, n), **part(kw, b, n))
        sample = out[0] if isinstance(out, tuple) else out.sample
        pieces = [torch.empty_like(sample) for _ in range(degree)]
        try:
            dist.all_gather(pieces, sample.contiguous(), group=group)
        except Exception as exc:  # noqa: BLE001
            raise GroupBroken(f"the instance's ranks lost each other ({type(exc).__name__}: {exc})") from None
        whole = torch.cat(pieces)
        if isinstance(out, tuple):
            return (whole, *out[1:])
        out.sample = whole
        return out

    model.forward = cfg_forward


split_cfg.logged = False


def denoising_model(adapter) -> torch.nn.Module:
    pipe = adapter.pipe if adapter.capabilities.family else None  # only a diffusers pipeline's model spans ranks
    model = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    if model is None:
        raise RuntimeError(f"{type(adapter).__name__} holds no transformer or UNet to run over several ranks")
    return model


def serve_follower(group: Group, stage) -> int:
    """A rank other than 0: run every request rank 0 shares, in lockstep, until it says stop or is gone."""
    log.info("rank %d serving", group.rank)
    while True:
        try:
            params, inputs = group.receive()
        except GroupBroken as exc:
            log.warning("rank %d: %s; exiting", group.rank, exc)
            return 1
        if params is None:
            log.info("rank %d: rank 0 stopped; exiting", group.rank)
            return 0
        try:
            stage.run(params, inputs)
        except GroupBroken as exc:
            log.warning("rank %d: %s; exiting", group.rank, exc)
            return 1
        except Exception as exc:  # noqa: BLE001 - rank 0 fails the same request alike, and reports it
            log.warning("rank %d: request failed here too: %s: %s", group.rank, type(exc).__name__, exc)
