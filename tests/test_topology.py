"""Config files, flags and placement: which process runs where."""

from pathlib import Path

import pytest

from disagg.launcher.deployment import Deployment
from disagg.launcher.topology import ConfigError, load_config, place
from disagg.settings import Settings

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_tiny_yaml_is_the_builtin_default():
    assert load_config(CONFIGS / "tiny.yaml") == Settings() == load_config(None)


def test_every_config_file_loads():
    for path in CONFIGS.glob("*.yaml"):
        cfg = load_config(path)
        assert sum(cfg.role(r).count for r in ("encoder", "denoiser", "decoder")) >= 3


def test_gpu_placement_per_role_and_global():
    cfg = load_config(CONFIGS / "h200x8-1-6-1.yaml")
    by_id = {p.instance_id: p for p in place(cfg, cpu_ids=list(range(16)))}
    assert by_id["encoder-0"].gpu == 0 and by_id["decoder-0"].gpu == 7
    assert [by_id[f"denoiser-{i}"].gpu for i in range(6)] == [1, 2, 3, 4, 5, 6]
    assert all(p.device == "cuda:0" for p in by_id.values())
    assert all(len(p.cpus) == 2 for p in by_id.values())  # 16 CPUs shared by 8 instances
    cfg = Settings(gpus=[0, 1])
    gpus = [p.gpu for p in place(cfg, cpu_ids=[0])]
    assert gpus == [0, 1, 0, 1] and all(p.cpus == [0] for p in place(cfg, cpu_ids=[0]))


def test_cpu_only_placement():
    ps = place(Settings(), cpu_ids=[0, 1])
    assert [p.instance_id for p in ps] == ["encoder-0", "denoiser-0", "denoiser-1", "decoder-0"]
    assert all(p.gpu is None and p.device == "cpu" for p in ps)
    # more instances than CPUs: each may run on any, with one compute thread
    assert all(p.cpus == [0, 1] and p.threads == 1 for p in ps)
    ps = place(Settings(), cpu_ids=list(range(8)))
    assert [p.cpus for p in ps] == [[0, 1], [2, 3], [4, 5], [6, 7]] and all(p.threads == 2 for p in ps)


def test_spawned_role_gets_its_gpu_and_cpus(tmp_path, monkeypatch):
    dep = Deployment(Settings(gpus=[3]), run_dir=tmp_path)
    seen = {}
    monkeypatch.setattr(dep.supervisor, "spawn", lambda name, argv, env=None, cpus=None, **kw: seen.update(name=name, argv=argv, env=env, cpus=cpus))
    dep.spawn_role(dep.placements[1])
    assert seen["name"] == "denoiser-0" and seen["env"]["CUDA_VISIBLE_DEVICES"] == "3"
    dep = Deployment(Settings(gpus=[2, 5, 7]), run_dir=tmp_path)
    monkeypatch.setattr(dep.supervisor, "spawn", lambda name, argv, env=None, cpus=None, **kw: seen.update(name=name, argv=argv, env=env, cpus=cpus))
    dep.spawn_role(dep.placements[1])  # denoiser-0 on GPU 5 sees it first, then the others
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "5,2,7" and '"visible_gpus":[5,2,7]' in seen["argv"][-1]
    assert '"device":"cuda:0"' in seen["argv"][-1] and seen["cpus"]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("transfer: pigeon\n", "transfer"),
        ("encoders: {count: -1}\n", "encoders.count"),
        ("join: nowhere\nencoders: {count: 1}\n", "join"),
        ("port: 99999999\n", "port"),
        ("denoisers: [1, 2]\n", "denoisers"),
        ("model: [\n", "not valid YAML"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_model_configs_parse_and_name_their_family(tmp_path):
    """configs/models/*.yaml name hub checkpoints (not reachable offline): check them with a tiny
    checkpoint of the same family in place of the hub id."""
    import msgspec
    import yaml

    from disagg.launcher.topology import place, validate
    from disagg.roles.pipelines.checkpoint import FAMILIES

    for path in (CONFIGS / "models").glob("*.yaml"):
        family = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "sdxl": "StableDiffusionXLPipeline",
                  "wan": "WanPipeline"}[next(f for f in ("flux", "sd3", "sdxl", "wan") if path.stem.startswith(f))]
        assert family in FAMILIES
        data = yaml.safe_load(path.read_text())
        assert "/" in data["model"], path
        folder = tmp_path / path.stem
        folder.mkdir()
        (folder / "model_index.json").write_text(f'{{"_class_name": "{family}"}}')
        config = msgspec.convert({**data, "model": str(folder)}, Settings)
        validate(config)
        placed = place(config, cpu_ids=list(range(16)))
        assert {p.role for p in placed} == {"encoder", "denoiser", "decoder"}
        assert all(p.gpu is not None for p in placed), path


def test_a_gpu_with_several_instances_of_one_role_is_warned_about():
    from disagg.launcher.topology import shared_gpu_warnings

    cfg = Settings(model="tiny", gpus=[0])  # everything on GPU 0: 1:2:1 puts both denoisers there
    cfg.denoisers.count = 2
    [note] = shared_gpu_warnings(place(cfg, cpu_ids=[0]))
    assert note.startswith("GPU 0 holds 2 denoiser instances (denoiser-0, denoiser-1)") and "--gpus" in note
    cfg = Settings(model="tiny", gpus=[0, 1, 2, 3])  # one per GPU: different roles may share, one role does not
    cfg.denoisers.count = 2
    assert shared_gpu_warnings(place(cfg, cpu_ids=[0])) == []
    cfg.model = "sim:flux-h200"  # simulated GPUs hold nothing
    cfg.gpus = [0]
    assert shared_gpu_warnings(place(cfg, cpu_ids=[0])) == []
    assert shared_gpu_warnings(place(Settings(model="tiny"), cpu_ids=[0])) == []  # CPU roles
