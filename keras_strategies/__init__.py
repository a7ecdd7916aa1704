"""keras_strategies: the `tf.distribute.Strategy` API for Keras 3 on TensorFlow, JAX and PyTorch.

Import it as `import keras_strategies as ks`; names follow `tf.distribute`, so
switching is `s/tf.distribute/ks/`. Importing changes nothing for Keras code
that never enters a strategy scope.

The launcher process (`python -m keras_strategies.launch`, `keras-strategies-launch`)
needs none of Keras: there the API is imported on first use instead, which
saves the seconds that importing Keras and its backend takes.
"""

import os as _os
import sys as _sys

from keras_strategies._version import __version__


def _running_the_launcher() -> bool:
    argv = list(getattr(_sys, "orig_argv", []))
    if argv and _os.path.basename(argv[min(1, len(argv) - 1)]) == "keras-strategies-launch":
        return True
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-m"):
            return (arg[2:] or "".join(argv[i + 1:i + 2])) == "keras_strategies.launch"
        if not arg.startswith("-") or arg.startswith("-c"):  # a script or command: Python's options end
            return False
        i += 2 if arg in ("-X", "-W") else 1
    return False


if _running_the_launcher():

    def __getattr__(name: str):
        from keras_strategies import _api

        try:
            return getattr(_api, name)
        except AttributeError:
            raise AttributeError(f"module 'keras_strategies' has no attribute {name!r}") from None

else:
    from keras_strategies.console import quiet_tensorflow as _quiet_tensorflow

    _quiet_tensorflow.install()  # before Keras, which imports TensorFlow on its backend
    from keras_strategies._api import *  # noqa: F401,F403
    from keras_strategies._api import __all__  # noqa: F401
    from keras_strategies._api import __getattr__  # noqa: F401  (names tf.distribute has and ks does not)
