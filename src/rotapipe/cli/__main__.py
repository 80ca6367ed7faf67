"""``python -m rotapipe.cli``: the same as the ``rotapipe`` command."""

import sys

from . import main

sys.exit(main())
