"""``python -m lightning_ckpt.commands.compare``: the command, and each worker process that it starts."""

import sys

from lightning_ckpt.commands.compare import main

if __name__ == "__main__":
    sys.exit(main())
