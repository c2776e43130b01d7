"""``python -m inductor_ext.tuning``: the standalone tuner (:mod:`inductor_ext.tuning.cli`)."""

import sys

from inductor_ext.tuning.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
