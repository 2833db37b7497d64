"""Python's torch.load(weights_only=True) reads what trainer/checkpoint_io/archive.h's
ArchiveWriter writes (the fixture of archive_test.cc's WriteFixture)."""
import sys

import torch

SPECS = [
    (torch.float32, (3, 4)), (torch.float64, (5,)), (torch.bfloat16, (2, 3, 2)), (torch.float16, (7,)),
    (torch.int64, (4, 2)), (torch.uint8, (9,)), (torch.bool, (6,)), (torch.int32, (0,)),
    (torch.float32, (1000,)), (torch.int8, (2, 2)),
]


def value(k):
    dtype, shape = SPECS[k]
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.float64)
    if dtype == torch.bool:
        return (base.remainder(2) == 0).reshape(shape)
    return base.mul(k + 1).to(dtype).reshape(shape)


def main(path):
    root = torch.load(path, weights_only=True)
    assert isinstance(root, dict), type(root)
    assert sorted(root) == ["name", "nested", "pi", "tensors", "tied"], sorted(root)
    tensors = root["tensors"]
    assert isinstance(tensors, list) and len(tensors) == len(SPECS), tensors
    for k, t in enumerate(tensors):
        assert t.dtype == SPECS[k][0], (k, t.dtype)
        assert torch.equal(t, value(k)), (k, t, value(k))
    # a view was added: only its 1000 elements are stored
    assert tensors[8].untyped_storage().nbytes() == 4000, tensors[8].untyped_storage().nbytes()
    nested = root["nested"]
    assert torch.equal(nested["a"][0], value(2))
    assert torch.equal(nested["a"][1]["b"], value(3))
    assert nested["ints"] == [1, 2, 3], nested["ints"]
    tied = root["tied"]
    assert torch.equal(tied[0], value(0)) and tied[0].data_ptr() == tied[1].data_ptr()
    assert root["name"] == "archive" and root["pi"] == 3.5
    print("PASS: torch.load(weights_only=True) read", path)


if __name__ == "__main__":
    main(sys.argv[1])
