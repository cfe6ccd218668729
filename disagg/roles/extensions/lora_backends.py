"""How a LoRA adapter gets into a model, for `LoraBank` (disagg/roles/extensions/loras.py): read, install (or hotswap into an
unloaded one's place), offload to host memory and restore, forget, and which adapters and scales each forward
applies.

`DiffusersLoras` (a pipeline's components, with diffusers' own LoRA support through peft: an adapter's
text-encoder parts load where the text encoders are, its transformer / UNet parts where the denoiser is) and
`SimLoras` (sim models: any name, `load_ms` per load, no files).
"""

from __future__ import annotations

import inspect
import logging
import os
import time

from disagg.roles.errors import RequestError

log = logging.getLogger("disagg.role")

#: state-dict key prefixes of each pipeline component an adapter may carry parts for
DENOISING = ("transformer", "transformer_2", "unet")
TEXT = ("text_encoder", "text_encoder_2", "text_encoder_3")


class LoraError(RequestError):
    """An adapter that cannot be applied here (not found, corrupt, another architecture): the request fails
    with the reason; the instance and its other adapters go on."""

    def __init__(self, message: str):
        super().__init__(message, param="loras")


class DiffusersLoras:
    """A diffusers pipeline's LoRA state: load, unload, and which adapters each forward applies."""

    def __init__(self, pipe, role: str, compiled: bool = False):
        self.pipe = pipe
        #: a compiled denoiser: its models keep every loaded adapter active and take each request's scales by
        #: writing them into peft's scaling tensors in place (0: not applied), so that neither a new scale, another
        #: set of adapters, nor a request without any changes what torch.compile guards on (set_adapters and
        #: disable_lora would: a recompile each); only a new adapter's layers do, once
        self.compiled = compiled
        #: whether an adapter unloaded from the device may stay in host memory (offload / restore, diffusers'
        #: set_lora_device): not on a compiled denoiser, whose forwards keep every adapter it holds active
        self.offloads = not compiled
        #: (module id) -> the loaded peft adapter names it keeps active; per adapter, each LoRA layer's scaling tensor
        #: with its value at weight 1; and the weight each adapter's tensors hold now
        self._static: dict[int, tuple[tuple, dict, dict]] = {}
        prefixes = {"denoiser": DENOISING, "encoder": TEXT}.get(role, DENOISING + TEXT)
        #: the components this role holds that may carry an adapter's part
        self.components = [c for c in getattr(pipe, "_lora_loadable_modules", ()) if c in prefixes
                           and getattr(pipe, c, None) is not None]
        if not self.components or not hasattr(pipe, "load_lora_weights"):
            raise TypeError(f"{type(pipe).__name__} takes no LoRA adapters")
        #: component -> adapters loaded into it
        self.parts: dict[str, set[str]] = {c: set() for c in self.components}
        #: adapter -> the peft adapter name its weights sit under, where it was hotswapped into another's place
        self.alias: dict[str, str] = {}
        #: adapters loaded by hotswapping another's weights in place (install(into=...))
        self.hotswaps = 0
        import importlib.util

        self.peft = importlib.util.find_spec("peft") is not None

    def modules(self):
        return [getattr(self.pipe, c) for c in self.components]

    def read(self, name: str, source: str) -> tuple[dict, int]:
        """The adapter's parts for this role's components, and their bytes (off the model's lock)."""
        if not self.peft:
            raise LoraError("LoRA adapters need peft on the role's host: pip install 'disagg[lora]' (with torch pinned "
                            "in the same command)")
        try:
            # the alphas too where they come apart from the weights (a Flux file's `.alpha` keys, kohya SD/SDXL)
            returns_alphas = "return_alphas" in inspect.signature(self.pipe.lora_state_dict).parameters
            got = self.pipe.lora_state_dict(source, return_lora_metadata=True,
                                            **({"return_alphas": True} if returns_alphas else {}))
        except Exception as exc:  # noqa: BLE001 - a missing, corrupt or foreign file: the reason goes back
            # the path stays in this host's log; the answer names the file only
            log.warning("adapter %r cannot be read from %s: %s: %s", name, source, type(exc).__name__, exc)
            short = os.path.basename(os.path.normpath(str(source)))
            raise LoraError(f"adapter {name!r} cannot be read ({short}): {type(exc).__name__}: "
                            f"{str(exc).replace(str(source), short)}") from None
        got = got if isinstance(got, tuple) else (got,)
        state, metadata = got[0], got[-1] if len(got) > 1 else None
        alphas = got[1] if len(got) == 3 else None  # (state, network alphas, metadata)
        if not state:
            raise LoraError(f"adapter {name!r} ({os.path.basename(os.path.normpath(str(source)))}) holds no LoRA weights")
        parts = {k.split(".", 1)[0] for k in state}
        loadable = set(self.pipe._lora_loadable_modules)
        if not parts & loadable:  # another architecture's (an SDXL UNet's adapter for Flux)
            raise LoraError(f"adapter {name!r} does not fit this model: its parts are for {', '.join(sorted(parts))}; "
                            f"{type(self.pipe).__name__} takes {', '.join(sorted(loadable))}")
        # copies: safetensors maps the file into memory, and a file rewritten in place under a loaded adapter would
        # then fault the process (SIGBUS) on its next forward
        mine = {k: v.clone() for k, v in state.items() if k.split(".", 1)[0] in self.components}
        scale_by_alpha(mine, metadata or {})
        unplaced = scale_by_alphas(mine, {k: v for k, v in (alphas or {}).items() if k.split(".", 1)[0] in self.components})
        if unplaced:
            log.warning("adapter %r: %d alpha(s) name no LoRA layer found (e.g. %s): those layers load at alpha = rank",
                        name, len(unplaced), unplaced[0])
        return mine, sum(v.numel() * v.element_size() for v in mine.values())

    def install(self, name: str, state: dict, into: str | None = None) -> bool:
        """Load adapter `name`; with `into` (an adapter being unloaded for it), first try diffusers' hotswap: its
        weights replace `into`'s in place (same layers, same rank), with no peft layers removed or added (and so
        no recompile of a compiled denoiser). Returns whether it hotswapped; `into` is gone either way. `state` holds
        a part for this role (LoraBank keeps an adapter without any as a name only, installing nothing)."""
        if into is not None:
            if self._hotswap(name, state, into):
                return True
            self.forget(into)
        try:
            if any(c in DENOISING for c in self.components):
                self.pipe.load_lora_weights(dict(state), adapter_name=name)
            else:  # an encoder: load_lora_weights reads the denoiser it lacks; each text encoder takes its part
                for c in self.components:
                    self.pipe.load_lora_into_text_encoder(dict(state), network_alphas=None, text_encoder=getattr(self.pipe, c),
                                                          prefix=c, adapter_name=name, _pipeline=self.pipe)
        except Exception as exc:  # noqa: BLE001 - another architecture's adapter, wrong shapes
            self.forget(name)
            raise LoraError(f"adapter {name!r} does not fit this model: {type(exc).__name__}: {exc}") from None
        for c, held in self.pipe.get_list_adapters().items():
            if c in self.parts and name in held:
                self.parts[c].add(name)
        return False

    def _hotswap(self, name: str, state: dict, into: str) -> bool:
        """`name`'s weights in place of `into`'s, where both have parts for the same components, all of them
        denoising ones (load_lora_weights(hotswap=True)); False where diffusers refuses (other layers or rank)."""
        mine = {c for c in self.components if into in self.parts[c]}
        theirs = {k.split(".", 1)[0] for k in state}
        if not mine or mine != theirs or not mine <= set(DENOISING):
            return False
        internal = self.alias.get(into, into)
        try:
            self.pipe.load_lora_weights(dict(state), adapter_name=internal, hotswap=True)
        except Exception as exc:  # noqa: BLE001 - other target layers or ranks: unload and load instead
            log.info("adapter %s cannot take %s's place (%s): loading it instead", name, into, exc)
            return False
        for c in mine:
            self.parts[c].discard(into)
            self.parts[c].add(name)
        self.alias.pop(into, None)
        self.alias[name] = internal
        for _, scalings, applied in self._static.values():
            # peft set the slot's scaling tensors, in place, to the new adapter's at weight 1 (its alpha / rank):
            # read them again, so its weights scale those, not the old adapter's (the same tensors: no recompile)
            applied.pop(internal, None)
            if internal in scalings:
                scalings[internal] = [(tensor, float(tensor)) for tensor, _ in scalings[internal]]
        self.hotswaps += 1
        return True

    def _device(self):
        for module in self.modules():
            for p in module.parameters():
                return p.device
        return "cpu"

    def offload(self, name: str) -> None:
        """Move `name`'s weights to host memory (it must not be applied until restored); pinned when the model is on
        a GPU, so that its restore is one DMA, not a synchronous copy from pageable memory."""
        internal = self.alias.get(name, name)
        on_gpu = str(self._device()).startswith("cuda")
        self.pipe.set_lora_device([internal], "cpu")
        if on_gpu:
            pin_adapter(self.modules(), internal)

    def restore(self, name: str) -> None:
        """Move an offloaded adapter's weights back to the model's device."""
        self.pipe.set_lora_device([self.alias.get(name, name)], self._device())

    def forget(self, name: str) -> None:
        internal = self.alias.pop(name, name)
        if any(name in held for held in self.parts.values()) or internal in {
                n for held in self.pipe.get_list_adapters().values() for n in held}:
            self.pipe.delete_adapters(internal)
        for held in self.parts.values():
            held.discard(name)

    def activate(self, key: tuple) -> None:
        """Apply exactly the adapters of `key` ((name, scale), ...), on each component the ones it holds."""
        from diffusers.loaders.lora_base import (
            disable_lora_for_text_encoder,
            enable_lora_for_text_encoder,
            set_adapters_for_text_encoder,
        )
        from diffusers.models.modeling_utils import ModelMixin

        for c, module in zip(self.components, self.modules()):
            held = self.parts[c]
            if not held:
                continue
            use = [(n, w) for n, w in key if n in held]
            names, weights = [self.alias.get(n, n) for n, _ in use], [w for _, w in use]
            is_model = isinstance(module, ModelMixin)
            if is_model and self.compiled:
                self._scale_in_place(module, dict(zip(names, weights)))
                continue
            if not use:
                module.disable_lora() if is_model else disable_lora_for_text_encoder(module)
                continue
            if is_model:
                module.enable_lora()
                module.set_adapters(names, weights)
            else:
                enable_lora_for_text_encoder(module)
                set_adapters_for_text_encoder(names, module, weights)


    def _scale_in_place(self, module, weights: dict[str, float]) -> None:
        """A compiled model: every adapter it holds active, each LoRA layer's scaling a tensor set in place to
        weight x its scaling at weight 1 (0 for adapters the request does not apply). Only the adapters whose
        weight changed since the last request are written."""
        loaded = tuple(sorted(getattr(module, "peft_config", {})))
        if not loaded:
            return
        state = self._static.get(id(module))
        if state is None or state[0] != loaded:  # a new adapter's layers (or one gone): set once, base scalings read
            import torch
            from peft.tuners.lora import LoraLayer

            module.enable_lora()
            module.set_adapters(list(loaded), [1.0] * len(loaded))  # scalings at weight 1, as floats
            scalings: dict[str, list] = {n: [] for n in loaded}
            for layer in module.modules():
                if isinstance(layer, LoraLayer):
                    for n in loaded:
                        if n in layer.scaling:
                            one = float(layer.scaling[n])
                            layer.scaling[n] = torch.tensor(one, device=layer.lora_A[n].weight.device)
                            scalings[n].append((layer.scaling[n], one))
            state = self._static[id(module)] = (loaded, scalings, {})
        _, scalings, applied = state
        for n in loaded:
            w = weights.get(n, 0.0)
            if applied.get(n) != w:
                for tensor, one in scalings[n]:
                    tensor.fill_(w * one)
                applied[n] = w


