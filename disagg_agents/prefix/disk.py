"""The block store's disk tier: blocks written to a bounded directory, so a decode
agent's restart (a deploy, a crash, a reboot) does not put every conversation back
to cold.

One file per block, named by a hash of the model's fingerprint and the block's
chained key (which already mixes in the namespace and the tenant's salt): another
model, producer or tenant never finds it. A file is written to a temporary name and
renamed into place (a reader never sees half a block), and carries its fingerprint,
key and a checksum of its bytes: a corrupt, truncated or foreign file is deleted and
counts as a miss, never as K/V. The directory is held to its budget least recently
used first (file mtimes carry the order across restarts); a full budget evicts, it
never fails a request. Writes happen on a thread of their own, from a bounded queue
(a full queue drops the write): a request never waits for the disk.

Framework-free: blocks are numpy arrays (the decode agent's; bf16 as uint16 words).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from disagg_agents.prefix.store import Block, prom_series

log = logging.getLogger("disagg.prefix")

MAGIC = b"DISAGGKV1\n"
SUFFIX = ".kv"
QUEUE_MAX = 4096  # blocks waiting to be written; more are dropped
HEADER_MAX = 1 << 20


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """The model's fingerprint (architecture, layers, dtype, weights) as one digest."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def encode_block(fp: str, key: bytes, block: Block) -> bytes:
    """A block file's bytes: magic, header length, JSON header, then each kept
    layer's keys and values, C order."""
    layers: list[Any] = []
    parts: list[bytes] = []
    for pair in block.layers:
        if pair is None:
            layers.append(None)
            continue
        k, v = np.ascontiguousarray(pair[0]), np.ascontiguousarray(pair[1])
        layers.append([k.dtype.str, list(k.shape), v.dtype.str, list(v.shape)])
        parts += [k.tobytes(), v.tobytes()]
    payload = b"".join(parts)
    head = {
        "fp": fp,
        "key": key.hex(),
        "layers": layers,
        "sum": hashlib.blake2b(payload, digest_size=16).hexdigest(),
    }
    raw = json.dumps(head).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + payload


def decode_block(fp: str, key: bytes, data: bytes) -> Block:
    """A block back from its file's bytes; ValueError if anything is off."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise ValueError("not a block file")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if n > HEADER_MAX or start + n > len(data):
        raise ValueError("bad header length")
    head = json.loads(data[start : start + n])
    if head.get("fp") != fp or head.get("key") != key.hex():
        raise ValueError("another model's or another prompt's block")
    payload = memoryview(data)[start + n :]
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != head.get("sum"):
        raise ValueError("checksum mismatch")
    at, size = 0, 0
    layers: list[tuple[np.ndarray, np.ndarray] | None] = []
    for entry in head["layers"]:
        if entry is None:
            layers.append(None)
            continue
        kd, ks, vd, vs = entry
        arrays = []
        for dt, shape in ((kd, ks), (vd, vs)):
            count = int(np.prod(shape))
            a = np.frombuffer(payload, np.dtype(dt), count, at).reshape(shape)
            at += a.nbytes
            arrays.append(a)
        size += arrays[0].nbytes + arrays[1].nbytes
        layers.append((arrays[0], arrays[1]))
    if at != len(payload):
        raise ValueError("payload size mismatch")
    return Block(tuple(layers), size)


def block_file(fp: str, key: bytes) -> str:
    """A block's file name: the model's fingerprint digest and the block's chained key."""
    return hashlib.blake2b(fp.encode() + key, digest_size=20).hexdigest() + SUFFIX


