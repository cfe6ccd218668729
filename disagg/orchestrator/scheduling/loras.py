"""LoRA adapters on the orchestrator's side: which names requests may use (the catalog), and which free
denoiser gets a request with adapters (affinity, bounded by a load rule).

The catalog is `loras.dir` (each *.safetensors file, or folder holding one, is an adapter named by its
stem; read again whenever the folder changes, so adapters added later are picked up) plus
`loras.adapters` (name -> file, folder or hub id). A sim model takes any name, with no file.

Affinity: of the instances the policy may pick from, those that hold every adapter of the request are
"warm"; a warm one gets the request whenever one is free (`on`). The load rule that keeps a popular
adapter from making a hotspot is the instance's capacity (a full holder takes nothing more) and the
patience (disagg/orchestrator/scheduling/placement.py LoraPatience): a request waits for a busy holder at most as long
as a load takes (a restore, where a free instance keeps the adapters in host memory: loras.host_slots),
then goes cold, so the adapter spreads to a second instance. A cold pick prefers instances that keep the
adapters in host memory, then those with an adapter slot to spare, so a load evicts nothing where it can. BENCHMARKS.md (LoRA
affinity) measures this against `slack` (a holder unless the best other one has more than
AFFINITY_SLACK more free slots) and `two-choices`.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from disagg.orchestrator.registry import Instance
from disagg.settings.choices import LoraAffinity
from disagg.transport.wire.params import LoraName

#: how many more free slots a cold instance must have than the best warm one to get the request instead
AFFINITY_SLACK = 1
#: The load rules are loras.affinity's own values (LoraAffinity): on (warm whenever one is free; its bound is the
#: instance's capacity and the patience of disagg/orchestrator/scheduling/placement.py LoraPatience), cost (the earliest
#: expected finish, a load and what it evicts counted: expected_finish), and the alternatives BENCHMARKS.md
#: measured them against: slack (the rule above), two-choices (the freer of two warm ones drawn at random). off
#: is no rule (None); auto resolves to cost where a denoiser keeps unloaded adapters in host memory
#: (loras.host_slots), else on, each where it measured best (placement.affinity_rule)
#: the `cost` rule's price of evicting an adapter to load another, in loads: a later request for the evicted one
#: may have to load it again (BENCHMARKS.md, LoRA affinity, has what `cost` loads with it, against `off` and `on`)
EVICTION_COST = 0.5
_NAME = msgspec.json.Decoder(LoraName)


def valid_name(name: str) -> bool:
    try:
        _NAME.decode(msgspec.json.encode(name))
        return True
    except msgspec.ValidationError:
        return False


def scan(folder: str) -> dict[str, str]:
    """name -> path of each adapter in `folder`: *.safetensors files and folders holding one."""
    out: dict[str, str] = {}
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return out
    for e in entries:
        path = Path(e.path)
        if e.is_file() and path.suffix == ".safetensors":
            name = path.stem
        elif e.is_dir() and any(path.glob("*.safetensors")):
            name = path.name
        else:
            continue
        if valid_name(name):
            out.setdefault(name, str(path))
    return out


class LoraCatalog:
    """The adapters a request may name, and where each lies."""

    def __init__(self, folder: str = "", adapters: dict[str, str] | None = None, any_name: bool = False,
                 max_per_request: int = 4):
        self.folder = folder
        self.fixed = dict(adapters or {})
        self.any_name = any_name
        self.max_per_request = max_per_request
        self._stamp: int | None = None
        self._found: dict[str, str] = {}

    def names(self) -> dict[str, str]:
        """name -> source; the folder is read again when its modification time changed."""
        if self.folder:
            try:
                stamp = os.stat(self.folder).st_mtime_ns
            except OSError:
                stamp = -1
            if stamp != self._stamp:
                self._stamp, self._found = stamp, scan(self.folder)
        return {**self._found, **self.fixed}

    def resolve(self, loras) -> tuple[dict[str, str], str]:
        """(name -> source for the request's adapters, why not: empty when every one is registered)."""
        if not loras:
            return {}, ""
        if len(loras) > self.max_per_request:
            return {}, f"loras: {len(loras)} adapters, more than loras.max_per_request ({self.max_per_request})"
        names = [r.name for r in loras]
        if len(set(names)) != len(names):
            return {}, "loras: an adapter is named twice"
        if self.any_name:
            return {n: "" for n in names}, ""
        known = self.names()
        unknown = [n for n in names if n not in known]
        if unknown:
            listed = ", ".join(sorted(known)[:20]) or "none: set loras.dir or loras.adapters"
            return {}, f"loras: unknown adapter {unknown[0]!r} (registered: {listed})"
        return {n: known[n] for n in names}, ""


def holds(inst: Instance, names) -> bool:
    return all(n in inst.lora.held for n in names)


def in_host(inst: Instance, names) -> bool:
    """Every adapter of `names` the instance lacks on its device, it keeps in host memory (a restore, not a load)."""
    return all(n in inst.lora.held or n in inst.lora.host for n in names)


def note_assigned(inst: Instance, names) -> None:
    """What the instance will hold once it loaded the request's adapters (its next heartbeat says for sure):
    the names move to the end, the first in the role's unload order (heartbeats list them so) fall off past its
    slots, into its host memory where it keeps some. A guess until then: the role unloads the adapter its latest
    requests used least (disagg/roles/extensions/loras.py)."""
    if not names:
        return
    lora = inst.lora
    kept = [n for n in lora.held if n not in names] + list(names)
    host = [n for n in lora.host if n not in names]
    if lora.slots and len(kept) > lora.slots:
        off, kept = kept[:len(kept) - lora.slots], kept[len(kept) - lora.slots:]
        if lora.host_slots:
            host = (host + off)[-lora.host_slots:]
    lora.held, lora.host = kept, host


def expected_finish(warm: bool, held_s: float, own_s: float, load_s: float, evicts: bool, back_s: float) -> float:
    """When a request would finish on an instance, from now, in seconds (the `cost` rule): `held_s`, the device
    time the requests it holds still need, or, when the request's adapters must be loaded first, that load (or
    restore) if longer (a load overlaps the device's other work); then `own_s`, its own compute; and, when the
    load evicts an adapter (`evicts`), EVICTION_COST times what bringing it back would take (`back_s`: reload_s)."""
    return max(0.0 if warm else load_s, held_s) + own_s + (EVICTION_COST * back_s if evicts else 0.0)


def reload_s(load_s: float, restore_s: float, host_slots: int, host_full: bool, cold: bool) -> float:
    """What bringing back the adapter a load evicts would take (the `cost` rule's price of an eviction): a load; where
    the instance keeps unloaded adapters in host memory (`host_slots`), a restore, plus a load where that memory is
    full and the request's adapters are not in it (`cold`): the evicted one then pushes the oldest there out, which
    a later request must load again."""
    if not host_slots:
        return load_s
    return restore_s + (load_s if cold and host_full else 0.0)


def evicts(inst: Instance, names) -> bool:
    """Loading the adapters of `names` it lacks takes an adapter slot some other adapter holds."""
    missing = sum(1 for n in names if n not in inst.lora.held)
    return bool(missing and inst.lora.slots and len(inst.lora.held) + missing > inst.lora.slots)


def pick_by_affinity(ready: list[Instance], names, rule: LoraAffinity, rng=None,
                     cost=None) -> list[Instance] | None:
    """The instances a request with adapters `names` should go to, among `ready` (dispatchable ones), for the
    policy to choose from; None when adapters make no difference (then the policy picks among all). `cost`:
    the `cost` rule's estimate (instance, warm -> seconds; LoraAffinityStep.cost)."""
    if not names or not ready:
        return None
    if rule == LoraAffinity.COST and cost is not None:
        scored = [(cost(i, warm), not warm, i) for i in ready for warm in (holds(i, names),)]
        best = min(s[:2] for s in scored)
        return [i for c, cold, i in scored if (c, cold) <= (best[0] + 1e-9, best[1])]
    warm = [i for i in ready if holds(i, names)]
    if warm:
        if rule == LoraAffinity.ON:
            return warm
        if rule == LoraAffinity.TWO_CHOICES:
            pair = rng.sample(warm, 2) if rng is not None and len(warm) > 2 else warm
            best = max(i.free_slots for i in pair)
            return [i for i in pair if i.free_slots == best]
        cold_best = max((i.free_slots for i in ready if i not in warm), default=-1)
        warm_best = max(i.free_slots for i in warm)
        if cold_best - warm_best <= AFFINITY_SLACK:
            return [i for i in warm if i.free_slots == warm_best]
    # cold: where the adapters wait in host memory (a restore), else where a load evicts nothing
    restore = [i for i in ready if not holds(i, names) and in_host(i, names)]
    if restore:
        return restore
    roomy = [i for i in ready if not holds(i, names) and (not i.lora.slots or len(i.lora.held) + len(names) <= i.lora.slots)]
    return roomy or None
