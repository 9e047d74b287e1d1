"""One block of the disk tier as a file: its bytes, its name, and reading it back
without trusting the directory.

A file is: magic, header length, JSON header (the model's fingerprint digest, the
block's chained key, its tenant's tag, each layer's dtypes and shapes), the K/V
payload, then a keyed MAC over everything before it. The MAC's key comes from the
cluster token (`mac_key`), so a block swapped in from another prompt, a header
rewritten to another key, or bytes anyone without the token wrote, never pass as
K/V. A file is opened without following links or blocking (a FIFO), must be a
regular file of ours, and its size is checked before a byte is read: a huge or
sparse file costs nothing.

Framework-free: blocks are numpy arrays (bf16 as uint16 words).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

from disagg_agents.prefix.store import Block

MAGIC = b"DISAGGKV2\n"
SUFFIX = ".kv"
HEADER_MAX = 64 << 10
MAC_BYTES = 32
UNSALTED = "0"  # the tenant tag of blocks keyed without a cache salt
SECRET_FILE = ".secret"  # the directory's own key material, for agents without a token
LOCK_FILE = ".lock"  # held by the one agent that uses the directory
# `<tenant tag>-<hash of fingerprint and key>.kv`: the tag lets a restart count each
# tenant's share of the budget without opening a file.
NAME = re.compile(r"^(0|[0-9a-f]{12})-[0-9a-f]{40}\.kv$")
OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class BadBlock(ValueError):
    """A block file that is not ours, not whole, or not this block's."""


def mac_key(secret: bytes) -> bytes:
    """The disk tier's MAC key from key material the operator keeps (the cluster
    token): the same after every restart, never the token itself."""
    return hmac.new(secret, b"disagg prefix disk blocks", hashlib.sha256).digest()


def tenant_tag(salt: str | None) -> str:
    """A short name for a tenant's cache salt (the salt itself stays out of names)."""
    if salt is None:
        return UNSALTED
    return hashlib.blake2b(salt.encode(), digest_size=6).hexdigest()


def block_name(fp: str, key: bytes, tag: str) -> str:
    """A block's file name: its tenant's tag, then a hash of the model's fingerprint
    digest and the block's chained key."""
    return f"{tag}-{hashlib.blake2b(fp.encode() + key, digest_size=20).hexdigest()}{SUFFIX}"


def max_file_bytes(fingerprint: dict[str, Any], block_tokens: int) -> int:
    """The largest file one block of this model can be (every layer kept, 4 bytes a
    value): anything bigger is not a block and is never read."""
    layers = int(fingerprint.get("num_layers") or len(fingerprint.get("layers") or []) or 1)
    heads = int(fingerprint.get("num_kv_heads") or 1)
    head_dim = int(fingerprint.get("head_dim") or 1)
    payload = layers * 2 * heads * block_tokens * head_dim * 4
    return len(MAGIC) + 4 + HEADER_MAX + payload + MAC_BYTES


def encode(fp: str, key: bytes, tag: str, block: Block, mac: bytes) -> bytes:
    """A block file's bytes: magic, header length, header, payload, MAC."""
    layers: list[Any] = []
    parts: list[bytes] = []
    for pair in block.layers:
        if pair is None:
            layers.append(None)
            continue
        k, v = np.ascontiguousarray(pair[0]), np.ascontiguousarray(pair[1])
        layers.append([k.dtype.str, list(k.shape), v.dtype.str, list(v.shape)])
        parts += [k.tobytes(), v.tobytes()]
    raw = json.dumps({"fp": fp, "key": key.hex(), "tenant": tag, "layers": layers}).encode()
    body = b"".join([MAGIC, struct.pack("<I", len(raw)), raw, *parts])
    return body + hashlib.blake2b(body, key=mac, digest_size=MAC_BYTES).digest()


def decode(fp: str, key: bytes, tag: str, data: bytes | bytearray, mac: bytes) -> Block:
    """A block back from its file's bytes; BadBlock if anything is off. The MAC is
    checked before the header is parsed."""
    start = len(MAGIC) + 4
    if len(data) < start + MAC_BYTES or not data.startswith(MAGIC):
        raise BadBlock("not a block file")
    view = memoryview(data)
    body, tail = view[: len(data) - MAC_BYTES], view[len(data) - MAC_BYTES :]
    want = hashlib.blake2b(body, key=mac, digest_size=MAC_BYTES).digest()
    if not hmac.compare_digest(want, bytes(tail)):
        raise BadBlock("MAC mismatch (written without our key, or altered)")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    if n > HEADER_MAX or start + n > len(body):
        raise BadBlock("bad header length")
    head = json.loads(bytes(body[start : start + n]))
    if head.get("fp") != fp or head.get("key") != key.hex() or head.get("tenant") != tag:
        raise BadBlock("another model's, prompt's or tenant's block")
    return _layers(head["layers"], body[start + n :])


def _layers(entries: list[Any], payload: memoryview) -> Block:
    at, size = 0, 0
    layers: list[tuple[np.ndarray, np.ndarray] | None] = []
    for entry in entries:
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
        raise BadBlock("payload size mismatch")
    return Block(tuple(layers), size)


def read_exactly(path: Path, size: int, most: int) -> bytearray:
    """A file's `size` bytes: a regular file of ours, not a link, of exactly that
    size and at most `most` (checked before reading); BadBlock or OSError if not."""
    fd = os.open(path, OPEN_READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadBlock("not a regular file")
        if st.st_uid != os.getuid():
            raise BadBlock(f"owned by uid {st.st_uid}, not us")
        if st.st_size != size or size > most:
            raise BadBlock(f"{st.st_size} bytes where a block of {size} (at most {most}) was")
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n <= 0:
                raise BadBlock("shorter than its size")
            got += n
        return buf
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes) -> None:
    """A new file, ours alone (0600), never through a link or over another file."""
    fd = os.open(path, OPEN_NEW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def own_dir(root: Path) -> None:
    """`root` exists, is a directory of ours, and nobody else may enter it (0700);
    ValueError if it cannot be made so."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = root.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{root} is not a directory")
    if st.st_uid != os.getuid():
        raise ValueError(f"{root} belongs to uid {st.st_uid}, not to us")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(root, 0o700)


def dir_secret(root: Path) -> bytes:
    """Key material kept in the directory itself (0600), for an agent run without a
    cluster token: made once, the same after a restart."""
    path = root / SECRET_FILE
    with contextlib.suppress(FileExistsError):
        write_new(path, secrets.token_bytes(32))
    data = read_exactly(path, os.lstat(path).st_size, 4096)
    if len(data) < 32:
        raise ValueError(f"{path} holds {len(data)} bytes, not a key")
    return bytes(data)


def lock_dir(root: Path) -> int:
    """Hold `root` for this process alone (an open descriptor; the lock goes with
    it, a crash included); ValueError if another agent holds it."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{root} is in use by another agent") from None
    return fd
