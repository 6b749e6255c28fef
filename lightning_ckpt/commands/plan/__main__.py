"""``python -m lightning_ckpt.commands.plan``: the same as ``lightning-ckpt plan``."""

import sys

from lightning_ckpt.commands.plan import main

if __name__ == "__main__":
    sys.exit(main())
