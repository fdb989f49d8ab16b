"""What the CLI's tests share: a command run against a store's cluster (:func:`cli`) and the arguments of a small
``init-cluster`` with a synthetic checkpoint (:func:`init_args`)."""

from __future__ import annotations

from fdeplb.store import Store
from tests.helpers import run_cli


def cli(capsys, store: Store, *argv: str):
    return run_cli(capsys, *argv[:2], "--redis-url", store.url, "--cluster", store.cluster, *argv[2:])


def init_args(store: Store, tmp_path, *extra: str) -> list[str]:
    from fdeplb.weights import write_synthetic_checkpoint

    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        write_synthetic_checkpoint(ckpt, 1, 4, hidden=4, intermediate=4)
    return ["init-cluster", "--redis-url", store.url, "--cluster", store.cluster, "--num-layers", "1",
            "--num-logical-experts", "4", "--num-redundant-experts", "2", "--ep-size", "3", "--checkpoint",
            str(ckpt), *extra]
