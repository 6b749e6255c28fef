"""How to checkpoint: selecting layers, wrapping them, and what a checkpointed layer does with what it saves.

Selection (:mod:`~lightning_ckpt.core.checkpoint.selection`), wrapping
(:mod:`~lightning_ckpt.core.checkpoint.wrapping`), layer state, selective policies, offload to host memory (its engine and hooks,
its host pool, its streams and the CPU stand-in for them, saved tensors copied once), compressed checkpoints, the LM head and loss in chunks, tiles of tokens, placement inside
FSDP units, the log lines said once, and the storage helpers these share
(:mod:`~lightning_ckpt.core.checkpoint.storages`).

The bottom of ``core``: imports neither :mod:`lightning_ckpt.core.measure` nor :mod:`lightning_ckpt.core.plan` (only the
standard library, torch, numpy, psutil and this folder).
"""

__all__: list[str] = []  # the submodules are the API; this package itself offers no names
