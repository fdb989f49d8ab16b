"""Package data: one real DeepSeek-V3 expert-load dump (see ``SOURCE.txt`` next to this file for its origin).

``fdeplb demo`` without ``--trace`` runs on it, and the tests use it when ``../shared/real_data`` is absent.
"""

from __future__ import annotations

import gzip
import shutil
from importlib import resources
from pathlib import Path

__all__ = ["BUNDLED_TRACE", "ORIGINAL_NAME", "extract_bundled_trace", "source_note"]

#: the bundled dump (gzip of SGLang's decode_in1000out1000.json, 58 MoE layers x 256 experts after reading)
BUNDLED_TRACE = "dsv3_decode_in1000out1000.json.gz"
#: its name in ../shared/real_data (folder, file), where the uncompressed original lives
ORIGINAL_NAME = ("dsv3_sglang_ep_stats", "decode_in1000out1000.json")


def extract_bundled_trace(directory: str | Path, name: str = ORIGINAL_NAME[1]) -> Path:
    """Write the bundled dump, uncompressed, to ``directory/name`` (the directory is created) and return that path.
    Worker processes read it from there. Raises OSError if the directory cannot be written."""
    dest = Path(directory) / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    with resources.files(__name__).joinpath(BUNDLED_TRACE).open("rb") as raw, gzip.open(raw) as src, \
            open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
    return dest


def source_note() -> str:
    """The text of ``SOURCE.txt``: where the bundled dump comes from."""
    return resources.files(__name__).joinpath("SOURCE.txt").read_text(encoding="utf-8")
