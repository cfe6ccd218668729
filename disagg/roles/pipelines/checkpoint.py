"""Diffusers checkpoints (a local folder or a Hugging Face id): family detection and sizes, torch-free.

The launcher calls this before starting any role, so a checkpoint we cannot serve fails at once,
naming the pipeline class it found, and pools are sized from the configs without loading weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: diffusers pipeline class -> our family name
FAMILIES = {
    "FluxPipeline": "flux",
    "FluxKontextPipeline": "flux",
    "FluxFillPipeline": "flux",
    "StableDiffusion3Pipeline": "sd3",
    "StableDiffusionXLPipeline": "sdxl",
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan",
    "QwenImagePipeline": "qwen",
    "QwenImageEditPipeline": "qwen",
}
VIDEO_FAMILIES = {"wan"}
#: checkpoint's pipeline class -> the tasks it serves (text: a prompt; image: an image too; inpaint: an image
#: and a mask) -> the diffusers pipeline class that runs it, split by disagg/roles/pipelines/conditioned.py (None:
#: the family adapter's own text-to-image split)
TASKS: dict[str, dict[str, str | None]] = {
    "FluxPipeline": {"text": None, "image": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline"},
    "FluxKontextPipeline": {"text": "FluxKontextPipeline", "image": "FluxKontextPipeline"},
    "FluxFillPipeline": {"inpaint": "FluxFillPipeline"},
    "StableDiffusion3Pipeline": {"text": None, "image": "StableDiffusion3Img2ImgPipeline",
                                 "inpaint": "StableDiffusion3InpaintPipeline"},
    "StableDiffusionXLPipeline": {"text": None, "image": "StableDiffusionXLImg2ImgPipeline",
                                  "inpaint": "StableDiffusionXLInpaintPipeline"},
    "WanPipeline": {"text": None},
    "WanImageToVideoPipeline": {"image": "WanImageToVideoPipeline"},
    "QwenImagePipeline": {"text": "QwenImagePipeline", "image": "QwenImageImg2ImgPipeline",
                          "inpaint": "QwenImageInpaintPipeline"},
    "QwenImageEditPipeline": {"image": "QwenImageEditPipeline"},
}
#: components each role loads, by name prefix in model_index.json (the rest are left out)
ROLE_PREFIXES = {
    "encoder": ("text_encoder", "tokenizer"),
    "denoiser": ("transformer", "unet", "scheduler"),
    "decoder": ("vae",),
}
#: what the encoder also loads for a checkpoint that takes images: the VAE (its encoder half), the image
#: encoders and their processors, and the scheduler (the task pipeline runs up to its denoising loop there)
IMAGE_PREFIXES = ("vae", "image_encoder", "image_processor", "feature_extractor", "processor", "scheduler")


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read or served."""


class NoSuchModel(CheckpointError):
    """Neither a local folder nor something that looks like a Hugging Face id."""


@dataclass(frozen=True)
class Checkpoint:
    """What model_index.json and the component configs say, without any weights."""

    source: str  # as given: a folder or a hub id
    path: Path  # local folder holding model_index.json
    pipeline_class: str
    family: str
    index: dict
    #: component name -> its config.json (or scheduler_config.json) as a dict
    configs: dict[str, dict]

    @property
    def components(self) -> list[str]:
        """Names of the pipeline's components (entries that name a library and a class)."""
        return [k for k, v in self.index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None]

    def role_components(self, role: str) -> list[str]:
        if role in ("all", "monolith"):
            return self.components
        prefixes = ROLE_PREFIXES[role]
        if role == "encoder" and self.generic_tasks:
            prefixes += IMAGE_PREFIXES
        return [c for c in self.components if c.startswith(prefixes)]

    @property
    def tasks(self) -> dict[str, str | None]:
        return TASKS[self.pipeline_class]

    @property
    def generic_tasks(self) -> bool:
        """Some task runs through the two-halves split (conditioned.py): the encoder then holds the VAE too."""
        return any(c is not None for c in self.tasks.values())

    @property
    def hub(self) -> bool:
        """Named by a Hugging Face id (not a local folder): each role fetches only its own weights."""
        return not Path(self.source).expanduser().is_dir()

    @property
    def video(self) -> bool:
        return self.family in VIDEO_FAMILIES


def _local_folder(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise NoSuchModel(f"unknown model {source!r}: no such folder, and not a Hugging Face id (owner/name)")
    try:  # a hub id: fetch only the small json files now; each role downloads its own weights
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["model_index.json", "*/config.json", "*/*_config.json"]))
    except Exception as exc:  # noqa: BLE001 - offline, gated, unknown id: all mean we cannot serve it
        raise CheckpointError(f"model {source!r}: cannot fetch model_index.json from the Hugging Face hub: "
                              f"{type(exc).__name__}: {exc}") from None


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON: {exc}") from None


