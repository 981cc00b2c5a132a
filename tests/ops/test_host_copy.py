"""ops/common/host_copy.py: the host copy is used while the device tensor is the same unmodified object, and the
device is read otherwise; the ops that plan on the host (full attention's buckets, linear attention's bounds) read
the remembered copy."""

import gc

import pytest
import torch

from moe_tune.engine.data.dataset import PackedDataset, load_documents
from moe_tune.engine.data.tokenizer import load_tokenizer
from moe_tune.engine.model.varlen import DocumentBuckets
from moe_tune.ops.common import host_copy
from moe_tune.ops.common.host_copy import host_values, remember, to_device
from moe_tune.profiles import load_profile


def test_remembered_copy_is_returned_until_the_tensor_changes():
    device_tensor, host = torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7])
    remember(device_tensor, host)
    assert host_values(device_tensor) is host
    # Another tensor with the same values is not the remembered one.
    assert host_values(device_tensor.clone()) is not host
    device_tensor.add_(1)  # its version moves on: the copy is stale
    assert host_values(device_tensor).tolist() == [1, 4, 8]


class DeviceLike(torch.Tensor):
    """A CPU tensor that behaves as if it lived on a device: cpu() makes a copy and counts the reads."""

    reads = 0

    def cpu(self):
        DeviceLike.reads += 1
        return self.as_subclass(torch.Tensor).clone()


def test_a_device_tensor_is_read_once_and_again_after_an_in_place_change():
    DeviceLike.reads = 0
    t = torch.tensor([0, 3, 8]).as_subclass(DeviceLike)
    first = host_values(t)
    assert host_values(t) is first and first.tolist() == [0, 3, 8] and DeviceLike.reads == 1
    # An equal tensor is another tensor: read on its own.
    host_values(t.clone())
    assert DeviceLike.reads == 2
    with torch.no_grad():
        t[1] = 9
    assert host_values(t).tolist() == [0, 9, 8] and DeviceLike.reads == 3


@pytest.mark.parametrize("batches", [1, 5])
def test_a_cpu_batch_leaves_no_entry_behind(batches):
    # On the CPU model_inputs' "device" cu_seqlens is the host tensor itself: remembering it would keep an entry
    # (and the tensor) alive for good, one a batch.
    from moe_tune.engine.data.dataset import Batch

    before = set(host_copy._copies)
    for _ in range(batches):
        batch = Batch(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long),
                      cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))  # fmt: skip
        inputs = batch.model_inputs("cpu")
        assert host_values(inputs["cu_seqlens"]).tolist() == [0, 4]
        del batch, inputs
    gc.collect()
    assert set(host_copy._copies) == before


def test_entry_goes_with_the_device_tensor():
    device_tensor = torch.tensor([0, 5])
    remember(device_tensor, torch.tensor([0, 5]))
    key = id(device_tensor)
    assert key in host_copy._copies
    del device_tensor
    gc.collect()
    assert key not in host_copy._copies


def test_remember_refuses_a_copy_of_another_shape():
    message = r"host_tensor: cpu \(2,\) must be a CPU tensor of the device tensor's shape \(3,\)"
    with pytest.raises(ValueError, match=message):
        remember(torch.zeros(3), torch.zeros(2))


def test_document_buckets_read_the_remembered_bounds():
    # The remembered copy says two documents of 4; the tensor itself one of 8 (and an empty one): the buckets follow
    # the copy, so the tensor was not read.
    cu_seqlens, told = torch.tensor([0, 8, 8], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    remember(cu_seqlens, told)
    assert DocumentBuckets.from_cu_seqlens(cu_seqlens).counts == (2,)
    assert DocumentBuckets.from_cu_seqlens(cu_seqlens.clone()).counts == (1,)


def test_batch_inputs_remember_their_bounds():
    profile = load_profile("tiny", ["data.seq_len=64", "data.corpus_documents=50"])
    tok = load_tokenizer("byte")
    batch = PackedDataset(load_documents(profile.data, tok), 64, tok.pad_id, 0).micro_batch(0, 2)
    inputs = batch.model_inputs("cpu")
    assert host_values(inputs["cu_seqlens"]) is batch.cu_seqlens
    assert torch.equal(to_device(batch.input_ids, "cpu"), batch.input_ids)
