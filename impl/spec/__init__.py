"""Decoding baselines shared by the DEX and TEV experiments; AR is the reference of every method."""

from .ar import ARResult, ar_decode

__all__ = ["ARResult", "ar_decode"]
