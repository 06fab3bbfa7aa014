"""fsdp2-retrofit: rewrite single-GPU PyTorch training scripts into FSDP2."""

__version__ = "0.1.0"
