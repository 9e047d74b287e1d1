"""known_hosts read and written the way OpenSSH does, for paramiko's host key check.

paramiko's own parser raises on a marker line (`@cert-authority`, `@revoked`), so one
such line broke every connection; it reads one file only and writes names in clear.
Here: every file OpenSSH would read (the inventory's known_hosts, ssh_config's
UserKnownHostsFile, GlobalKnownHostsFile or else the system files), hashed names and
`*`/`?`/`!` patterns matched, `@revoked` keys never accepted, `@cert-authority` lines
skipped (we do not use host certificates), unreadable lines skipped as ssh does.
New keys are appended to the inventory's known_hosts hashed, as `HashKnownHosts yes` writes.
"""

from __future__ import annotations

import base64
import hmac
import re
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

# OpenSSH's GlobalKnownHostsFile when ssh_config sets none.
SYSTEM_FILES = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
_append_lock = threading.Lock()


@dataclass(frozen=True)
class Entry:
    patterns: tuple[str, ...]  # as written: names, `[host]:port`, `|1|salt|hash`, `*.lan`, `!x`
    key: paramiko.PKey
    path: str  # the file it came from, for error messages


@dataclass
class KnownHosts:
    entries: list[Entry] = field(default_factory=list)
    revoked: list[Entry] = field(default_factory=list)

    def lookup(self, name: str) -> list[Entry]:
        """Entries for `name` (`host`, or `[host]:port` off port 22), revoked keys left out."""
        found = [e for e in self.entries if matches(e.patterns, name)]
        return [e for e in found if self.revoked_key(e.key) is None]

    def revoked_key(self, key: paramiko.PKey) -> Entry | None:
        # Whatever host the line names: a revoked key is never to be accepted.
        return next((e for e in self.revoked if e.key == key), None)

    def add_to(self, keys: paramiko.HostKeys, name: str) -> None:
        """Put the keys known for `name` where paramiko's SSHClient checks them."""
        types: set[str] = set()
        for e in self.lookup(name):
            if e.key.get_name() not in types:  # the first key of each type, like ssh
                types.add(e.key.get_name())
                keys.add(name, e.key.get_name(), e.key)


def _glob(pattern: str, name: str) -> bool:
    # Not fnmatch: `[host]:port` is literal here, not a character class.
    rx = re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".")
    return re.fullmatch(rx, name) is not None


def _hashed_match(hashed: str, name: str) -> bool:
    try:
        return hmac.compare_digest(paramiko.HostKeys.hash_host(name, hashed), hashed)
    except Exception:  # a malformed salt (paramiko asserts 20 bytes): no match, never a crash
        return False


def matches(patterns: tuple[str, ...], name: str) -> bool:
    """OpenSSH's known_hosts name match: hashed, exact or glob; any `!pattern` vetoes."""
    name = name.lower()
    hit = False
    for p in patterns:
        if p.startswith("|1|"):
            hit = hit or _hashed_match(p, name)
        elif p.startswith("!"):
            if _glob(p[1:].lower(), name):
                return False
        else:
            hit = hit or _glob(p.lower(), name)
    return hit


def _entry(line: str, path: str) -> Entry | None:
    fields = line.split()
    if len(fields) < 3:
        return None
    try:
        key = paramiko.PKey.from_type_string(fields[1], base64.b64decode(fields[2]))
    except Exception:
        return None  # malformed base64 or a key type paramiko lacks: ssh skips such lines too
    return Entry(tuple(fields[0].split(",")), key, path)


def parse(text: str, path: str = "") -> KnownHosts:
    """One known_hosts file's text; lines it cannot use are skipped, never fatal."""
    known = KnownHosts()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        marker = ""
        if line.startswith("@"):
            marker, _, line = line.partition(" ")
            line = line.strip()
        entry = _entry(line, path)
        if entry is None:
            continue
        if marker == "@revoked":
            known.revoked.append(entry)
        elif not marker:
            known.entries.append(entry)
        # @cert-authority (and markers yet to come): host certificates are not used here.
    return known


def load(paths: list[Path]) -> KnownHosts:
    """All of `paths` that exist, in order; an unreadable file counts as empty."""
    known = KnownHosts()
    for p in paths:
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        one = parse(text, str(p))
        known.entries += one.entries
        known.revoked += one.revoked
    return known


def _config_files(value: str | None, home: Path) -> list[Path] | None:
    """An ssh_config *KnownHostsFile value as paths; None when unset; `none` is no file."""
    if value is None:
        return None
    out = []
    for word in shlex.split(value):
        if word.lower() == "none":
            continue
        word = word.replace("%d", str(home)).replace("%%", "%")
        out.append(Path(word).expanduser())
    return out


def files(user_file: Path, entry: dict[str, Any]) -> list[Path]:
    """Every known_hosts file to read for a host whose ssh_config entry is `entry`:
    the inventory's file, then UserKnownHostsFile, then GlobalKnownHostsFile (else
    the system files)."""
    home = Path.home()
    user = _config_files(entry.get("userknownhostsfile"), home) or []
    system = _config_files(entry.get("globalknownhostsfile"), home)
    paths = [user_file, *user, *(system if system is not None else map(Path, SYSTEM_FILES))]
    return list(dict.fromkeys(paths))


def hashed_line(name: str, key: paramiko.PKey) -> str:
    """`|1|base64(salt)|base64(HMAC-SHA1(salt, name)) TYPE KEY`, as OpenSSH hashes."""
    return f"{paramiko.HostKeys.hash_host(name.lower())} {key.get_name()} {key.get_base64()}\n"


def append(path: Path, name: str, key: paramiko.PKey) -> None:
    """Remember `key` for `name` in `path`, hashed, unless it is there already
    (another thread, a jump through this host, may have just added it)."""
    with _append_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        if any(e.key == key for e in load([path]).lookup(name)):
            return
        with open(path, "a") as f:
            f.write(hashed_line(name, key))
