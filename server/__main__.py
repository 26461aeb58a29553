"""`python -m specserve.server serve ...` is the `specserve` console script."""
import sys

from specserve.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
