"""docs/architecture.md names every wire message, every instance state and every error code (issue 23)."""

from __future__ import annotations

import msgspec

from tests.conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"


def tagged_structs() -> list[type]:
    import disagg.transport.wire.messages as messages

    return [c for c in vars(messages).values() if isinstance(c, type) and issubclass(c, msgspec.Struct)
            and not c.__name__.startswith("_") and c.__struct_config__.tag is not None]


def test_every_message_state_and_code_is_in_the_architecture_document():
    from disagg.transport.wire.codes import ErrorCode
    from disagg.transport.wire.messages import STATES

    text = DOC.read_text()
    structs = tagged_structs()
    assert len(structs) >= 20
    missing = [c.__name__ for c in structs if f"`{c.__name__}`" not in text]
    assert not missing, f"docs/architecture.md does not name these messages: {missing}"
    assert not [s for s in STATES if f"`{s}`" not in text], STATES
    assert not [c.value for c in ErrorCode if f"`{c.value}`" not in text]


def test_the_readmes_gpu_quick_start_launches_a_config_that_exists_with_flags_the_cli_takes():
    """Issue 44: the README shows near its top how to serve a real checkpoint on a GPU host; its launch line
    names a deployment of configs/models/ and flags `disagg launch` accepts (the model itself needs the hub)."""
    import re
    import shlex

    import yaml

    from disagg.launcher.cli.main import cli

    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Serve a real model on a GPU host\n")
    assert start < text.index("\n## What it is\n")  # near the top, before the design
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)
    assert "'.[mooncake,lora]'" in block and "hf auth login" in block and "HF_TOKEN" in block and "hf download" in block
    [launch] = [shlex.split(line) for line in block.splitlines() if line.startswith("disagg launch")]
    ctx = cli.make_context("disagg", launch[1:])
    name, cmd, rest = cli.resolve_command(ctx, launch[1:])
    params = cmd.make_context(name, rest, parent=ctx).params  # raises on an unknown option or a bad value
    config = yaml.safe_load((ROOT / params["config_path"]).read_text())
    assert params["config_path"].startswith("configs/models/") and config["model"] in block
