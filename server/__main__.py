"""`python -m server serve ...` is the `specserve` console script."""
import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
