"""The device harness's own rules (tests/device_harness.py): what strict_devices refuses is what a
CUDA kernel refuses (advanced indexing included), and HostReads sees every host read, names where
it was made, and answers a meta tensor's with zeros."""

from __future__ import annotations

import pytest
import torch

try:
    from tests.device_harness import DeviceMismatch, HostReads, strict_devices
except ImportError:  # tests/ is not a package
    from device_harness import DeviceMismatch, HostReads, strict_devices


def test_two_devices_in_one_op_are_refused_but_cpu_scalars_and_copies_pass():
    meta = torch.zeros(4, 3, device="meta")
    with strict_devices():
        assert (meta + torch.tensor(2.0)).device.type == "meta"  # a 0-dim CPU tensor is a scalar to CUDA
        assert torch.ones(3).to("meta").device.type == "meta"  # a copy between devices
        with pytest.raises(DeviceMismatch, match="aten.add.Tensor: tensors on cpu, meta"):
            meta + torch.ones(3)


def test_index_writes_follow_cudas_index_put_rule():
    """CUDA's index_put_ takes CPU indices and moves a 0-dim CPU value; any other CPU value it
    refuses (the harness ignored every CPU tensor after the indexed one, the written values too)."""
    meta = torch.zeros(4, 3, device="meta")
    idx = torch.tensor([0, 2])
    with strict_devices():
        meta[idx] = torch.tensor(1.0)  # a 0-dim value: moved
        meta[idx] = torch.ones(3, device="meta")
        meta.index_put_((idx,), torch.ones(2, 3, device="meta"), accumulate=True)
        assert meta[idx].device.type == "meta"  # CPU indices read too
        with pytest.raises(DeviceMismatch, match="index_put_.default: tensors on cpu, meta"):
            meta[idx] = torch.ones(2, 3)
        meta[idx] = torch.ones(1)  # torch's indexing views a [1] value as 0-dim before index_put_: moved too
        with pytest.raises(DeviceMismatch, match="index_put_.default: tensors on cpu, meta"):
            meta.index_put_((idx,), torch.ones(1))  # but index_put_ itself moves only a 0-dim value
        with pytest.raises(DeviceMismatch, match="aten.index.Tensor: tensors on cpu, meta"):
            torch.zeros(4)[idx.to("meta")]  # device indices into a CPU tensor


def _reads(t: torch.Tensor) -> tuple[list, HostReads]:
    with HostReads() as reads:
        got = [t.tolist(), int(t[0]), t[1].item(), bool(t[0]), float(t[1]), [5, 6][t[0]], t.cpu(), t.to("cpu"),
               torch.empty(2).copy_(t), t.to(torch.float64), t + 1]
    return got, reads


def test_host_reads_are_recorded_with_where_they_were_made():
    got, reads = _reads(torch.tensor([1, 0]))
    assert got[:6] == [[1, 0], 1, 0, True, 0.0, 6]
    # on the CPU the copies to the host are no copies: only reads of values are recorded
    here = "test_device_harness._reads"
    assert reads.reads == [(kind, here) for kind in ("tolist", "int", "item", "bool", "float", "index")]


def test_a_meta_tensors_reads_answer_zeros_and_its_copies_to_the_host_count():
    got, reads = _reads(torch.tensor([1, 0], device="meta"))
    assert got[:6] == [[0, 0], 0, 0, False, 0.0, 5]
    assert [g.device.type for g in got[6:9]] == ["cpu", "cpu", "cpu"] and got[9].device.type == "meta"
    assert [kind for kind, _ in reads.reads] == ["tolist", "int", "item", "bool", "float", "index", "cpu", "to",
                                                 "copy_"]
    assert set(reads.where()) == {"test_device_harness._reads"}
