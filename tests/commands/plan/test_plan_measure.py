"""The batch plan measures, and its refusals (commands/plan/measure.py's helpers), against batches made by hand."""

from __future__ import annotations

import re
import warnings
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from lightning_ckpt.commands.plan import measure as pm
from lightning_ckpt.commands.plan.build import Built, build
from lightning_ckpt.core.checkpoint.chunked_loss import DEFAULT_CHUNK_TOKENS
from lightning_ckpt.core.measure.device_profile import DeviceProfile
from lightning_ckpt.demos import GPT


def _tiny(*cli_args: str) -> Built:
    """configs/tiny.yaml built for real (a 4-block GPT, batches of 8 sequences of 32 tokens)."""
    return build(Path(__file__).parents[3] / "configs" / "tiny.yaml", fake=False, seed_banner=False, cli_args=cli_args)


def test_the_batch_size_is_the_first_dimension_of_the_first_tensor():
    assert pm.batch_size_of({"ids": torch.zeros(5, 3), "mask": torch.zeros(2)}) == 5
    assert pm.loader_batch_size([(torch.zeros(6, 2), torch.zeros(6)), (torch.zeros(2, 2), torch.zeros(2))]) == 6
    with pytest.raises(ValueError, match=re.escape("(got a 0-d tensor first in a tuple). Make the dataloader yield")):
        pm.batch_size_of((torch.tensor(1.0), torch.zeros(3)))
    with pytest.raises(ValueError, match=re.escape("(got a list of no tensor)")):
        pm.batch_size_of(["a", "b"])


def test_a_batch_of_any_size_is_the_loader_s_batches_joined_then_cut_to_its_own_storage():
    loader = [(torch.arange(4), "tag"), (torch.arange(4, 8), "other")]
    ids, tag = pm.batch_of_size(loader, 6)
    assert ids.tolist() == [0, 1, 2, 3, 4, 5] and tag == "tag"
    assert ids.untyped_storage().nbytes() == 6 * 8  # a copy of six rows, not a view of eight
    assert pm.batch_of_size(loader, 10)[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # round again
    assert pm.batch_of_size(loader, 4)[0].tolist() == [0, 1, 2, 3]  # one batch is enough
    with pytest.raises(ValueError, match="the loader's batches differ in structure"):
        pm.batch_of_size([(torch.arange(4),), {"ids": torch.arange(4)}], 6)
    with pytest.raises(ValueError, match="^" + re.escape(
            "plan: the training dataloader is empty: check the data's settings in the config (the number of samples,"
            " `batch_size` with `drop_last`).") + "$"):
        pm.batch_of_size([], 2)


def test_a_batch_at_a_length_and_its_refusals():
    batch = (torch.arange(6).view(2, 3),)
    assert pm.batch_of_length(batch, 1)[0].tolist() == [[0], [3]]
    assert pm.batch_of_length(batch, 5)[0].tolist() == [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4]]
    with pytest.raises(ValueError, match=re.escape("plan: --lengths: a length of 0 tokens; pass lengths of 1 or more")):
        pm.batch_of_length(batch, 0)
    with pytest.raises(ValueError, match=re.escape("plan: --lengths needs token ids in the batch (a 2-D integer tensor,"
                                                   " batch x length) to know the sequence length; the training batch"
                                                   " has none.")):
        pm.batch_of_length((torch.zeros(2, 3),), 4)


def test_a_length_past_the_model_s_position_table_is_refused_with_its_name():
    built = NS(module=GPT(vocab_size=8, block_size=16, n_layer=1, n_embd=8, n_head=1))
    pm.check_length(built, 16)  # the last position there is
    with pytest.raises(ValueError, match=re.escape("a length of 17 tokens: its block_size is 16 (its position table ends"
                                                   " there). Pass lengths up to 16, or a larger block_size (such as"
                                                   " --model.init_args.block_size=17).")):
        pm.check_length(built, 17)
    pm.check_length(NS(module=torch.nn.Linear(2, 2)), 10**9)  # nothing bounds it


