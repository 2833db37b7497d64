"""Python's torch.load(weights_only=True) reads what trainer/checkpoint_io/archive.h's
ArchiveWriter writes (the fixture of archive_test.cc's WriteFixture), and Python's
zipfile finds every CRC-32 right in it and in zip_fixture.h's archives (with and
without O_DIRECT and zip64 fields: archive_check.py --zips DIR)."""
import os
import struct
import sys
import zipfile

import torch

SPECS = [
    (torch.float32, (3, 4)), (torch.float64, (5,)), (torch.bfloat16, (2, 3, 2)), (torch.float16, (7,)),
    (torch.int64, (4, 2)), (torch.uint8, (9,)), (torch.bool, (6,)), (torch.int32, (0,)),
    (torch.float32, (1000,)), (torch.int8, (2, 2)), (torch.float32, (3000,)),
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


def check_zip(path):
    """Every record's CRC-32 right (zipfile reads each whole and compares) and
    its data 64-byte aligned in the file, as torch.save aligns them; returns
    the records' contents by name."""
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        bad = z.testzip()
        assert bad is None, f"{path}: zipfile says the CRC-32 of {bad} is wrong"
        out = {}
        for info in z.infolist():
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
            data_at = info.header_offset + 30 + name_len + extra_len
            assert data_at % 64 == 0, (path, info.filename, data_at)
            out[info.filename] = z.read(info)
        return out


def check_zips(directory):
    """zip_fixture.h: five records, byte i of record r is (i * 31 + r * 7) & 255."""
    sizes = {"empty": 0, "tiny": 5, "unaligned": 5000, "page_aligned": (3 << 20) + 5, "offset_by_64": (1 << 20) + 4096}
    for name in ("direct.zip", "direct_zip64.zip", "plain.zip", "plain_zip64.zip"):
        records = check_zip(os.path.join(directory, name))
        assert records.pop("archive/version") == b"3\n"
        assert records.pop("archive/byteorder") == b"little"
        assert len(records.pop("archive/.data/serialization_id")) == 40
        assert sorted(records) == sorted("archive/" + k for k in sizes), sorted(records)
        for r, (key, size) in enumerate(sizes.items()):
            want = bytes((i * 31 + r * 7) & 255 for i in range(size))
            assert records["archive/" + key] == want, (name, key)
        print("PASS: zipfile checked", name)


def main(path):
    check_zip(path)
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
    if sys.argv[1] == "--zips":
        check_zips(sys.argv[2])
    else:
        main(sys.argv[1])
