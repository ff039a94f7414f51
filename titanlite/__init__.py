"""titanlite: PyTorch-native pretraining for Llama-style models."""

__version__ = "0.1.0"
