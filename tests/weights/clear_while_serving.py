"""A rank's weights cleared while its peer server sends one of its host slots (``python -m
tests.weights.clear_while_serving DIR``): a receiver reads the answer's header, then the slot's bytes slowly (the
server's send blocks on the full socket) while the rank clears. Host slots are sent from their own memory without a
copy, so the clear must not free that memory under the send (it did: the serving process read freed memory, a
SIGSEGV). Prints ``OK <whole frames received>`` when the clear ended, the process lived and every frame that
arrived whole holds the expert's bytes; run in a process of its own because the failure is a crash."""

from __future__ import annotations

import json
import sys
import threading
from multiprocessing.connection import Client
from pathlib import Path

import numpy as np

from fdeplb.placement.digest import routing_digest
from fdeplb.weights import _paddle, write_synthetic_checkpoint
from fdeplb.weights.backend import CheckpointBackend
from fdeplb.weights.checkpoint import CheckpointReader
from fdeplb.weights.peer import PeerServer, peer_authkey

KEY = peer_authkey("clear-while-serving", "c")


def main() -> None:
    ckpt = write_synthetic_checkpoint(Path(sys.argv[1]) / "ckpt", 1, 4, hidden=1024, intermediate=1024)  # 12 MiB
    phy2log = np.array([[0, 1, 2, 3]], np.int64)
    backend = CheckpointBackend.open({"path": str(ckpt), "preset": "ernie"}, phy2log, 1, 2, device="cpu")
    server = PeerServer(backend, KEY, timeout_s=60)
    host, _, port = server.address.rpartition(":")
    conn = Client((host, int(port)), authkey=KEY)
    conn.send_bytes(json.dumps({"placement": routing_digest(phy2log), "experts": [[0, 2]]}).encode())
    sizes = json.loads(conn.recv_bytes())["answers"][0]["sizes"]  # the server now sends the slot's 8 MiB frame
    clear = threading.Thread(target=backend.clear)
    clear.start()
    frames = []
    try:
        for _ in sizes:
            frames.append(conn.recv_bytes())
    except (EOFError, OSError):
        pass  # the clear cut the transfer: the receiver reads this expert from the checkpoint
    clear.join(120)
    assert not clear.is_alive(), "the clear did not end"
    assert backend.cleared
    want = CheckpointReader(str(ckpt)).read_expert(0, 2)
    for (suffix, _), frame in zip(sizes, frames):
        assert frame == bytes(_paddle.host_view(want[suffix])), f"{suffix}: bytes other than the expert's"
    print("OK", len(frames), flush=True)
    conn.close()
    server.close()


if __name__ == "__main__":
    main()
