"""The values of every choice-valued setting, one enum each: the schema types its fields with them, and the code
dispatches on the members (or on a registry keyed by them), never on spelled strings. A member equals its string,
which is what config files, DISAGG_ variables, flags and the settings JSON a process decodes spell."""

from __future__ import annotations

from disagg.transport.data.selection import Transfer  # noqa: F401 - the transfer engines are the wire's vocabulary
from disagg.transport.wire.choice import Choice


class Dtype(Choice):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class TransferProtocol(Choice):
    DEFAULT = ""  # rdma when ib_device names a NIC, else tcp (Settings.protocol)
    TCP = "tcp"
    RDMA = "rdma"


class Dispatch(Choice):
    """disagg/orchestrator/scheduling/dispatch.py's POLICIES implements each."""

    MAX_FREE_SLOTS = "max-free-slots"
    ROUND_ROBIN = "round-robin"
    LEAST_WORK = "least-work"


class Schedule(Choice):
    FIFO = "fifo"
    SLO = "slo"


class Admission(Choice):
    OFF = "off"
    SLO = "slo"


class CompileMode(Choice):
    DEFAULT = "default"
    REDUCE_OVERHEAD = "reduce-overhead"
    MAX_AUTOTUNE = "max-autotune"
    MAX_AUTOTUNE_NO_CUDAGRAPHS = "max-autotune-no-cudagraphs"

    @property
    def cuda_graphs(self) -> bool:
        """Modes that replay CUDA graphs."""
        return self in (CompileMode.REDUCE_OVERHEAD, CompileMode.MAX_AUTOTUNE)


class CompileScope(Choice):
    BLOCKS = "blocks"
    MODEL = "model"


class LoraAffinity(Choice):
    """loras.affinity, and the load rule it resolves to (disagg/orchestrator/scheduling/loras.py): auto is never a rule."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"
    COST = "cost"
    SLACK = "slack"
    TWO_CHOICES = "two-choices"


class RebalanceMode(Choice):
    OFF = "off"
    ADVISE = "advise"
    AUTO = "auto"


class Role(Choice):
    """A role of the pools (the keys of parallel and gpus_per)."""

    ENCODER = "encoder"
    DENOISER = "denoiser"
    DECODER = "decoder"
