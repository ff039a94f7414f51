"""titanlite: PyTorch-native pretraining for Llama-style models."""

from titanlite import _moved

__version__ = "0.1.0"
_moved.install()  # an import of a moved module names its new place (titanlite._moved)
__getattr__ = _moved.moved_names(__name__)
