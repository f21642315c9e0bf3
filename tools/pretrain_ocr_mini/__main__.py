"""`python3 -m tools.pretrain_ocr_mini ...` from the repository root (flags: `--help`)."""

import sys

from .cli import main

sys.exit(main())
