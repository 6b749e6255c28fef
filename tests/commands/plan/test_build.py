"""What `plan --fake` builds for real, and what it puts back (commands/plan/build.py's contexts)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_ckpt.commands.plan.build import _made_for_real, _swappable, _without_weight_init


class Table:
    def __init__(self) -> None:
        self.values = torch.arange(4)


class TableWithoutInit(Table):
    pass


def test_the_data_class_is_made_with_real_tensors_under_the_fake_mode_and_its_own_init_comes_back():
    own = Table.__init__
    with FakeTensorMode():
        with _made_for_real(Table), _made_for_real(TableWithoutInit):
            made, inherited = Table(), TableWithoutInit()
        faked = Table()
    assert not isinstance(made.values, FakeTensor) and made.values.tolist() == [0, 1, 2, 3]
    assert not isinstance(inherited.values, FakeTensor)
    assert isinstance(faked.values, FakeTensor)  # after the block: made under the fake mode again
    assert Table.__init__ is own and "__init__" not in TableWithoutInit.__dict__


def test_fake_weights_can_be_moved_inside_and_torch_s_swap_comes_back():
    swap = torch.utils.swap_tensors
    mode = FakeTensorMode()
    with mode:
        layer = torch.nn.Linear(4, 4)
    with _swappable(mode), mode:
        layer.to(torch.bfloat16)  # Module._apply swaps each weight for its converted copy
    assert layer.weight.dtype == torch.bfloat16 and torch.utils.swap_tensors is swap


def test_weights_are_initialised_for_real_and_left_alone_under_fake_tensors():
    for fake, expected in ((False, [1.0, 1.0]), (True, [0.0, 0.0])):
        weights = torch.zeros(2)
        with _without_weight_init(fake):
            torch.nn.init.constant_(weights, 1.0)  # one of the initialisers Transformers 4.x and 5.x both skip
        assert weights.tolist() == expected
