"""`python -m benchmarks.lookup`: run the lookup benchmark (see the package docstring)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