class DiskTier:
    """Block files in `root`, at most `max_bytes` of them, for one model (`fp`)."""

    def __init__(self, root: str | Path, max_bytes: int, fp: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fp = fp
        self.max_bytes = max(0, int(max_bytes))
        self.lock = threading.Lock()
        self.files: OrderedDict[str, int] = OrderedDict()  # name -> size, LRU first
        self.bytes = 0
        self.reads = self.hits = self.hit_tokens = 0
        self.writes = self.written_bytes = self.dropped = 0
        self.corrupt = self.evictions = 0
        self._scan()
        self.todo: queue.Queue[tuple[bytes, Block] | None] = queue.Queue(QUEUE_MAX)
        self.writer = threading.Thread(target=self._write_loop, daemon=True, name="prefix-disk")
        self.writer.start()

    def _scan(self) -> None:
        """The files a run before this one left, oldest use first; stray temporary
        files (a write cut short) go."""
        found: list[tuple[float, str, int]] = []
        for p in self.root.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
            elif p.suffix == SUFFIX:
                st = p.stat()
                found.append((st.st_mtime, p.name, st.st_size))
        for _, name, size in sorted(found):
            self.files[name] = size
            self.bytes += size
        with self.lock:
            self._make_room(0)

    def name(self, key: bytes) -> str:
        return block_file(self.fp, key)

    # -- writes (the writer thread) ---------------------------------------------

    def put(self, key: bytes, block: Block) -> None:
        """Write `block` later, on the writer thread; never blocks."""
        if not self.max_bytes:
            return
        with self.lock:
            if self.name(key) in self.files:
                return
        try:
            self.todo.put_nowait((key, block))
        except queue.Full:
            with self.lock:
                self.dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self.todo.get()
            if item is None:
                return
            try:
                self._write(*item)
            except Exception:  # a full or broken disk must not stop the agent
                log.exception("writing a prefix block to disk failed")
            finally:
                self.todo.task_done()

    def _write(self, key: bytes, block: Block) -> None:
        name = self.name(key)
        data = encode_block(self.fp, key, block)
        with self.lock:
            if name in self.files or len(data) > self.max_bytes:
                return
            self._make_room(len(data))
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.root / name)  # atomic: a reader sees all of it or nothing
        with self.lock:
            if name not in self.files:
                self.files[name] = len(data)
                self.bytes += len(data)
            self.writes += 1
            self.written_bytes += len(data)
            self._make_room(0)

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self.todo.join()

    # -- reads (request threads) ------------------------------------------------

    def get(self, key: bytes) -> Block | None:
        """The block stored under `key`, or None: not there, or not sound (then its
        file goes)."""
        name = self.name(key)
        with self.lock:
            if name not in self.files:
                return None
            self.files.move_to_end(name)
            self.reads += 1
        path = self.root / name
        try:
            block = decode_block(self.fp, key, path.read_bytes())
            os.utime(path)  # its use, for the order after a restart
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("prefix block %s on disk is unusable (%s): dropped", name, e)
            with self.lock:
                self.corrupt += 1
                self._drop(name)
            return None
        with self.lock:
            self.hits += 1
        return block

    def count_hit(self, tokens: int) -> None:
        with self.lock:
            self.hit_tokens += tokens

    # -- the budget -------------------------------------------------------------

    def _drop(self, name: str) -> None:
        size = self.files.pop(name, None)
        if size is not None:
            self.bytes -= size
        (self.root / name).unlink(missing_ok=True)

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used files until `nbytes` more fit (under the lock)."""
        while self.files and self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self.files)))
            self.evictions += 1

    def set_budget(self, max_bytes: int) -> None:
        """A new budget, live: 0 empties the directory and turns the tier off."""
        with self.lock:
            self.max_bytes = max(0, int(max_bytes))
            self._make_room(0)

    def snapshot(self) -> dict[str, Any]:
        """For /status."""
        with self.lock:
            return {
                "dir": str(self.root),
                "max_bytes": self.max_bytes,
                "bytes": self.bytes,
                "blocks": len(self.files),
                "reads": self.reads,
                "hits": self.hits,
                "cached_tokens": self.hit_tokens,
                "writes": self.writes,
                "written_bytes": self.written_bytes,
                "dropped_writes": self.dropped,
                "queued_writes": self.todo.qsize(),
                "corrupt": self.corrupt,
                "evictions": self.evictions,
            }

    def prometheus(self, role: str) -> str:
        s = self.snapshot()
        return prom_series(
            "disagg_prefix_disk",
            role,
            [
                ("hits_total", "counter", s["hits"]),
                ("cached_tokens_total", "counter", s["cached_tokens"]),
                ("writes_total", "counter", s["writes"]),
                ("corrupt_total", "counter", s["corrupt"]),
                ("evictions_total", "counter", s["evictions"]),
                ("bytes", "gauge", s["bytes"]),
                ("max_bytes", "gauge", s["max_bytes"]),
            ],
        )
