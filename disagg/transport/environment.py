"""Every environment variable our code sets or reads by name, declared once: what the launcher sets for the
processes it starts, what they set for their libraries or read of theirs, and every DISAGG_ variable that is not
a setting's.

Each constant's value is its own name (`DISAGG_RUN_ID = "DISAGG_RUN_ID"`), so grepping a variable's name finds
every use; the code names a variable only through these (tests/test_architecture_doc.py refuses a `"DISAGG_..."`
string elsewhere in disagg/). A setting's own variable (DISAGG_<PATH>, disagg/settings/fields.py) is declared
here only where code reads or sets it by name: it names its `setting`. docs/architecture.md §2's table of
variables is generated from this module and from where the code uses each (`python -m disagg.docs_gen --write`).

The ground floor: it imports nothing of ours, and every part of disagg may import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    #: what it holds, for people
    what: str
    #: the setting whose DISAGG_ variable it is ("http.api_key"); "" for a variable that is no setting's
    setting: str = ""


VARIABLES: list[Variable] = []


def _declare(name: str, what: str, setting: str = "") -> str:
    VARIABLES.append(Variable(name, what, setting))
    return name


# --- what the launcher tells the processes it starts ------------------------------------------------------------
DISAGG_RUN_ID = _declare(
    "DISAGG_RUN_ID", "the run's id (= the deployment id; shared memory names start `disagg-RUNID-`); a process "
    "started by a launcher exits with it and removes what dead processes of its run left")
DISAGG_RESTARTS = _declare(
    "DISAGG_RESTARTS", "how often this child was restarted: roles copy it into `Register.restarts`, the "
    "orchestrator starts recovery when > 0, the gateway reports it in `GatewayBeat`")
DISAGG_LAUNCHER_PID = _declare(
    "DISAGG_LAUNCHER_PID", "the launcher's pid: its processes exit when it is gone")
DISAGG_DIST_INIT = _declare(
    "DISAGG_DIST_INIT", "a parallel group's rendezvous, `file://RUN_DIR/dist/GROUP.GEN` (a fresh one each time the "
    "group starts again)")
DISAGG_TITLE_ROOM = _declare(
    "DISAGG_TITLE_ROOM", "the fork server's: room in its environment for its forked roles' process titles")
DISAGG_FORK_SERVER_PID = _declare(
    "DISAGG_FORK_SERVER_PID", "set by the fork server in a role it forked: its pid (the role's parent)")
DISAGG_HTTP_API_KEY = _declare(
    "DISAGG_HTTP_API_KEY", "the gateway's API key: the launcher (and `serve-http`) passes it here, blanked in the "
    "settings JSON on argv, where `ps` shows it", setting="http.api_key")
DISAGG_HTTP_API_KEYS = _declare(
    "DISAGG_HTTP_API_KEYS", "the gateway's other API keys, as JSON, for the same reason", setting="http.api_keys")

# --- what people set ----------------------------------------------------------------------------------------------
DISAGG_LOG_LEVEL = _declare("DISAGG_LOG_LEVEL", "log level of the orchestrator, gateway and role processes "
                            "(default INFO)")
DISAGG_HOST_ID = _declare("DISAGG_HOST_ID", "this host's id, as launchers and `status --ready-here` name hosts "
                          "(default: the machine's)")
DISAGG_ENDPOINT = _declare("DISAGG_ENDPOINT", "the orchestrator's client endpoint `disagg status/submit/stop/"
                           "bench/serve-http` use (default tcp://127.0.0.1:5555)")
DISAGG_KEYS = _declare("DISAGG_KEYS", "the keys folder; the client commands' `--keys` default", setting="keys")
DISAGG_API_KEY = _declare("DISAGG_API_KEY", "older name of DISAGG_HTTP_API_KEY (still read, with a warning); "
                          "`bench --http`'s `--api-key` default")

# --- read by scripts and tests, not by disagg/ ----------------------------------------------------------------
DISAGG_HEAD_ROLES = _declare("DISAGG_HEAD_ROLES", "deploy/slurm/disagg.sbatch: the instances on the head node")
DISAGG_HEAD_ADDR = _declare("DISAGG_HEAD_ADDR", "deploy/slurm/disagg.sbatch: the address the other nodes reach "
                            "the head at")
DISAGG_HEAD_WAIT = _declare("DISAGG_HEAD_WAIT", "deploy/slurm/disagg.sbatch: seconds the head's orchestrator has "
                            "to answer")
DISAGG_RUN_DIR = _declare("DISAGG_RUN_DIR", "deploy/slurm/disagg.sbatch: the job's run folder")
DISAGG_BIN = _declare("DISAGG_BIN", "deploy/slurm/disagg.sbatch: the disagg command to run")
DISAGG_GPUS_PER_DENOISER = _declare("DISAGG_GPUS_PER_DENOISER", "deploy/slurm/disagg.sbatch: GPUs (ranks) per "
                                    "denoiser, a parallel layout; a node with fewer fails the job before it starts")
DISAGG_TEST_BOOT_HOLD = _declare(
    "DISAGG_TEST_BOOT_HOLD", "a test hook (disagg/roles/boot.py): `INSTANCE:progress|hang:PATH` holds that role's "
    "boot until PATH exists")
DISAGG_SAVE_SHOT = _declare("DISAGG_SAVE_SHOT", "tests/test_demo.py (the web page): keep the page's screenshot "
                            "in benchmarks/results/")

# --- not ours: what the launcher sets for its children ----------------------------------------------------------
PYTHONUNBUFFERED = _declare("PYTHONUNBUFFERED", "1: children's logs are written as they come")
PYTHONPATH = _declare("PYTHONPATH", "the folder that holds `disagg` first, then the launcher's: a checkout runs "
                      "without an install")
HF_HUB_OFFLINE = _declare("HF_HUB_OFFLINE", "the launcher's; unset: 0 for a Hugging Face id (each role downloads "
                          "its own weights), else 1")
MC_LOG_LEVEL = _declare("MC_LOG_LEVEL", "Mooncake's log level: the launcher's, default ERROR")
CUDA_VISIBLE_DEVICES = _declare("CUDA_VISIBLE_DEVICES", "a role's GPUs, its own first (its cuda:0), as entries "
                                "of the launcher's own list when it has one; empty on the CPU")
CUDA_DEVICE_ORDER = _declare("CUDA_DEVICE_ORDER", "a role's: the launcher's, else PCI_BUS_ID")
OMP_NUM_THREADS = _declare("OMP_NUM_THREADS", "a role's: the CPUs it is pinned to")

# --- not ours: what our processes set for their libraries, or read of theirs --------------------------------------
PYTORCH_NVML_BASED_CUDA_CHECK = _declare(
    "PYTORCH_NVML_BASED_CUDA_CHECK", "1 in a spare interpreter and the fork server before they import torch: an "
    "`is_available()` must not initialise CUDA before the role's CUDA_VISIBLE_DEVICES comes")
TORCHINDUCTOR_CACHE_DIR = _declare("TORCHINDUCTOR_CACHE_DIR", "a compiled denoiser's inductor caches: "
                                   "`compile.cache_dir`")
PYTORCH_ALLOC_CONF = _declare("PYTORCH_ALLOC_CONF", "torch's allocator settings: expandable segments or "
                              "cudaMallocAsync keep a GPU pool from being shared over CUDA IPC")
PYTORCH_CUDA_ALLOC_CONF = _declare("PYTORCH_CUDA_ALLOC_CONF", "the same, under its older CUDA name")

#: DISAGG_ variables that are not settings (disagg/settings/sources.py refuses any other unknown one)
NOT_SETTINGS = {v.name: v.what for v in VARIABLES if v.name.startswith("DISAGG_") and not v.setting}

assert all(globals()[v.name] == v.name for v in VARIABLES)
