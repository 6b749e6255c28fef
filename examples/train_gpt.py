"""Train the demo GPT with gradient checkpointing: the one-line change to a Lightning project.

The model and its data module live in ``lightning_ckpt.demos`` (importable after install, so the
LightningCLI configs in ``configs/`` can name them); this script is the plain-Trainer version.

    python examples/train_gpt.py --every-n-layers 4 --offload --steps 300
"""

from __future__ import annotations

import argparse
from typing import Optional

from lightning.pytorch import Trainer, seed_everything

from lightning_ckpt import GradientCheckpointing
from lightning_ckpt.demos import GPT, CountingDataModule


def main(args: Optional[list[str]] = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every-n-layers", type=int, default=4, help="checkpoint blocks 0, n, 2n, ...")
    parser.add_argument("--offload", action="store_true", help="keep checkpointed inputs in host memory")
    parser.add_argument("--no-checkpointing", action="store_true", help="the baseline, without the callback")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=8)
    opts = parser.parse_args(args)

    seed_everything(0)
    callbacks = [] if opts.no_checkpointing else [
        GradientCheckpointing(every_n_layers=opts.every_n_layers, offload=opts.offload)  # the one line
    ]
    trainer = Trainer(max_steps=opts.steps, callbacks=callbacks, logger=False, enable_checkpointing=False)
    trainer.fit(GPT(n_layer=opts.layers), CountingDataModule())
    print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
    return trainer


if __name__ == "__main__":
    main()
