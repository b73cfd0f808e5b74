"""``python -m e2e.harness.images``: see cli.py."""

import sys

from e2e.harness.images.cli import main

sys.exit(main())
