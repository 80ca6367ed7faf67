"""``python -m rotapipe``: the same as the ``rotapipe`` command."""

import sys

from .cli import main

sys.exit(main())
