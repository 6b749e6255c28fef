"""The ``lightning-ckpt`` console script (:mod:`~lightning_ckpt.commands.cli`) and its commands: ``fit`` and the
other LightningCLI subcommands, :mod:`~lightning_ckpt.commands.compare` and :mod:`~lightning_ckpt.commands.plan`.
Nothing below this package imports it."""
