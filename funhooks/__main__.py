"""``python -m funhooks``: the same command as ``funhooks``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