def pin_adapter(models, internal: str) -> None:
    """Pin the host copies of peft adapter `internal`'s weights (each LoRA layer's lora_A and lora_B)."""
    for model in models:
        for module in model.modules():
            for table in (getattr(module, "lora_A", None), getattr(module, "lora_B", None)):
                if table is not None and internal in table:
                    for param in table[internal].parameters():
                        param.data = param.data.pin_memory()


def scale_by_alpha(state: dict, metadata: dict) -> None:
    """Fold each layer's scaling (lora_alpha / r, or / sqrt(r) with rslora, per peft's alpha_pattern) into its lora_B,
    in place, from the adapter's metadata (the `lora_adapter_metadata` that diffusers' save_lora_weights writes into
    the safetensors header, keys `COMPONENT.lora_alpha`, ...). An adapter installs from its state dict in memory, and
    diffusers reads that metadata from files only: without this, every such adapter would load at alpha = r (scaling
    1), at the wrong strength wherever it was trained with another alpha."""
    import math

    from peft.utils.other import get_pattern_key

    for key, tensor in state.items():
        component, _, rest = key.partition(".")
        module, found, _ = rest.partition(".lora_B.")
        alpha = metadata.get(f"{component}.lora_alpha")
        weight = state.get(f"{component}.{module}.lora_B.weight")
        if not found or alpha is None or weight is None or weight.dim() != 2:
            continue
        pattern = metadata.get(f"{component}.alpha_pattern") or {}
        if pattern:
            alpha = pattern.get(get_pattern_key(pattern.keys(), module), alpha)
        rank = weight.shape[1]  # lora_B: (out, r); its bias (lora_bias) is scaled alike
        scaling = alpha / (math.sqrt(rank) if metadata.get(f"{component}.use_rslora") else rank)
        if scaling != 1:
            tensor.mul_(scaling)


