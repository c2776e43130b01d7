"""``python -m inductor_ext.autotune``: ``python -m inductor_ext.tuning`` with a FutureWarning."""

import sys
import warnings

from inductor_ext.tuning.cli.main import main

if __name__ == "__main__":
    warnings.warn(
        "python -m inductor_ext.autotune is deprecated and will be removed in the next release: "
        "run python -m inductor_ext.tuning (or inductor-ext-autotune) instead",
        FutureWarning,
        stacklevel=1,
    )
    sys.exit(main())
