"""``python -m lensemble_flwr.cli``: the same as the ``lensemble-flwr`` console script."""

from lensemble_flwr.cli import main

raise SystemExit(main())
