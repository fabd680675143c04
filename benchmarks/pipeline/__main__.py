"""``python -m benchmarks.pipeline``: runs :func:`benchmarks.pipeline.runner.main`.
Only the entry point; the benchmark itself is in :mod:`.runner`."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
