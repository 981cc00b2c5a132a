"""moe-tune: fine-tune sparse Mixture-of-Experts models. Code lives in moe_tune.{cli,engine,ops,profiles}."""

# os.path, not pathlib: the `moe-tune` command imports this package first, and the less it imports before
# cli.main holds Ctrl-C, the shorter the time a Ctrl-C prints a traceback.
import os.path as _os_path

__version__ = "0.1.0"

# In a source checkout cli/, engine/, ops/ and profiles/ sit beside this folder (setup.cfg maps them into the package
# when it is installed): find them there too, so `python -m moe_tune` also runs from the checkout's root.
_checkout = _os_path.dirname(_os_path.dirname(_os_path.realpath(__file__)))
if (_os_path.isfile(_os_path.join(_checkout, "setup.cfg"))
        and _os_path.isfile(_os_path.join(_checkout, "cli", "__init__.py"))):
    __path__.append(_checkout)
