"""``python -m tidal``: the same CLI as the ``tidal`` console script."""

from __future__ import annotations

import sys

from tidal.cli import main

if __name__ == "__main__":
    sys.exit(main())
