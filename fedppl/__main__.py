"""``python -m fedppl``: the command line (:mod:`fedppl.cli`)."""

from fedppl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
