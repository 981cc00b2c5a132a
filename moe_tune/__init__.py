"""moe-tune: fine-tune sparse Mixture-of-Experts models. Code lives in moe_tune.{cli,engine,ops,profiles}."""

__version__ = "0.1.0"
