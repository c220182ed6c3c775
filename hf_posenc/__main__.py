"""``python -m hf_posenc ...``: the ``hf-posenc`` command (e.g. ``python -m hf_posenc doctor``)."""

import sys

from .cli import main

sys.exit(main())
