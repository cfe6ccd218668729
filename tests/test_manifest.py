import pytest
import torch

from disagg.transport.data.manifest import ManifestError, pack, plan, unpack
from disagg.transport.wire.messages import TensorSpec


def test_pack_unpack_all_dtypes():
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f32": torch.randn(2, 7, 3),
        "f16": torch.randn(11).half(),
        "i64": torch.arange(5),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6).t(),
    }
    specs, size = plan(tensors)
    assert all(s.offset % 64 == 0 for s in specs)
    buf = torch.zeros(size, dtype=torch.uint8)
    pack(tensors, buf, specs)
    out = unpack(buf, specs)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)


def test_unpack_is_a_view():
    t = {"x": torch.ones(4)}
    specs, size = plan(t)
    buf = torch.zeros(size, dtype=torch.uint8)
    pack(t, buf, specs)
    unpack(buf, specs)["x"].fill_(2)
    assert unpack(buf, specs)["x"].tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize(
    "spec,needle",
    [
        (TensorSpec("x", "float32", [4], 0, 15), "does not match"),
        (TensorSpec("x", "complex999", [4], 0, 16), "unsupported dtype"),
        (TensorSpec("x", "float32", [64], 0, 256), "outside"),
        (TensorSpec("x", "float32", [1], 2, 4), "outside"),
    ],
)
def test_bad_manifests_rejected(spec, needle):
    with pytest.raises(ManifestError, match=needle):
        unpack(torch.zeros(64, dtype=torch.uint8), [spec])
