"""Kept so that configs written before the ``demos`` package keep loading: ``lightning_ckpt.demos_hf.LoraCausalLM``
is :class:`lightning_ckpt.demos.hf.LoraCausalLM`. New code imports from :mod:`lightning_ckpt.demos.hf`."""

from lightning_ckpt.demos.hf import LoraCausalLM, TokenDataModule

__all__ = ["LoraCausalLM", "TokenDataModule"]
