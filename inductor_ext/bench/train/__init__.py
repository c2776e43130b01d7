"""``python -m inductor_ext.bench train``: the command line (:mod:`.cli`), the providers it compares
(:mod:`.providers`), the models (:mod:`.model`), one provider's run (:mod:`.worker`) and the report
(:mod:`.report`)."""

from inductor_ext.bench.train.cli import main
from inductor_ext.bench.train.model import MODELS, build_model, config_for, enable_checkpointing

__all__ = ["MODELS", "build_model", "config_for", "enable_checkpointing", "main"]
