"""PP-OCR's parameters and model files, read from the rapidocr-onnxruntime package.

Its `config.yaml` ships beside the ONNX files it describes, so reading it (rather than copying
its numbers) keeps thresholds and models in step when the package is upgraded.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class OcrConfig:
    det_model: Path
    cls_model: Path
    rec_model: Path
    # The working image: what boxes are found in and lines cropped from.
    max_side_len: int  # larger images are shrunk to this
    min_side_len: int  # smaller ones are enlarged to this
    min_height: int  # images this short, or wider than `width_height_ratio`, are padded
    width_height_ratio: float  # -1: never pad for the ratio
    # Detection (DB).
    limit_side_len: int
    limit_type: str
    det_mean: tuple[float, float, float]
    det_std: tuple[float, float, float]
    thresh: float
    box_thresh: float
    max_candidates: int
    unclip_ratio: float
    use_dilation: bool
    score_mode: str
    # Angle classification and recognition: strips of a fixed height, padded in width.
    cls_height: int
    cls_width: int
    cls_thresh: float
    cls_labels: tuple[str, ...]
    rec_height: int
    rec_width: int  # the narrowest a recognition strip is padded to
    text_score: float  # lines read with a lower mean confidence are dropped


def rapidocr_dir() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        raise RuntimeError("The OCR model needs the rapidocr-onnxruntime package.")
    return Path(spec.origin).parent


def load_config(root: Path | None = None) -> OcrConfig:
    """The package's config.yaml as an `OcrConfig`; model paths resolved under `root`."""
    root = root or rapidocr_dir()
    raw: dict[str, Any] = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8"))
    general, det, cls, rec = raw["Global"], raw["Det"], raw["Cls"], raw["Rec"]
    _, cls_height, cls_width = cls["cls_image_shape"]
    _, rec_height, rec_width = rec["rec_img_shape"]
    return OcrConfig(
        det_model=root / det["model_path"],
        cls_model=root / cls["model_path"],
        rec_model=root / rec["model_path"],
        max_side_len=int(general["max_side_len"]),
        min_side_len=int(general["min_side_len"]),
        min_height=int(general["min_height"]),
        width_height_ratio=float(general["width_height_ratio"]),
        limit_side_len=int(det["limit_side_len"]),
        limit_type=str(det["limit_type"]),
        det_mean=_triple(det["mean"]),
        det_std=_triple(det["std"]),
        thresh=float(det["thresh"]),
        box_thresh=float(det["box_thresh"]),
        max_candidates=int(det["max_candidates"]),
        unclip_ratio=float(det["unclip_ratio"]),
        use_dilation=bool(det["use_dilation"]),
        score_mode=str(det["score_mode"]),
        cls_height=int(cls_height),
        cls_width=int(cls_width),
        cls_thresh=float(cls["cls_thresh"]),
        cls_labels=tuple(str(label) for label in cls["label_list"]),
        rec_height=int(rec_height),
        rec_width=int(rec_width),
        text_score=float(general["text_score"]),
    )


def _triple(values: list[Any]) -> tuple[float, float, float]:
    first, second, third = (float(v) for v in values)
    return first, second, third
