"""The chunked LM head + loss under DDP and FSDP2 (2 gloo processes, spawn), head frozen and training: the first
step's gradients as the unchunked head's (rel <= 1e-6), the weights after 3 AdamW steps close (rel <= 1e-3: Adam
divides each small gradient difference by its own small second moment), the head called in chunks (4 in the
forward, 4 recomputed in the backward)."""

from __future__ import annotations

import pytest
import torch

from _chunk_dist import run

NAMES = [f"{s}-{c}-{f}" for s in ("ddp", "fsdp") for f in ("training", "frozen") for c in ("plain", "chunked")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(NAMES, tmp_path_factory.mktemp("chunked_dist"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("frozen", ["training", "frozen"])
def test_chunked_head_trains_like_the_unchunked_one(results, strategy, frozen):
    plain, chunked = results[f"{strategy}-plain-{frozen}"], results[f"{strategy}-chunked-{frozen}"]
    for rank in range(2):
        assert "error" not in plain[rank], plain[rank].get("traceback")
        assert "error" not in chunked[rank], chunked[rank].get("traceback")
        assert plain[rank]["chunk_by_callback"] is None and chunked[rank]["chunk_by_callback"] == 1024
        assert plain[rank]["chunk"] is None and chunked[rank]["chunk"] == 16
        assert plain[rank]["head_calls"] == [1, 1, 1]
        assert chunked[rank]["head_calls"] == [8, 8, 8]  # 4 chunks of 16 tokens, each run again in the backward
        want, got = plain[rank]["first_grads"], chunked[rank]["first_grads"]
        assert got.keys() == want.keys() and ("model.head.weight" in got) == (frozen == "training")
        for name in want:
            rel = float((got[name] - want[name]).norm() / want[name].norm())
            assert rel <= 1e-6, (name, rel)
        want, got = plain[rank]["weights"], chunked[rank]["weights"]
        for name in want:
            rel = float((got[name] - want[name]).norm() / want[name].norm())
            assert rel <= 1e-3, (name, rel)
        if frozen == "frozen":
            assert torch.equal(got["model.head.weight"], want["model.head.weight"])
