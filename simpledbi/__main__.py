"""``python -m simpledbi serve|status ...``: see simpledbi.cli."""
import sys

from .cli import main

sys.exit(main())
