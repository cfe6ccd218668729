"""`python -m disagg.roles SPEC_JSON`: one role process (the launcher starts it); `--spare` waits to become one,
`--fork-server MODEL` forks them (disagg/roles/forks.py)."""

from __future__ import annotations

import json
import logging
import os
import sys

from disagg.transport.environment import (
    DISAGG_DIST_INIT,
    DISAGG_LOG_LEVEL,
    DISAGG_RESTARTS,
    DISAGG_RUN_ID,
    PYTORCH_NVML_BASED_CUDA_CHECK,
)
from disagg.transport.wire.messages import BOOT_ERROR_EXIT


def wait_as_spare() -> list[str] | None:
    """`python -m disagg.roles --spare`: import what every role needs (torch, diffusers, the adapters), then wait
    on stdin for the supervisor to make this process a role: one line of JSON with the role's spec, its
    environment and its log file. Empty stdin (the launcher went away): None, exit."""
    # an is_available() during the imports must not initialise CUDA: CUDA_VISIBLE_DEVICES and
    # CUDA_DEVICE_ORDER, which come with the order below, are read when it is
    os.environ.setdefault(PYTORCH_NVML_BASED_CUDA_CHECK, "1")
    import torch  # noqa: F401 - the point: imported before anyone waits for it

    import disagg.roles.worker  # noqa: F401
    from disagg.roles.pipelines import preload

    preload()
    line = sys.stdin.readline()
    if not line:
        return None
    order = json.loads(line)
    os.environ.update(order["env"])  # before anything initialises CUDA: CUDA_VISIBLE_DEVICES is read then
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return [order["spec"]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--fork-server"]:
        from disagg.roles.forks import serve

        return serve(argv[1])
    if argv[:1] == ["--spare"]:
        argv = wait_as_spare()
        if argv is None:
            return 0
    from disagg.roles.spec import spec_from_json
    from disagg.settings.process import encode

    try:
        spec = spec_from_json(argv[0])
    except Exception as exc:  # before torch is imported: a bad spec costs nothing
        print(f"bad role settings: {exc}", file=sys.stderr)
        return BOOT_ERROR_EXIT
    from disagg.roles.worker import Worker, install_signal_handlers
    spec.restarts = int(os.environ.get(DISAGG_RESTARTS, "0"))
    spec.dist_init = os.environ.get(DISAGG_DIST_INIT, spec.dist_init)  # a parallel instance's rendezvous
    logging.basicConfig(
        level=os.environ.get(DISAGG_LOG_LEVEL, "INFO").upper(),
        stream=sys.stderr,
        format=f"%(asctime)s [{spec.instance_id}] %(levelname)s %(message)s",
    )
    log = logging.getLogger("disagg.role")
    log.info("settings: %s", encode(spec))  # what it decoded, as the launcher resolved it
    group_box: list = []  # rank 0 of a parallel instance: its Group, once joined (made while the model loads)

    def join_group():
        from disagg.roles.parallel import Group

        group = Group(spec.parallel, spec.rank, spec.dist_init, spec.device)
        group_box.append(group)
        return group

    def load_stage():
        import torch

        from disagg.roles.limits import PoolFit
        from disagg.roles.pipelines import load_adapter, model_spec
        from disagg.roles.stage import Stage

        torch.set_num_threads(spec.threads or len(os.sched_getaffinity(0)))
        group = join_group() if spec.world > 1 else None
        adapter = load_adapter(spec.model, spec.role, spec.device, spec.dtype, spec.sim_slowdown,
                               spec.device_memory_bytes, spec.device_class)
        if group is not None:
            from disagg.roles.parallel import denoising_model

            group.apply(denoising_model(adapter))
        fit = PoolFit(model_spec(spec.model), spec.pool_limits) if spec.pool_limits and spec.rank == 0 else None
        from disagg.roles.extensions.loras import make_bank

        # an instance over several ranks applies no adapters (each rank would have to load them in lockstep)
        loras = make_bank(adapter, spec.role, spec.loras.slots, spec.loras.max_mib, spec.sim_slowdown,
                          compiled=spec.compile.enabled, host_slots=spec.loras.host_slots) if group is None else None
        from disagg.roles.extensions.step_cache import make_caches

        caches = make_caches(adapter, spec.role, spec.cache or None) if group is None else None
        conditioning = None
        if spec.role == "encoder" and spec.conditioning_cache_mib:
            from disagg.roles.extensions.conditioning import ConditioningCache

            conditioning = ConditioningCache(spec.conditioning_cache_mib * 2**20)
        return Stage(spec.role, adapter, spec.max_batch, fit=fit, model=spec.model,
                     sync=pool.compute_done if pool is not None else None, group=group, loras=loras,
                     schedule=spec.schedule.order, aging_s=spec.schedule.aging_s, caches=caches,
                     conditioning=conditioning)

    if spec.rank > 0:  # a follower rank of a parallel instance: no pool, no orchestrator, rank 0's lead
        from disagg.roles.parallel import GroupBroken, serve_follower

        pool = None
        try:
            stage = load_stage()
        except GroupBroken as exc:
            log.error("cannot join the instance's ranks: %s", exc)
            return 1
        code = serve_follower(group_box[0], stage)
        group_box[0].close()
        logging.shutdown()
        # at once: gloo's threads abort an interpreter that finalises around them ("terminate called ...")
        os._exit(code)
    try:
        from disagg.transport.data.pool import make_pool

        # the pid in the name: a restarted instance never reuses a name a peer may still have mapped
        spec.pool_name = f"{spec.pool_name}-{os.getpid()}"
        pool = make_pool(spec.pool_name, spec.pool_bytes, spec.device)
    except Exception as exc:
        log.error("cannot create the %d-byte pool %s: %s", spec.pool_bytes, spec.pool_name, exc)
        return BOOT_ERROR_EXIT

    from disagg.transport.data.engines import EngineUnavailable

    try:
        worker = Worker(spec, load_stage, pool)
    except EngineUnavailable as exc:
        log.error("transfer engine %s cannot start: %s", spec.transfer, exc)
        pool.close()
        return BOOT_ERROR_EXIT
    install_signal_handlers(worker)
    worker.connect()
    try:
        worker.serve_forever()
    finally:
        for group in group_box:  # the other ranks stop with us
            group.stop()
            group.close()
    run_id = os.environ.get(DISAGG_RUN_ID)
    if worker.orphaned and run_id:  # as the orphaned orchestrator does: the last one out removes what
        from disagg.transport.data.shm import SHM_PREFIX, remove_segments  # killed peers of this run left behind

        remove_segments(f"{SHM_PREFIX}{run_id}-", only_dead=True)
    return worker.exit_code


if __name__ == "__main__":
    sys.exit(main())
