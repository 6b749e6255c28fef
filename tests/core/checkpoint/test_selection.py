"""Layer selection and bad input: clear errors, raised before anything changes."""

from __future__ import annotations

import pytest
from torch import nn

from helpers import tiny_transformer
from lightning_ckpt import GradientCheckpointing, apply_checkpointing
from lightning_ckpt.core.checkpoint.selection import (detect_block_class, parse_memory_budget, resolve_layer_classes,
                                                      select_layers)
from lightning_ckpt.core.checkpoint.wrapping import checkpointed_names
from lightning_ckpt.demos import Block, CausalSelfAttention


def test_every_n_counts_matched_layers_in_registration_order():
    model = tiny_transformer(n_layer=7)
    assert apply_checkpointing(model, layer_cls=Block, every_n_layers=3) == ["blocks.0", "blocks.3", "blocks.6"]
    assert checkpointed_names(model) == ["blocks.0", "blocks.3", "blocks.6"]


def test_dotted_path_and_list_of_classes():
    model = tiny_transformer(n_layer=2)
    names = apply_checkpointing(model, layer_cls=["lightning_ckpt.demos.CausalSelfAttention", nn.LayerNorm])
    assert names == ["blocks.0.ln1", "blocks.0.attn", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.attn",
                     "blocks.1.ln2", "ln_f"]
    assert resolve_layer_classes("lightning_ckpt.demos.Block") == (Block,)


def test_matched_layers_inside_matched_layers_are_not_counted_twice():
    model = tiny_transformer(n_layer=2)
    assert apply_checkpointing(model, layer_cls=[Block, CausalSelfAttention]) == ["blocks.0", "blocks.1"]


def test_auto_detection_finds_the_block_and_ignores_containers_inside_it():
    assert detect_block_class(tiny_transformer()) is Block


def test_auto_detection_ambiguity_lists_the_candidates():
    model = nn.ModuleDict({"a": nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]),
                           "b": nn.Sequential(nn.Conv1d(1, 1, 1), nn.Conv1d(1, 1, 1))})
    with pytest.raises(ValueError, match=r"torch.nn.modules.linear.Linear.*torch.nn.modules.conv.Conv1d.*layer_cls"):
        apply_checkpointing(model)
    assert checkpointed_names(model) == []


def test_auto_detection_with_nothing_repeated_says_what_to_pass():
    with pytest.raises(ValueError, match="Pass `layer_cls=`"):
        apply_checkpointing(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n_layers": 0}, ValueError, "every_n_layers.*>= 1"),
        ({"every_n_layers": -2}, ValueError, "every_n_layers.*>= 1"),
        ({"every_n_layers": 1.5}, TypeError, "every_n_layers.*int"),
        ({"every_n_layers": True}, TypeError, "every_n_layers.*int"),
        ({"every_n_layers": "2"}, TypeError, "every_n_layers.*int"),
        ({"layer_cls": "no_such_package.Block"}, ValueError, "could not be imported.*dotted import path"),
        ({"layer_cls": "lightning_ckpt.demos.NoSuchBlock"}, ValueError, "could not be imported"),
        ({"layer_cls": "Block"}, ValueError, "not a dotted import path"),
        ({"layer_cls": "math.pi"}, TypeError, "not an `nn.Module` subclass"),
        ({"layer_cls": [Block, 3]}, TypeError, "layer_cls"),
        ({"layer_cls": []}, TypeError, "layer_cls"),
        ({"mode": "fast"}, ValueError, "mode.*'full'.*'selective'"),
        ({"mode": "selective", "use_reentrant": True}, ValueError, "use_reentrant=False"),
        ({"offload": "yes"}, TypeError, "offload"),
        ({"checkpoint_kwargs": ["use_reentrant"]}, TypeError, "checkpoint_kwargs"),
    ],
)
def test_bad_input_is_refused_before_anything_changes(kwargs, error, match):
    model = tiny_transformer(n_layer=2)
    with pytest.raises(error, match=match):
        apply_checkpointing(model, **kwargs)
    assert checkpointed_names(model) == []
    with pytest.raises(error, match=match):
        GradientCheckpointing(**kwargs)


def test_a_class_that_matches_nothing_names_the_likely_block():
    model = tiny_transformer(n_layer=2)
    with pytest.raises(ValueError, match=r"No submodule.*torch.nn.modules.conv.Conv2d.*lightning_ckpt.demos.Block"):
        apply_checkpointing(model, layer_cls=nn.Conv2d)
    assert checkpointed_names(model) == []


@pytest.mark.parametrize(
    ("budget", "parsed"),
    [(None, None), (0.25, 0.25), (1.0, 1.0), (500_000_000, 500_000_000), ("2GiB", 2 * 2**30), ("1.5 MB", 1_500_000),
     ("2GB", 2_000_000_000), (1024, 1024), ("1KiB", 1024), ("2kB", 2000)],
)
def test_memory_budget_forms(budget, parsed):
    assert parse_memory_budget(budget) == parsed


@pytest.mark.parametrize("given", [5555996.0, "5555996", 5_555_996, "5555996B"])
def test_a_whole_number_budget_is_bytes_whatever_type_the_parser_hands_over(given):
    """YAML and LightningCLI turn ``memory_budget: 5555996`` into the float 5555996.0: still bytes, as an int."""
    parsed = parse_memory_budget(given)
    assert parsed == 5555996 and type(parsed) is int
    assert GradientCheckpointing(memory_budget=given).memory_budget == given


@pytest.mark.parametrize("budget", [1, 512, 1023.0, "1000B", "1kB"])
def test_a_byte_budget_under_1kib_is_refused_naming_the_fraction_and_the_bytes_forms(budget):
    with pytest.raises(ValueError, match=r"under the least byte budget of 1024 B.*such as 1\.0 or 0\.5.*'1KiB'"):
        GradientCheckpointing(memory_budget=budget)


@pytest.mark.parametrize("budget", ["lots", "2 parsecs", 0.0, 1.5, 2048.5, -3, 0, True, [1]])
def test_memory_budget_not_understood(budget):
    with pytest.raises((ValueError, TypeError), match="memory_budget.*Pass None"):
        GradientCheckpointing(memory_budget=budget)


def test_auto_budget_is_the_callbacks_alone():
    """'auto' needs a trainer's device and optimizer: the callback takes it, the plain parser says what to pass."""
    with pytest.raises(ValueError, match=r"only understood by the GradientCheckpointing callback.*Pass None"):
        parse_memory_budget("auto")
    assert parse_memory_budget("auto", allow_auto=True) == "auto"
    assert GradientCheckpointing(memory_budget="auto").memory_budget == "auto"
    assert GradientCheckpointing(memory_budget="2GiB").memory_budget == "2GiB"


def test_layer_10_is_not_inside_layer_1():
    # Outermost matches only: a layer is dropped when its name lies inside an earlier match's ("1.inner" inside
    # "1"), never because it starts with the same characters ("10" after "1").
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

    model = nn.Sequential(nn.Linear(2, 2), Wrapper(), *[nn.Linear(2, 2) for _ in range(9)])
    assert [name for name, _ in select_layers(model, (nn.Linear, Wrapper))] == [str(i) for i in range(11)]
    assert [name for name, _ in select_layers(model, (nn.Linear, Wrapper), every_n_layers=5)] == ["0", "5", "10"]
