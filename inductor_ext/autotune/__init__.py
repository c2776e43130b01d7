"""The former name of the standalone tuner's command: ``python -m inductor_ext.autotune`` runs
``python -m inductor_ext.tuning`` with a FutureWarning, until the next release."""
