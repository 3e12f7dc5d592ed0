"""Codecs that compress tensors on the GPU before they leave it.

``Codec`` is the interface (base.py), ``Identity`` the lossless baseline, ``TritonQuant``
block-wise 8/4-bit quantization with a per-element error bound (quant.py), ``Bitcomp`` nVIDIA
nvCOMP's Bitcomp, lossless or lossy with an absolute bound (bitcomp.py; needs the
``nvidia-libnvcomp-cu13`` wheel), ``ZFP`` fixed-rate zfp / cuZFP (zfp.py; needs the extension
built with ``TORCHCKPT_BUILD_ZFP=1``).
"""
from torchckpt.codecs.base import Codec, Deferred, Guarantee, Identity, Meta, Packed
from torchckpt.codecs.bitcomp import Bitcomp
from torchckpt.codecs.quant import TritonQuant
from torchckpt.codecs.zfp import ZFP

__all__ = ["Bitcomp", "Codec", "Deferred", "Guarantee", "Identity", "Meta", "Packed", "TritonQuant", "ZFP"]
