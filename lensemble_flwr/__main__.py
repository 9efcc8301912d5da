"""``python -m lensemble_flwr``: the ``lensemble-flwr`` command (docs/cli.md)."""

from lensemble_flwr.cli import main

raise SystemExit(main())
