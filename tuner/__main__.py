"""``python -m tuner``: the ``recompute-tune`` command line."""

from __future__ import annotations

import sys

from tuner.cli import command

if __name__ == "__main__":
    sys.exit(command())
