"""`lightning-ckpt plan`'s arguments (commands/plan/__init__.py's `_parse` and `_lengths`), parsed without a run."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from lightning_ckpt.commands.plan import _lengths, _parse

TINY = str(Path(__file__).parents[3] / "configs" / "tiny.yaml")
GiB = 2**30


def test_every_option_left_out_is_its_default():
    assert vars(_parse(["--config", TINY])) == {
        "config": Path(TINY), "memory_budget": None, "device_memory": None, "device": None, "offload": None,
        "host_memory": None, "compress": None, "chunk_loss": None, "tile_mlp": None, "lean_layers": None, "lengths": (),
        "fake": False,
        "output_dir": None, "cli_args": []}


def test_every_option_given_is_parsed_and_overrides_are_passed_on():
    args = _parse(["--config", TINY, "--memory-budget", "2GiB", "--device-memory", "80GiB", "--device", "h100-sxm",
                   "--offload", "auto", "--host-memory", "256GiB", "--compress", "fp8", "--chunk-loss", "true",
                   "--tile-mlp", "false", "--lean-layers", "true", "--lengths", "2048,512", "--fake", "--output-dir", "out",
                   "--model.init_args.n_layer=2", "--trainer.max_steps", "3"])
    assert vars(args) == {
        "config": Path(TINY), "memory_budget": 2 * GiB, "device_memory": 80 * GiB, "device": "h100-sxm",
        "offload": "auto", "host_memory": 256 * GiB, "compress": "fp8", "chunk_loss": "true", "tile_mlp": "false",
        "lean_layers": "true", "lengths": (512, 2048), "fake": True, "output_dir": Path("out"),
        "cli_args": ["--model.init_args.n_layer=2", "--trainer.max_steps", "3"]}
    assert _parse(["--config", TINY, "--trainer.max_steps", "3"]).cli_args == ["--trainer.max_steps", "3"]
    assert _parse(["--config", TINY, "--memory-budget", "0.3"]).memory_budget == 0.3
    assert _parse(["--config", TINY, "--host-memory", "2.5e11"]).host_memory == 250_000_000_000


@pytest.mark.parametrize(("option", "choices"), [("--offload", "'auto', 'true', 'false'"),
                                                 ("--compress", "'bf16', 'fp8', 'none'"),
                                                 ("--chunk-loss", "'auto', 'true', 'false'"),
                                                 ("--tile-mlp", "'true', 'false'"),
                                                 ("--lean-layers", "'true', 'false'")])
def test_a_choice_outside_its_choices_exits_2_naming_them(option, choices, capsys):
    for choice in choices.replace("'", "").split(", "):
        assert getattr(_parse(["--config", TINY, option, choice]), option[2:].replace("-", "_")) == choice
    with pytest.raises(SystemExit) as info:
        _parse(["--config", TINY, option, "maybe"])
    assert info.value.code == 2
    assert f"argument {option}: invalid choice: 'maybe' (choose from {choices})" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "said"), [
    (["--device-mem", "80GiB"], "unrecognized arguments: --device-mem (LightningCLI overrides start with --trainer.,"
                                " --model., --data., such as --model.init_args.n_layer=32)"),  # no abbreviations
    (["stray"], "unrecognized arguments: stray (LightningCLI overrides start with"),
    (["stray", "words"], "unrecognized arguments: stray (LightningCLI overrides start with"),  # the first word
    (["--fakes", "--devce", "x"], "unrecognized arguments: --fakes --devce (LightningCLI overrides start with"),
    (["--device-memory", "lots"], "--device-memory lots: pass the device's memory in bytes, such as 80GiB, 40e9 or"
                                  " 16000000000"),
    (["--host-memory", "lots"], "--host-memory lots: pass the target's host memory per device in bytes, such as"
                                " 256GiB, 2.5e11 or 250000000000"),
    (["--memory-budget", "lots"], "--memory-budget lots: pass a fraction in (0, 1] of the activations without"
                                  " checkpointing, such as 0.3, or bytes, such as 2GiB or 500000000"),
    (["--lengths", "0,512"], "argument --lengths: '0,512': pass sequence lengths of 1 or more, comma-separated, such"
                             " as 512,2048,8192"),
])
def test_a_bad_argument_exits_2_saying_what_to_pass(argv, said, capsys):
    with pytest.raises(SystemExit) as info:
        _parse(["--config", TINY, *argv])
    assert info.value.code == 2
    assert said in capsys.readouterr().err


def test_lengths_are_sorted_distinct_and_each_one_or_more():
    assert _lengths("2048,512, 8192,512,") == (512, 2048, 8192)
    assert _lengths("1") == (1,)
    for text in ("0,512", "-4", "", " , ", "512,many"):
        with pytest.raises(argparse.ArgumentTypeError, match="^" + re.escape(f"{text!r}: pass sequence lengths of 1 or more,"
                                                           " comma-separated, such as 512,2048,8192") + "$"):
            _lengths(text)
