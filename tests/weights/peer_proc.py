"""A peer server in a process of its own, for the transport tests (``python -m tests.weights.peer_proc SECRET
MODE``): rank 1 of :data:`OLD` as a numpy backend; MODE ``ok`` serves its live slots, ``wrong`` flips one byte of
every expert it sends. Prints ``ADDR host:port`` once it listens, serves until its stdin closes."""

from __future__ import annotations

import sys

import numpy as np

from fdeplb.testing import NumpyWeights
from fdeplb.weights.peer import PeerServer, peer_authkey

#: the placement the peers hold live: 2 layers, 8 logical experts, 12 slots over 3 ranks
OLD = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3],
                [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4]], dtype=np.int64)
#: the placement rank 0 moves to: its new experts are all held live by ranks 1 and 2
NEW = np.array([[4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3],
                [3, 2, 1, 0, 7, 6, 5, 4, 7, 6, 5, 4]], dtype=np.int64)
EP_SIZE = 3
CLUSTER = "peer-test"


class WrongBytes(NumpyWeights):
    """A peer whose copies are corrupted after its checksum was taken (one byte flipped)."""

    def serve_expert(self, layer, expert, placement):
        parts, checksum = super().serve_expert(layer, expert, placement)
        data = bytearray(parts[0][1])
        data[0] ^= 0xFF
        return [(parts[0][0], bytes(data))], checksum


def main() -> None:
    secret, mode = sys.argv[1], sys.argv[2]
    backend = (WrongBytes if mode == "wrong" else NumpyWeights)(OLD, 1, EP_SIZE)
    server = PeerServer(backend, peer_authkey(secret, CLUSTER), timeout_s=10)
    print("ADDR", server.address, flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    main()
