"""The ``lightning-pulse`` command: LightningCLI for training, plus ``report`` for energy reports.

``lightning-pulse fit --config examples/mnist1d/pulse.yaml`` trains any LightningModule/DataModule named by
``class_path`` in the YAML, with the pulse callbacks configured under ``trainer.callbacks``. Class paths
resolve from the current directory too, as with ``python -m``, so a project's own modules need no install.

``lightning-pulse report DIR`` re-renders ``energy_report.md`` and the PNG from ``DIR/energy_report.json``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI


class PulseCLI(LightningCLI):
    """LightningCLI in subclass mode whose construction errors read like argument errors.

    A callback's ``ValueError`` (e.g. ``PulseCycle(burst="-5min")``) is raised while the classes are
    instantiated, before any training; it is reported as ``error: <message>`` with exit code 2 instead of a
    traceback.
    """

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            self.parser.error(str(error))


def run_report(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="lightning-pulse report", description="Re-render an energy report.")
    parser.add_argument("directory", help="folder holding energy_report.json")
    args = parser.parse_args(list(argv))
    from lightning_pulse.energy.report import render_report

    try:
        written = render_report(args.directory)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    for path in written:
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-pulse`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "report":
        return run_report(args[1:])
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    PulseCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if argv is None else args,
        save_config_kwargs={"overwrite": True},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