def test_the_loss_is_what_training_step_returned_or_its_loss_entry():
    loss = torch.tensor(2.0)
    assert pm._loss(loss) is loss and pm._loss({"loss": loss, "log": 1}) is loss
    with pytest.raises(ValueError, match=re.escape("`training_step` returned None (manual optimization?). `plan`"
                                                   " measures models whose training_step returns the loss, or a dict"
                                                   " with 'loss': return it.")):
        pm._loss(None)
    with pytest.raises(ValueError, match=re.escape("returned a dict without a tensor 'loss' (manual optimization?)")):
        pm._loss({"logits": loss})


def test_the_device_profile_is_a_preset_none_or_the_accelerator_measured_here(monkeypatch):
    built = NS(planned_for=None, device=torch.device("cpu"))
    assert pm.device_profile(None, built) is None
    assert pm.device_profile("h100-sxm", built) == DeviceProfile.preset("h100-sxm")
    measured = []
    monkeypatch.setattr(pm.DeviceProfile, "measure", lambda device: measured.append(device) or "measured")
    assert pm.device_profile("auto", built) == "measured" and measured == [torch.device("cpu")]
    from lightning_ckpt.core.measure.device_profile import PRESET_NAMES

    presets = ", ".join(PRESET_NAMES)
    with pytest.raises(ValueError, match=re.escape(f"but the config's 'cuda' is not here; pass a preset instead ({presets}).")):
        pm.device_profile("auto", NS(planned_for="cuda", device=torch.device("cpu")))


def test_the_attention_kernels_that_run_are_named_and_their_backward_is_not():
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pm.AttentionKernels() as seen:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
        torch.ones(2).add(1)
    assert seen.names == {"aten._scaled_dot_product_flash_attention_for_cpu"}


def test_a_step_is_measured_at_the_loader_s_batch_size_unless_told_and_its_lm_head_in_chunks_only_when_allowed():
    built = _tiny()
    measured = pm.measure(built)
    assert (measured.batch_size, measured.length) == (8, 32)  # tiny.yaml's batches: 8 sequences of 32 tokens
    assert pm.measure(built, batch_size=3, length=16).batch_size == 3
    assert pm.chunk_size(built) == DEFAULT_CHUNK_TOKENS and measured.chunked is not None  # the GPT's loss chunks
    built.chunk_loss = False
    assert pm.chunk_size(built) is None and pm.measure(built).chunked is None


def test_a_fake_batch_is_its_tensors_made_fake_and_the_rest_as_it_was():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    ids, tag = pm._on_device(NS(fake_mode=FakeTensorMode(), device=torch.device("cpu")), (torch.arange(3), "tag"))
    assert isinstance(ids, FakeTensor) and tuple(ids.shape) == (3,) and ids.dtype == torch.int64 and tag == "tag"
    real = pm._on_device(NS(fake_mode=None, device=torch.device("cpu")), (torch.arange(3), "tag"))
    assert not isinstance(real[0], FakeTensor) and real[0].tolist() == [0, 1, 2] and real[1] == "tag"


