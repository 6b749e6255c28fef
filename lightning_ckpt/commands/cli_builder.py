"""Build the package's LightningCLI: any LightningModule and LightningDataModule named by ``class_path``.

Lower than :mod:`lightning_ckpt.commands.cli` (the command) and :mod:`lightning_ckpt.commands.compare.run` (its workers): both
build their LightningCLI here, so neither imports the other for it.

Example::

    cli = run_cli(["--config", "configs/tiny.yaml"], run=False)  # trainer, model and data, not trained
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

__all__ = ["run_cli"]


def run_cli(args: Optional[list[str]] = None, cli_class: type[LightningCLI] = LightningCLI,
            **cli_kwargs: Any) -> LightningCLI:
    """Run LightningCLI (or ``cli_class``, a subclass) over any LightningModule/LightningDataModule named by
    ``class_path`` and return it.

    ``args=None`` reads the command line (``sys.argv``), as LightningCLI does. ``cli_kwargs`` go to
    ``LightningCLI`` (e.g. ``run=False`` to only build the trainer, model and data).
    """
    cli_kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return cli_class(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args, **cli_kwargs
    )
