"""`python -m server serve ...` is the `specserve` console script."""
import sys

from server.cli import main

sys.exit(main())
