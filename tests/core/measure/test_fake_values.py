"""core/fake_values: the batch's integer values kept beside the fakes, answered where a step reads them."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import DataDependentOutputException

from lightning_ckpt.core.measure.fake_values import BatchValues, real_branches, untraced_fakes


def fakes_of(mode: FakeTensorMode, *reals: torch.Tensor) -> list[torch.Tensor]:
    with mode:
        return [mode.from_tensor(t) for t in reals]


def test_a_value_read_from_the_batch_is_the_real_one():
    mode = FakeTensorMode()
    ones, padded = torch.ones(2, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    fake_ones, fake_padded = fakes_of(mode, ones, padded)
    with mode, BatchValues({fake_ones: ones, fake_padded: padded}):
        assert bool((fake_ones.sum() == fake_ones.numel()).item()) is True
        assert bool((fake_padded.sum() == fake_padded.numel()).item()) is False  # 8 of 10
        assert int(fake_padded.sum(dim=1)[0]) == 3
        assert torch.equal(fake_ones, fake_ones) and bool(fake_padded[0, 3] == 0)
        positions = torch.arange(7).unsqueeze(0)  # a factory op: twinned too
        assert int((torch.diff(positions, dim=-1) != 1).sum()) == 0 and int(positions.sum()) == 21


def test_floats_random_draws_and_unknown_tensors_are_never_read():
    mode = FakeTensorMode()
    ids = torch.arange(6)
    (fake_ids,) = fakes_of(mode, ids)
    with mode, BatchValues({fake_ids: ids}):
        for unreadable in (fake_ids.float().sum(), torch.randint(0, 5, (3,)).sum(), fake_ids.float().long()):
            with pytest.raises(DataDependentOutputException):
                unreadable.sum().item()
        assert int(fake_ids.sum()) == 15


def test_a_tensor_larger_than_four_times_the_largest_batch_tensor_and_1024_gets_no_twin():
    mode = FakeTensorMode()
    ids = torch.arange(300)
    (fake_ids,) = fakes_of(mode, ids)
    with mode, BatchValues({fake_ids: ids}):
        assert int(torch.arange(1200).sum()) == 1200 * 1199 // 2  # 4 x 300 = 1200: twinned
        with pytest.raises(DataDependentOutputException):
            int(torch.arange(1201).sum())
    with mode, BatchValues({}):  # no batch: up to 1024
        assert int(torch.arange(1024).sum()) == 1024 * 1023 // 2
        with pytest.raises(DataDependentOutputException):
            int(torch.arange(1025).sum())


def test_an_in_place_op_with_an_unknown_input_drops_the_twin():
    mode = FakeTensorMode()
    ids = torch.arange(4)
    (fake_ids,) = fakes_of(mode, ids)
    with mode, BatchValues({fake_ids: ids}):
        known = fake_ids.clone()
        known.add_(fake_ids)  # both known: the twin follows
        assert int(known.sum()) == 12
        known.add_(fake_ids.float().long())  # an input through a float has no twin: the value is no longer known
        with pytest.raises(DataDependentOutputException):
            int(known.sum())


def test_real_branches_twins_only_real_integer_tensors():
    mode = FakeTensorMode()
    ids, x = torch.arange(3), torch.ones(3)
    fake_ids, fake_x = fakes_of(mode, ids, x)
    with mode, real_branches({fake_ids: ids, fake_x: x, "not a tensor": 1}):
        assert int(fake_ids.sum()) == 3
        with pytest.raises(DataDependentOutputException):
            float(fake_x.sum())


def test_untraced_fakes_turns_transformers_tracing_check_off_for_fake_tensors_and_back():
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    if not hasattr(import_utils, "is_fake_tensor"):
        pytest.skip("transformers 4.x takes no fake tensor for tracing")
    mode = FakeTensorMode()
    (fake,) = fakes_of(mode, torch.ones(2))
    original = import_utils.is_fake_tensor
    assert import_utils.is_tracing(fake) is True
    with untraced_fakes():
        assert import_utils.is_tracing(fake) is False
    assert import_utils.is_fake_tensor is original and import_utils.is_tracing(fake) is True


def test_an_out_argument_written_from_an_unknown_input_drops_its_twin_and_an_unknown_tensor_written_is_no_error():
    mode = FakeTensorMode()
    ids = torch.arange(4)
    (fake_ids,) = fakes_of(mode, ids)
    with mode, BatchValues({fake_ids: ids}):
        target, values, indices = fake_ids.clone(), fake_ids[:2].clone(), fake_ids[:2].clone()
        assert int(target.sum()) == 6 and int(values.sum()) == int(indices.sum()) == 1
        unknown = fake_ids.float().long()
        torch.add(fake_ids, unknown, out=target)  # out= written from an unknown input
        torch.max(unknown.view(2, 2), 0, out=(values, indices))  # two written arguments: both dropped
        for dropped in (target, values, indices):
            with pytest.raises(DataDependentOutputException):
                int(dropped.sum())
        unknown.add_(unknown)  # written, but never twinned: nothing to drop, no error
        assert int(fake_ids.sum()) == 6


def test_twins_are_made_on_the_cpu_with_the_ops_keyword_arguments():
    """A factory op asked for another device (a meta tensor here, a CUDA one when planning for a GPU) gets its twin
    on the CPU, where it can be read; its keyword arguments (the dtype) reach the twin: 2**40 + 1 is no float32."""
    mode = FakeTensorMode()
    with mode, BatchValues({}):
        assert int(torch.arange(4, device="meta").sum()) == 6
        assert int(torch.full((1,), 2**40 + 1, dtype=torch.long).sum()) == 2**40 + 1


def test_a_keepdim_given_by_position_before_the_out_arguments():
    mode = FakeTensorMode()
    ids = torch.arange(4)
    (fake_ids,) = fakes_of(mode, ids)
    with mode, BatchValues({fake_ids: ids}):
        values, indices = fake_ids[:2].clone(), fake_ids[:2].clone()
        torch.max(fake_ids.float().long().view(2, 2), 0, False, out=(values, indices))
        with pytest.raises(DataDependentOutputException):
            int(values.sum())
