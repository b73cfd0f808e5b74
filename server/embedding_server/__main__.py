"""``python -m embedding_server``: the same command line as the ``embedding-server`` script."""

import sys

from embedding_server.cli import main

sys.exit(main())
