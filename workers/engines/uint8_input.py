"""The uint8 input contract: image engines take the prep processes' uint8 NHWC RGB pixels and
normalise them where they run.

A `Normalization` says how pixels become the model's input — (x·scale − mean) / std, in the
model's channel order and layout. Every engine applies the same one: NumPy or CuPy through
`prep.pixels.normalize` (ONNX Runtime on the CPU), torch ops on the device inside the torch
engine's CUDA graph, or as nodes prepended to the ONNX graph itself, so TensorRT and ONNX
Runtime CUDA fuse it into the first layer (`onnx_uint8.prepend`). What crosses the bus is a
quarter of the float32 batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kiln.app.catalog.model_spec import Preprocessing
from kiln.workers.prep.pixels import normalize

Triple = tuple[float, float, float]


@dataclass(frozen=True)
class Normalization:
    """uint8 NHWC RGB → (x·scale − mean) / std in `channel_order` and `layout`. mean and std
    are in the model's channel order (as the model's spec gives them)."""

    mean: Triple = (0.0, 0.0, 0.0)
    std: Triple = (1.0, 1.0, 1.0)
    scale: float = 1 / 255
    channel_order: str = "RGB"
    layout: str = "NCHW"

    @classmethod
    def of(cls, pre: Preprocessing) -> Normalization:
        return cls(pre.mean, pre.std, pre.scale, pre.channel_order, pre.layout)

    def gain_shift(self) -> tuple[np.ndarray, np.ndarray]:
        """Per channel, in the model's channel order: x·gain + shift is the normalised value
        (scale/std and −mean/std, folded once)."""
        inv_std = 1.0 / np.asarray(self.std, dtype=np.float32)
        gain = np.float32(self.scale) * inv_std
        shift = -np.asarray(self.mean, dtype=np.float32) * inv_std
        return gain.astype(np.float32), shift.astype(np.float32)

    def __call__(self, xp: ModuleType, batch: Any, dtype: str = "float32") -> Any:
        """On NumPy or CuPy (the engines' `Prepare` signature)."""
        return normalize(
            xp,
            batch,
            mean=self.mean,
            std=self.std,
            scale=self.scale,
            layout=self.layout,
            dtype=dtype,
            channel_order=self.channel_order,
        )


class TorchNormalization:
    """A `Normalization` as torch ops on one device, its constants made there once — so the
    ops can be captured in a CUDA graph, which allows no host-to-device copy while capturing."""

    def __init__(self, norm: Normalization, device: Any, dtype: Any) -> None:
        import torch

        gain, shift = norm.gain_shift()
        shape = (1, 3, 1, 1) if norm.layout == "NCHW" else (1, 1, 1, 3)
        self._gain = torch.from_numpy(gain).reshape(shape).to(device)
        self._shift = torch.from_numpy(shift).reshape(shape).to(device)
        self._nchw = norm.layout == "NCHW"
        self._bgr = norm.channel_order == "BGR"
        self._dtype = dtype

    def __call__(self, pixels: Any) -> Any:
        """uint8 NHWC → the model's input. NCHW is the permuted view of NHWC memory, which is
        torch's channels_last: the convolutions read it without a transpose."""
        import torch

        x = pixels.flip(-1) if self._bgr else pixels
        if self._nchw:
            x = x.permute(0, 3, 1, 2)
        out = torch.addcmul(self._shift, x.to(torch.float32), self._gain)
        return out if out.dtype == self._dtype else out.to(self._dtype)
