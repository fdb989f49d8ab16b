"""Documents by path: the one reader and the one writer of every JSON or YAML file fdeplb reads or writes by a path
it was given (expert-load dumps, placement and plan files), and the rule their names follow.

========================== ===========================================================================================
name ends in               content
========================== ===========================================================================================
``.yaml`` / ``.yml``       YAML (TensorRT-LLM's placement); every other name holds JSON
``.gz`` (after the above)  the same, gzip-compressed (``plan.json.gz``, ``trt.yaml.gz``)
========================== ===========================================================================================

Reading and writing follow the same rule (:func:`document_kind`), so a file fdeplb writes always reads back; a writer
refuses a name that says another kind than the text it holds (:func:`check_document_name`) rather than write a
file whose name lies. Inputs are regular files of bounded size, outputs regular files too, never a FIFO or device
waited on (:mod:`fdeplb.input_files`); a document reads one way only (no key twice in an object or mapping, no YAML
alias: a few nested ones expand past any memory). The tables of numbers
in them (loads, phy2log rows) are read by :func:`number_table`, one rule for what a table may hold.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np

from fdeplb import input_files
from fdeplb.errors import InputError
from fdeplb.input_files import read_input

__all__ = ["DuplicateKeyError", "check_document_name", "document_kind", "number_table", "read_document", "unique_keys",
           "write_document"]

YAML_SUFFIXES = (".yaml", ".yml")


def _unzipped_name(p: Path) -> str:
    return p.name[:-3] if p.name.endswith(".gz") else p.name


def document_kind(path) -> str:
    """"yaml" when the name of ``path`` (less a final ``.gz``) ends in ``.yaml``/``.yml``, else "json"."""
    return "yaml" if Path(_unzipped_name(Path(path))).suffix in YAML_SUFFIXES else "json"


def check_document_name(path, kind: str, what: str, label: str | None = None) -> None:
    """:class:`InputError` unless the name of ``path`` says ``kind`` ("json" or "yaml", :func:`document_kind`);
    the message starts with ``label`` (default: the path) and names ``what`` the file holds ("a load dump")."""
    if document_kind(path) == kind:
        return
    label = str(path) if label is None else label
    if kind == "yaml":
        raise InputError(f"{label}: {what} is YAML; name it *.yaml or *.yml")
    raise InputError(f"{label}: {what} is JSON; a *.yaml or *.yml name would be read as YAML: name it *.json")


def write_document(path, text: str, *, kind: str, what: str, label: str | None = None,
                   error: type[InputError] = InputError) -> Path:
    """Write ``text`` (a JSON or YAML document, as ``kind`` says) to ``path``, gzip-compressed when the name ends in
    ``.gz`` (with mtime 0: the same text gives the same bytes); returns the path.

    Raises:
        InputError: the name says another kind (:func:`check_document_name`); nothing written.
        ``error``: the file cannot be written, or ``path`` exists and is not a regular file (a FIFO, a device, a
            folder: :func:`fdeplb.input_files.open_output`, refused without waiting; nothing written). The message
            starts with ``label``, default the path.
    """
    p = Path(path)
    check_document_name(p, kind, what, label)
    data = text.encode("utf-8")
    if p.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    input_files.write_output(p, data, what, error, label)  # a regular file only: a FIFO is refused, never waited on
    return p


class DuplicateKeyError(ValueError):
    """A key that appears twice in one JSON object or YAML mapping: its parsers keep the last silently."""


def unique_keys(pairs: list) -> dict:
    """``json.loads``'s ``object_pairs_hook``: the object as a dict, :class:`DuplicateKeyError` for a key given
    twice (a plan with two rows for one layer key would lose one without a word)."""
    seen: set = set()
    for key, _ in pairs:
        if key in seen:
            raise DuplicateKeyError(f"key {key!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def _loader() -> type:
    """PyYAML's ``SafeLoader`` refusing aliases (``*name``): a placement or load file needs none, and a few
    nested ones (a "billion laughs" file of 600 bytes) expand into more numbers than memory holds once the table
    is read (``yaml.composer.ComposerError`` naming the alias's line); and a key given twice in one mapping
    (``yaml.constructor.ConstructorError``), as :func:`unique_keys` for JSON."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are refused: write the values out",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):  # noqa: ANN001 - PyYAML's signature
            seen: set = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    if key_node.value in seen:
                        raise yaml.constructor.ConstructorError(None, None, f"key {key_node.value!r} appears "
                                                                f"twice in one mapping", key_node.start_mark)
                    seen.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def read_document(path, error: type[InputError], what: str) -> object:
    """Parse the document at ``path``: JSON, or YAML when :func:`document_kind` says so, gzip-compressed when its
    name ends in ``.gz`` (e.g. the dump bundled in the package, ``fdeplb/data/*.json.gz``); a regular file of at most
    :data:`~fdeplb.input_files.MAX_INPUT_BYTES`, on disk and once decompressed (:func:`fdeplb.input_files.read_input`:
    a FIFO, device or folder is refused before anything is read). Failures raise ``error`` naming the file and
    ``what`` it is; a YAML document with an alias (``*name``), and a key given twice in one object or mapping,
    too (:func:`_loader`, :func:`unique_keys`)."""
    p = Path(path)
    data = read_input(p, what, error)  # a regular file only: a FIFO or a device is refused, never waited on
    cap = input_files.MAX_INPUT_BYTES
    try:
        if p.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
                data = f.read(cap + 1)
            if len(data) > cap:
                raise error(f"{p}: {what} holds more than the {cap} bytes an input may hold once decompressed")
        text = data.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # gzip.BadGzipFile is an OSError
        raise error(f"{p}: cannot read {what}: {exc}") from None
    if document_kind(p) == "yaml":
        import yaml

        try:
            return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader that also refuses aliases
        except yaml.YAMLError as exc:
            raise error(f"{p}: not YAML ({' '.join(str(exc).split())})") from None  # one line, as every error
        except RecursionError:
            raise error(f"{p}: not YAML (nested too deep)") from None
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKeyError as exc:
        raise error(f"{p}: not JSON that reads one way ({exc}); refused") from None
    except json.JSONDecodeError as exc:
        raise error(f"{p}: not JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:  # a number over Python's digit limit, nesting too deep
        raise error(f"{p}: not JSON ({type(exc).__name__}: {str(exc)[:80]})") from None


def number_table(p, rows, key: str, error: type[InputError]) -> np.ndarray:
    """The JSON table ``rows`` (key ``key`` of document ``p``) as a numpy array, not yet checked for shape or dtype.

    Raises:
        ``error``: not a non-empty list, a boolean anywhere (``true`` is no count and no expert id), an integer
            beyond 64 bits (out of range: numpy would hold it as an object), or ragged rows.
    """
    if not isinstance(rows, list) or not rows:
        raise error(f"{p}: '{key}' must be a non-empty list of per-layer lists")
    stack = [rows]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, bool):
            raise error(f"{p}: '{key}' holds booleans (true/false); expected numbers")
        elif isinstance(item, int) and not -(1 << 63) <= item < 1 << 64:
            raise error(f"{p}: '{key}' has a value {item:.4g}, out of range")
    try:
        return np.array(rows)
    except ValueError as exc:
        raise error(f"{p}: '{key}' has ragged rows ({exc})") from None
