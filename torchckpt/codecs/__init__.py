"""Codecs that compress tensors on the GPU before they leave it (issue 5).

``Codec`` is the interface (base.py), ``Identity`` the lossless baseline and ``TritonQuant``
block-wise 8/4-bit quantization with a per-element error bound (quant.py).
"""
from torchckpt.codecs.base import Codec, Guarantee, Identity, Meta, Packed
from torchckpt.codecs.quant import TritonQuant

__all__ = ["Codec", "Guarantee", "Identity", "Meta", "Packed", "TritonQuant"]
