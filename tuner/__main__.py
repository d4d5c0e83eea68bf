"""``python -m tuner``: the ``recompute-tune`` command line."""

from tuner.cli import command

if __name__ == "__main__":
    raise SystemExit(command())
