"""The block store's disk tier: blocks written to a bounded directory, so a decode
agent's restart (a deploy, a crash, a reboot) does not put every conversation back
to cold.

One file per block (disagg_agents.prefix.blockfile: its format, MAC and careful
reads), named by its tenant's tag and a hash of the model's fingerprint and the
block's chained key (which already mixes in the namespace and the tenant's salt):
another model, producer or tenant never finds it. The directory is ours alone
(0700, files 0600). A file is written to a temporary name and renamed into place (a
reader never sees half a block); a file that is not sound (altered, swapped, not a
regular file, too big) is dropped with a log line and counts as a miss, never as
K/V. The directory is held to its budget least recently used first (file mtimes
carry the order across restarts), one tenant's blocks to its share of it while
another's are there too (as in the memory tier); a full budget evicts, it never
fails a request. Writes happen on a thread of their own, from a bounded queue (a
full queue drops the write): a request never waits for the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from disagg_agents.prefix import blockfile
from disagg_agents.prefix.blockfile import BadBlock, block_name, tenant_tag
from disagg_agents.prefix.store import TENANT_SHARE, Block, prom_series

log = logging.getLogger("disagg.prefix")

QUEUE_MAX = 4096  # blocks waiting to be written; more are dropped
DEFAULT_MAX_FILE = 64 << 20  # a block file's bound where the model's is not known
SCAN_LOG_MAX = 5  # files a start's scan names in the log; more are counted


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """The model's fingerprint (architecture, layers, dtype, weights) as one digest."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class DiskTier:
    """Block files in `root`, at most `max_bytes` of them, for one model (`fp`).
    `secret`: key material for the files' MAC (the cluster token; None: a key kept
    in the directory); `max_file`: the largest file a block can be."""

    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        fp: str,
        secret: bytes | None = None,
        max_file: int = DEFAULT_MAX_FILE,
    ) -> None:
        self.root = Path(root)
        blockfile.own_dir(self.root)
        self.held = blockfile.lock_dir(self.root)  # two agents on one directory would clash
        self.mac = blockfile.mac_key(secret or blockfile.dir_secret(self.root))
        self.fp = fp
        self.max_bytes = max(0, int(max_bytes))
        self.max_file = max_file
        self.tenant_share = TENANT_SHARE
        self.lock = threading.Lock()
        self.files: OrderedDict[str, int] = OrderedDict()  # name -> size, LRU first
        self.bytes = 0
        self.tenant_bytes: dict[str, int] = {}  # per tenant tag (salted blocks only)
        self.reads = self.hits = self.hit_tokens = 0
        self.writes = self.written_bytes = self.dropped = self.share_drops = 0
        self.corrupt = self.evictions = 0
        self._scan()
        self.todo: queue.Queue[tuple[bytes, Block, str] | None] = queue.Queue(QUEUE_MAX)
        self.writer = threading.Thread(target=self._write_loop, daemon=True, name="prefix-disk")
        self.writer.start()

    def _scan(self) -> None:
        """The files a run before this one left, oldest use first. Stray temporary
        files (a write cut short) go; so does anything that cannot be a block."""
        found: list[tuple[float, str, int]] = []
        removed = 0
        with os.scandir(self.root) as entries:
            for e in entries:
                if e.name.startswith(".") and e.name.endswith(".tmp"):
                    self._unlink(e.name)
                elif e.name.endswith(blockfile.SUFFIX):
                    why = self._unfit(e)
                    if why:
                        removed += 1
                        if removed <= SCAN_LOG_MAX:  # an older release's files: a few lines
                            log.warning("prefix disk: %s %s: removed", e.name[:80], why)
                        self._unlink(e.name)
                        continue
                    st = e.stat(follow_symlinks=False)
                    found.append((st.st_mtime, e.name, st.st_size))
        if removed > SCAN_LOG_MAX:
            log.warning("prefix disk: %d files in %s were no blocks: removed", removed, self.root)
        self.corrupt += removed
        with self.lock:
            for _, name, size in sorted(found):
                self._index(name, size)
            self._make_room(0)

    def _unfit(self, e: os.DirEntry[str]) -> str:
        """Why a directory entry is no block file ("" if it may be one)."""
        if not blockfile.NAME.match(e.name):
            return "is not named as a block"
        if not e.is_file(follow_symlinks=False):
            return "is not a regular file"
        size = e.stat(follow_symlinks=False).st_size
        if size > self.max_file:
            return f"is {size} bytes, more than a block's {self.max_file}"
        return ""

    def _unlink(self, name: str) -> None:
        try:
            (self.root / name).unlink(missing_ok=True)
        except OSError as e:
            log.warning("prefix disk: cannot remove %s: %s", name[:80], e.strerror)

    def _index(self, name: str, size: int) -> None:
        self.files[name] = size
        self.bytes += size
        tag = name.split("-", 1)[0]
        if tag != blockfile.UNSALTED:
            self.tenant_bytes[tag] = self.tenant_bytes.get(tag, 0) + size

    def name(self, key: bytes, tenant: str | None = None) -> str:
        return block_name(self.fp, key, tenant_tag(tenant))

    # -- writes (the writer thread) ---------------------------------------------

    def put(self, key: bytes, block: Block, tenant: str | None = None) -> None:
        """Write `block` (of the tenant whose cache salt is `tenant`) later, on the
        writer thread; never blocks."""
        if not self.max_bytes:
            return
        with self.lock:
            if self.name(key, tenant) in self.files:
                return
        try:
            self.todo.put_nowait((key, block, tenant_tag(tenant)))
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

    def _write(self, key: bytes, block: Block, tag: str) -> None:
        name = block_name(self.fp, key, tag)
        data = blockfile.encode(self.fp, key, tag, block, self.mac)
        with self.lock:
            if name in self.files or len(data) > min(self.max_bytes, self.max_file):
                return
            if not self._within_share(tag, len(data)):
                self.share_drops += 1
                return
            self._make_room(len(data))
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        blockfile.write_new(tmp, data)
        os.replace(tmp, self.root / name)  # atomic: a reader sees all of it or nothing
        with self.lock:
            if name not in self.files:
                self._index(name, len(data))
            self.writes += 1
            self.written_bytes += len(data)
            self._make_room(0)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is written, at most `timeout_s` (None: no
        limit); False if some are still waiting."""
        if timeout_s is None:
            self.todo.join()
            return True
        deadline = time.monotonic() + timeout_s
        while self.todo.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.todo.unfinished_tasks

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for up to `timeout_s`), stop the writer, and let the
        directory go (a restart's agent takes it)."""
        if self.held < 0:
            return
        if not self.flush(timeout_s):
            log.warning("prefix disk: %d block writes left undone at exit", self.todo.qsize())
        with contextlib.suppress(queue.Full):
            self.todo.put_nowait(None)
        self.writer.join(timeout_s)
        os.close(self.held)
        self.held = -1

    # -- reads (request threads) ------------------------------------------------

    def get(self, key: bytes, tenant: str | None = None) -> Block | None:
        """The block stored under `key` for `tenant`, or None: not there, or not
        sound (then its file goes, with a log line)."""
        tag = tenant_tag(tenant)
        name = block_name(self.fp, key, tag)
        with self.lock:
            size = self.files.get(name)
            if size is None:
                return None
            self.files.move_to_end(name)
            self.reads += 1
        path = self.root / name
        try:
            data = blockfile.read_exactly(path, size, self.max_file)
            block = blockfile.decode(self.fp, key, tag, data, self.mac)
            os.utime(path, follow_symlinks=False)  # its use, for the order after a restart
        except (OSError, BadBlock, ValueError, KeyError, TypeError) as e:
            log.warning("prefix disk: block %s is unusable (%s): dropped", name, e)
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
            tag = name.split("-", 1)[0]
            left = self.tenant_bytes.get(tag, 0) - size
            if left > 0:
                self.tenant_bytes[tag] = left
            else:
                self.tenant_bytes.pop(tag, None)
        self._unlink(name)

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used files until `nbytes` more fit (under the lock)."""
        while self.files and self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self.files)))
            self.evictions += 1

    def _within_share(self, tag: str, nbytes: int) -> bool:
        """Under the lock: room for `nbytes` more of tenant `tag`'s blocks within its
        share, made by evicting its own least recently used files (never another
        tenant's); no limit for unsalted blocks or a tenant alone on the disk."""
        if tag == blockfile.UNSALTED or not set(self.tenant_bytes) - {tag}:
            return True
        cap = int(self.max_bytes * self.tenant_share)
        if nbytes > cap:
            return False
        prefix = tag + "-"
        while self.tenant_bytes.get(tag, 0) + nbytes > cap:
            victim = next((n for n in self.files if n.startswith(prefix)), None)
            if victim is None:
                return False
            self._drop(victim)
            self.evictions += 1
        return True

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
                "tenants": len(self.tenant_bytes),
                "reads": self.reads,
                "hits": self.hits,
                "cached_tokens": self.hit_tokens,
                "writes": self.writes,
                "written_bytes": self.written_bytes,
                "dropped_writes": self.dropped,
                "share_drops": self.share_drops,
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
