"""trainyard: a self-hosted service for PyTorch training and inference jobs."""
__version__ = "0.1.0"
