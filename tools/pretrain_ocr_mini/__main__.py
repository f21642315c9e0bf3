"""`python3 -m tools.pretrain_ocr_mini ...` from the repository root (flags: `--help`)."""

import sys

from .cli import main

if __name__ == "__main__":  # not in the spawned pool's workers
    sys.exit(main())
