"""moe-tune: fine-tune sparse Mixture-of-Experts models. Code lives in moe_tune.{cli,engine,ops,profiles}."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# In a source checkout cli/, engine/, ops/ and profiles/ sit beside this folder (setup.cfg maps them into the package
# when it is installed): find them there too, so `python -m moe_tune` also runs from the checkout's root.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "setup.cfg").is_file() and (_checkout / "cli" / "__init__.py").is_file():
    __path__.append(str(_checkout))
