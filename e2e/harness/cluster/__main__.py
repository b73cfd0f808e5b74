"""``python -m e2e.harness.cluster``: see cli.py."""

import sys

from e2e.harness.cluster.cli import main

sys.exit(main())
