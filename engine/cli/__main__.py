"""``python -m engine.cli``: the same as the ``sgld`` command."""
import sys

from . import main

sys.exit(main())