def load_checkpoint(source: str) -> Checkpoint:
    """Read a checkpoint's model_index.json and component configs; raise CheckpointError if unsupported."""
    path = _local_folder(source)
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise CheckpointError(f"model {source!r}: {index_path} not found (is it a diffusers-format folder?)")
    index = _read_json(index_path, "model index")
    cls = index.get("_class_name")
    if cls not in FAMILIES:
        raise CheckpointError(f"model {source!r} is a {cls or 'pipeline of unknown class'}; disagg serves "
                              f"{', '.join(FAMILIES)}")
    configs = {}
    for name in [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)]:
        for fname in ("config.json", "scheduler_config.json"):
            if (path / name / fname).is_file():
                configs[name] = _read_json(path / name / fname, f"{name} config")
                break
    return Checkpoint(source, path, cls, FAMILIES[cls], index, configs)


def vae_scale_factors(ck: Checkpoint) -> tuple[int, int]:
    """(spatial, temporal) downsampling of the checkpoint's VAE, from its config."""
    vae = ck.configs.get("vae", {})
    if ck.family == "wan":
        # explicit scale_factor_* keys win (Wan 2.2 TI2V's VAE patchifies: 16x with three down stages)
        down = vae.get("temperal_downsample", [False, True, True])
        return (int(vae.get("scale_factor_spatial") or 2 ** len(down)),
                int(vae.get("scale_factor_temporal") or 2 ** sum(bool(d) for d in down)))
    return 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1), 1


#: defaults per family: the size and the most frames a deployment is sized for
MAX_SIZE = {"flux": (2048, 2048), "sd3": (2048, 2048), "sdxl": (2048, 2048), "wan": (1280, 1280), "qwen": (2048, 2048)}
#: the largest input image (pixels) an image task takes; docs/guide/image-inputs.md
MAX_INPUT_PIXELS = 2048 * 2048
MAX_FRAMES = 81


def max_size(ck: Checkpoint) -> tuple[int, int]:
    """(width, height) a deployment of this checkpoint takes: MAX_SIZE, lowered to what the transformer's own
    config allows (a larger request is then refused at Submit, not failed at the denoiser): SD3's positional
    embedding covers pos_embed_max_size patches a side, Wan's rotary table rope_max_seq_len positions an axis."""
    width, height = MAX_SIZE[ck.family]
    t = ck.configs.get("transformer", {})
    spatial, _ = vae_scale_factors(ck)
    if ck.family == "sd3" and t.get("pos_embed_max_size"):
        limit = int(t["pos_embed_max_size"]) * int(t.get("patch_size") or 2) * spatial
    elif ck.family == "wan" and t.get("rope_max_seq_len"):
        patch = t.get("patch_size") or (1, 2, 2)
        limit = int(t["rope_max_seq_len"]) * int(patch[1]) * spatial
    else:
        return width, height
    limit -= limit % 16  # sizes are multiples of 16
    return min(width, limit), min(height, limit)


def output_bytes(ck: Checkpoint, role: str, width: int, height: int, images: int) -> int:
    """An upper bound on what `role` stages for one request (float32, CFG doubled where used)."""
    c = ck.configs
    if role == "encoder":
        text = 0
        if ck.family == "flux":  # twice: Kontext's true CFG encodes a negative prompt too
            t = c.get("transformer", {})
            text = 2 * (512 * t.get("joint_attention_dim", 4096) + t.get("pooled_projection_dim", 768)) * 4
        elif ck.family == "sd3":
            t = c.get("transformer", {})
            text = 2 * ((77 + 256) * t.get("joint_attention_dim", 4096) + t.get("pooled_projection_dim", 2048)) * 4
        elif ck.family == "sdxl":
            u = c.get("unet", {})
            text = 2 * (77 * u.get("cross_attention_dim", 2048) + u.get("projection_class_embeddings_input_dim", 2816)) * 4
        elif ck.family == "wan":
            text = 2 * 512 * c.get("text_encoder", {}).get("d_model", 4096) * 4
        elif ck.family == "qwen":
            text = 2 * 1024 * c.get("text_encoder", {}).get("hidden_size", 3584) * 4
        if ck.generic_tasks:  # the input image and mask, and the VAE's moments of two of them
            vae = c.get("vae", {})
            channels = vae.get("z_dim") or vae.get("latent_channels", 16)
            spatial, temporal = vae_scale_factors(ck)
            # image-to-video encodes a whole video of conditioning frames; CLIP image embeddings: ~2 MiB
            frames = (MAX_FRAMES - 1) // temporal + 1 if ck.video else 1
            text += 4 * MAX_INPUT_PIXELS + 2 * 2 * channels * frames * (MAX_INPUT_PIXELS // spatial ** 2) * 4 + 2 * 2**20
        return text
    if role == "denoiser":
        spatial, temporal = vae_scale_factors(ck)
        vae = c.get("vae", {})
        channels = vae.get("z_dim") or vae.get("latent_channels", 16)
        frames = (MAX_FRAMES - 1) // temporal + 1 if ck.video else 1
        return images * channels * frames * (height // spatial + 2) * (width // spatial + 2) * 4
    return 0
