"""The ``lightning-ckpt`` command: a LightningCLI for any LightningModule, plus ``compare``.

Example::

    lightning-ckpt fit --config configs/every_4th_offload.yaml
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


def run_cli(args: Optional[list[str]] = None, **cli_kwargs: Any) -> LightningCLI:
    """Run LightningCLI over any LightningModule/LightningDataModule named by ``class_path`` and return it.

    ``cli_kwargs`` go to ``LightningCLI`` (e.g. ``run=False`` to only build the trainer, model and data).
    """
    cli_kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return LightningCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args, **cli_kwargs
    )


def main(args: Optional[list[str]] = None) -> Optional[int]:
    """Entry point: ``lightning-ckpt {fit,validate,test,predict,compare} --config X.yaml``."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["compare"]:
        from lightning_ckpt.compare import main as compare

        return compare(argv[1:])
    run_cli(argv)


if __name__ == "__main__":
    sys.exit(main())