@pytest.mark.parametrize("mask", ["padded", "ones", "none"])
def test_a_transformers_batch_is_measured_on_fake_tensors_as_on_real_ones(mask):
    """A padding mask's values decide Transformers' attention path, and Transformers 5 takes a fake tensor for
    tracing (and then builds a [B, 1, T, T] mask a real step leaves to SDPA); ``measure`` hands the real batch beside
    the fake one (fake_values.real_branches), so the fake step reads its values, takes the real step's path, and
    holds its bytes."""
    import lightning.pytorch as pl
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Llama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                              max_position_embeddings=128, attn_implementation="sdpa")
            self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

    ids = torch.randint(0, 96, (2, 96), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if mask != "none":
        batch["attention_mask"] = torch.ones(2, 96, dtype=torch.long)
    if mask == "padded":
        batch["attention_mask"][1, 40:] = 0  # the second sequence is padded: the mask is not all ones
    loader = [batch]
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer

    def measured(fake_mode):
        with fake_mode if fake_mode is not None else nullcontext():
            module = Llama()
        built = Built(module, loader, torch.device("cpu"), layer, False, None, fake_mode, time_layers=False)
        m = pm.measure(built)
        return sum(c.none_bytes + c.transient_bytes for c in m.costs) + m.outside_bytes, m

    real, real_m = measured(None)
    fake, fake_m = measured(FakeTensorMode(allow_non_fake_inputs=True))
    assert (fake_m.batch_size, fake_m.length) == (real_m.batch_size, real_m.length) == (2, 96)
    assert real > 0 and abs(fake - real) <= 0.01 * real, f"fake {fake} B against real {real} B"


def test_the_step_is_the_config_s_training_step_on_the_first_batch_with_the_layers_and_timing_it_names():
    """measure runs ``training_step(batch, 0)`` as Lightning's first step does, lets the config's warnings through but
    not Lightning's "no trainer" one, adds the attention kernels that ran to those seen before, checkpoints the
    layers of ``built.layer_cls`` (in the plain and the chunked-head step), times them only when ``time_layers``, and
    measures the chunked head at ``chunk_size``."""
    from lightning_ckpt.demos import CausalSelfAttention

    # without dropout, the CPU runs its fused attention kernel (with it, the math implementation's plain ops)
    built = _tiny("--model.init_args.dropout=0.0")
    assert built.layer_cls == "lightning_ckpt.demos.Block"  # as the config names it
    step, seen = built.module.training_step, []

    def training_step(batch, batch_idx):
        seen.append(batch_idx)
        built.module._trainer = None  # as plan's module stands: self.log warns that no trainer is registered
        built.module.log("probe", 1.0)
        warnings.warn("the config's own warning")
        return step(batch, batch_idx)

    built.module.training_step = training_step
    built.attention_kernels = {"aten.seen_before"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blocks = pm.measure(built, batch_size=2)
    messages = [str(w.message) for w in caught]
    assert "the config's own warning" in messages
    assert not [m for m in messages if "`self.trainer` reference is not registered" in m]
    assert seen and set(seen) == {0}
    assert built.attention_kernels == {"aten.seen_before", "aten._scaled_dot_product_flash_attention_for_cpu"}
    assert [c.name for c in blocks.costs] == [f"model.blocks.{i}" for i in range(4)]
    assert all(c.plain_ns > 0 and c.full_ns > 0 for c in blocks.costs)  # timed: real tensors, time_layers
    assert blocks.chunked is not None and blocks.chunked.chunk_tokens == DEFAULT_CHUNK_TOKENS

    built.layer_cls, built.time_layers = CausalSelfAttention, False
    attention = pm.measure(built, batch_size=2)
    assert [c.name for c in attention.costs] == [f"model.blocks.{i}.attn" for i in range(4)]
    assert all(c.plain_ns == c.full_ns == 0 for c in attention.costs)  # not timed
    # the MLPs, norms and residuals are outside the checkpointed attention: more bytes outside, chunked or not
    assert attention.outside_bytes > blocks.outside_bytes
    assert attention.chunked.outside_bytes > blocks.chunked.outside_bytes


@pytest.mark.parametrize("error", [RuntimeError, IndexError])
def test_a_step_that_fails_at_a_length_names_the_length_and_the_error(error):
    built = _tiny()

    def training_step(batch, batch_idx):
        raise error("index 40 is out of bounds")

    built.module.training_step = training_step
    with pytest.raises(ValueError, match=re.escape(
            "plan: --lengths: the step failed at a length of 24 tokens, which the model may not take"
            f" ({error.__name__}: index 40 is out of bounds)")):
        pm.measure(built, batch_size=2, length=24)
    with pytest.raises(error, match="index 40 is out of bounds"):  # at the loader's own length: the error itself
        pm.measure(built, batch_size=2)


def test_the_layers_are_timed_in_the_plain_step_only_not_again_with_the_head_in_chunks(monkeypatch):
    """Timing a layer takes rounds of forward and backward; the chunked-head step's layers are the plain step's, so
    measure times them once (the chunked step measures bytes only)."""
    from lightning_ckpt.core.measure import rerun

    timed = []
    times = rerun._times
    monkeypatch.setattr(rerun, "_times", lambda layer, *args: timed.append(layer) or times(layer, *args))
    built = _tiny()
    built.chunk_loss = False
    assert pm.measure(built, batch_size=2).chunked is None
    plain = len(timed)
    built.chunk_loss = None  # the plan chooses: the chunked head is measured too
    assert pm.measure(built, batch_size=2).chunked is not None
    assert plain > 0 and len(timed) == 2 * plain