def scale_by_alphas(state: dict, alphas: dict) -> list[str]:
    """Fold network alphas (`MODULE.alpha` -> alpha, as diffusers' lora_state_dict returns them apart from the weights)
    into each module's up weight, in place: scaling alpha / rank, as diffusers' own load applies them. The alphas whose
    layer is not found, which stay unapplied."""
    unplaced = []
    for key, alpha in alphas.items():
        base = key.removesuffix(".alpha")
        for up in (f"{base}.lora_B.weight", f"{base}.lora.up.weight", base.replace(".down.", ".up.")):
            if up != base and up in state and state[up].dim() == 2:
                state[up].mul_(float(alpha) / state[up].shape[1])
                break
        else:
            unplaced.append(key)
    return unplaced


class SimLoras:
    """A sim model's adapters: any name; each load takes the profile's `load_ms`, each restore from host memory its
    `restore_ms` (times the slowdown)."""

    components = ()
    offloads = True

    def __init__(self, load_ms: float, slowdown: float = 1.0, restore_ms: float = 0.0):
        self.load_s = load_ms * slowdown / 1000
        self.restore_s = restore_ms * slowdown / 1000

    def modules(self):
        return []

    def read(self, name: str, source: str) -> tuple[dict, int]:
        time.sleep(self.load_s)
        return {}, 0

    def install(self, name: str, state: dict, into: str | None = None) -> bool:
        return False

    def offload(self, name: str) -> None:
        pass

    def restore(self, name: str) -> None:
        time.sleep(self.restore_s)

    def forget(self, name: str) -> None:
        pass

    def activate(self, key: tuple) -> None:
        pass
