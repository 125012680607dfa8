"""The reload's memory-mapped shard reader: the same tensors as safetensors reads, and a rank that
copies a slice reads (touches) only that slice's pages."""
from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from rlctl.inference.mapped_shards import MappedShards


def test_every_dtype_and_an_empty_tensor_read_back_exactly(tmp_path):
    tensors = {"bf16_odd": torch.randn(3).to(torch.bfloat16), "f32": torch.randn(5, 7), "f16": torch.randn(2, 3).half(),
               "i64": torch.arange(9), "i8": torch.tensor([-1, 2], dtype=torch.int8), "empty": torch.empty(0, 4),
               "bool": torch.tensor([True, False, True]), "f8": torch.randn(4).to(torch.float8_e4m3fn)}
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    save_file(dict(list(tensors.items())[:4]), str(files[0]), metadata={"format": "pt"})
    save_file(dict(list(tensors.items())[4:]), str(files[1]))
    shards = MappedShards(files)
    assert shards.mappable and shards.data_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())
    got = {name: t.clone() for name, t in shards.tensors()}
    expected = {**load_file(str(files[0])), **load_file(str(files[1]))}
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_rank_copying_a_quarter_reads_about_a_quarter(tmp_path):
    """As a TP rank of 4 loads a column-parallel weight: rows narrowed first, then copied. The
    resident pages of the shard's map are the bytes read (whole pages or folios, so a little more)."""
    file = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(8192, 2048).to(torch.bfloat16)}, str(file))  # 32 MiB
    size = file.stat().st_size
    shards = MappedShards([file])
    assert shards.touched_bytes() == 0  # nothing mapped yet
    (name, w), = list(shards.tensors())
    out = torch.empty(2048, 2048, dtype=torch.bfloat16)
    out.copy_(w.narrow(0, 2048, 2048))
    touched = shards.touched_bytes()
    assert size / 4 <= touched < size / 4 + (4 << 20), touched
    rest = torch.empty_like(w)
    rest.copy_(w)
    assert shards.touched_bytes() >= size - 4096  # every page once everything is copied
    assert torch.equal(out, load_file(str(file))["w"][2048:4096])  # (safetensors maps the file too: last)
