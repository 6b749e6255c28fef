"""The ``lightning-ckpt`` command: a LightningCLI for any LightningModule, plus ``compare`` and ``plan``.

It sits on top of the package: it imports :mod:`lightning_ckpt.commands.compare`, :mod:`lightning_ckpt.commands.plan`
and the LightningCLI builder (:func:`~lightning_ckpt.commands.cli_builder.run_cli`, re-exported here), and nothing
imports it.

Example::

    lightning-ckpt fit --config configs/every_4th_offload.yaml
    lightning-ckpt plan --config configs/tiny.yaml --memory-budget 0.3 --device-memory 80GiB
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning_ckpt.commands.cli_builder import run_cli
from lightning_ckpt.commands.compare import main as compare_main
from lightning_ckpt.commands.plan import main as plan_main

__all__ = ["main", "run_cli"]


def main(args: Optional[list[str]] = None) -> Optional[int]:
    """Entry point: ``lightning-ckpt {fit,validate,test,predict,compare,plan} --config X.yaml``.

    ``args=None`` (the console script) reads the command line. LightningCLI then reads ``sys.argv`` itself:
    handing it ``sys.argv[1:]`` as ``args`` as well would make it warn, on every run, against passing both.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    run_cli(None if args is None else argv)
    return None


if __name__ == "__main__":
    sys.exit(main())
