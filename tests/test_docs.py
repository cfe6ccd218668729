"""docs/architecture.md names every wire message, every instance state and every error code (issue 23)."""

from __future__ import annotations

import msgspec

from tests.conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"


def tagged_structs() -> list[type]:
    import transport.messages as messages

    return [c for c in vars(messages).values() if isinstance(c, type) and issubclass(c, msgspec.Struct)
            and not c.__name__.startswith("_") and c.__struct_config__.tag is not None]


def test_every_message_state_and_code_is_in_the_architecture_document():
    from transport.codes import ErrorCode
    from transport.messages import STATES

    text = DOC.read_text()
    structs = tagged_structs()
    assert len(structs) >= 20
    missing = [c.__name__ for c in structs if f"`{c.__name__}`" not in text]
    assert not missing, f"docs/architecture.md does not name these messages: {missing}"
    assert not [s for s in STATES if f"`{s}`" not in text], STATES
    assert not [c.value for c in ErrorCode if f"`{c.value}`" not in text]


def test_every_folder_of_the_project_is_described():
    text = DOC.read_text()
    for folder in ("client", "gateway", "launcher", "orchestrator", "roles", "settings", "transport"):
        assert f"`{folder}/`" in text, folder
