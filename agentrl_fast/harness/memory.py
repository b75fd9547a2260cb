"""The agent's memory: a namespaced key-value store on SQLite, reached by the model through tools.

Memory is part of the environment (docs/design.md, "The harness"): the model reads and writes it only
with the five tools of :meth:`MemoryNamespace.tools`; tests and the trainer use the plain methods.

- Storage: one table ``memory(namespace, key, value)`` keyed by ``(namespace, key)``, values are
  text. A file store runs in WAL mode and commits every write, so entries survive a process exit
  or kill; ``MemoryStore()`` (``":memory:"``) lives as long as the object.
- Threads: tools run in worker threads, so the one connection is opened with
  ``check_same_thread=False`` and every operation holds the store's lock.
- Isolation: a :class:`MemoryNamespace` (one per rollout id, or per agent id to share memory
  across episodes; the caller picks the name) binds its name as a parameter in every statement.
  The namespace is never a tool argument, and nothing the model writes becomes SQL or code.
- Determinism: no clock anywhere. ``list`` orders keys by code point; ``search`` splits the query
  on whitespace and matches a word case-insensitively (``str.casefold``) anywhere in a key or
  value (``LIKE`` with ``%``, ``_`` and ``\\`` escaped), ranking by the number of distinct words
  matched (most first), then key.
- Limits (``max_key_chars``, ``max_value_chars``, ``max_entries_per_namespace``): breaking one
  raises ``ValueError``; inside a tool the registry turns it into an error ``<tool_response>``.
- Checkpoints: :meth:`MemoryStore.snapshot` is the whole database (all namespaces) as bytes;
  :meth:`MemoryStore.restore` replaces the store's content with one (a file store's file too).

Tool outputs (keys and values quoted as JSON strings, so any text stays on one line):
``memory_write`` -> ``stored "k"``; ``memory_read`` -> the value itself, or ``no entry "k"``;
``memory_delete`` -> ``deleted "k"`` or ``no entry "k"``; ``memory_search`` -> ``no matches for
"q"`` or ``2 matches, best first:`` then one ``"key": "value"`` line per match;
``memory_list`` -> ``no keys`` / ``no keys starting with "p"``, or ``3 keys: "a", "b", "c"``
(at most 50; ``first 50 keys (more exist; pass a longer prefix): ...`` past that).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from contextlib import contextmanager


from agentrl_fast.harness.tools import Tool, tool

__all__ = ["MemoryNamespace", "MemoryStore"]

LIST_TOOL_LIMIT = 50  # keys ``memory_list`` shows
_SCHEMA = ("CREATE TABLE IF NOT EXISTS memory (namespace TEXT NOT NULL, key TEXT NOT NULL, "
           "value TEXT NOT NULL, PRIMARY KEY (namespace, key)) WITHOUT ROWID")
# One row per entry matching at least one word; COUNT(*) is the number of distinct words matched.
_SEARCH = r"""SELECT m.key, m.value FROM memory AS m JOIN json_each(?) AS w
  ON casefold(m.key) LIKE w.value ESCAPE '\' OR casefold(m.value) LIKE w.value ESCAPE '\'
  WHERE m.namespace = ? GROUP BY m.key ORDER BY COUNT(*) DESC, m.key LIMIT ?"""


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _like_pattern(word: str) -> str:
    """``%word%`` with LIKE's metacharacters (and the escape character itself) escaped."""
    return "%" + word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _sqlite_header_legacy(data: bytes) -> bytes:
    """A database image with its WAL marks (header bytes 18-19 = 2) reset to rollback mode (1):
    an in-memory database cannot open an image marked WAL."""
    if len(data) >= 20 and data[18:20] == b"\x02\x02":
        data = data[:18] + b"\x01\x01" + data[20:]
    return data


def _check_text(what: str, value, max_chars: int | None = None, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value and not empty_ok:
        raise ValueError(f"{what} must be a non-empty str; pass at least one character")
    if max_chars is not None and len(value) > max_chars:
        raise ValueError(f"{what} has {len(value)} characters, more than the limit of "
                         f"{max_chars}; shorten it")
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL character; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (it has a lone surrogate); "
                         "pass valid text") from None
    return value


def _check_int(what: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
    return value


class MemoryStore:
    """A SQLite memory shared by many namespaces; thread-safe, a context manager.

    ``path``: a file (created if missing; WAL mode) or ``":memory:"`` (the default). Limits:
    ``max_key_chars`` and ``max_value_chars`` (characters), ``max_entries_per_namespace``.
    """

    def __init__(self, path: str | os.PathLike = ":memory:", *, max_key_chars: int = 200,
                 max_value_chars: int = 4000, max_entries_per_namespace: int = 1000):
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
            raise TypeError(f"MemoryStore: path must be a str or os.PathLike naming a file, or "
                            f"':memory:', got {type(path).__name__}")
        self.path = os.fspath(path)
        if not self.path:
            raise ValueError("MemoryStore: path must be a file path or ':memory:', got ''")
        self.max_key_chars = _check_int("MemoryStore: max_key_chars", max_key_chars, 1)
        self.max_value_chars = _check_int("MemoryStore: max_value_chars", max_value_chars, 1)
        self.max_entries_per_namespace = _check_int("MemoryStore: max_entries_per_namespace",
                                                    max_entries_per_namespace, 1)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        try:
            self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            if self.path != ":memory:":
                self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(_SCHEMA)
        except sqlite3.Error as error:
            self.close()
            raise ValueError(f"MemoryStore: cannot open path {self.path!r} as a memory store "
                             f"({error}); pass a writable file path or ':memory:'") from None
        self._conn.create_function("casefold", 1, lambda s: s if s is None else s.casefold(),
                                   deterministic=True)

    def __repr__(self) -> str:
        return f"MemoryStore({self.path!r})"

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError(f"MemoryStore({self.path!r}) is closed; open a new MemoryStore")
        return self._conn

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._connection().execute(sql, params).fetchall()

    @contextmanager
    def _write(self):
        """The connection inside one committed transaction (rolled back if the body raises)."""
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def namespace(self, name: str) -> MemoryNamespace:
        """The view of the entries under ``name`` (a rollout id, or an agent id to share)."""
        return MemoryNamespace(self, name)

    def namespaces(self) -> list[str]:
        """The names of the namespaces holding at least one entry, sorted."""
        return [row[0] for row in
                self._read("SELECT DISTINCT namespace FROM memory ORDER BY namespace")]

    def snapshot(self) -> bytes:
        """The whole database (every namespace) as bytes, for :meth:`restore`."""
        with self._lock:
            copy = sqlite3.connect(":memory:")
            try:
                self._connection().backup(copy)
                data = copy.serialize()
            finally:
                copy.close()
        return _sqlite_header_legacy(bytes(data))

    def restore(self, data: bytes) -> None:
        """Replace the whole content of the store (and of its file) with a :meth:`snapshot`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"MemoryStore.restore: data must be bytes from "
                            f"MemoryStore.snapshot(), got {type(data).__name__}")
        source = sqlite3.connect(":memory:")
        try:
            try:
                source.deserialize(_sqlite_header_legacy(bytes(data)))
                check = source.execute("PRAGMA quick_check").fetchone()[0]
                source.execute("SELECT namespace, key, value FROM memory LIMIT 0")
            except sqlite3.Error as error:
                check = str(error)
            if check != "ok":
                raise ValueError(f"MemoryStore.restore: data is not a memory snapshot ({check});"
                                 " pass bytes from MemoryStore.snapshot()")
            with self._lock:
                source.backup(self._connection())
        finally:
            source.close()

    def close(self) -> None:
        """Close the connection (idempotent); later operations raise ``ValueError``."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> "MemoryStore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class MemoryNamespace:
    """The entries of one namespace of a :class:`MemoryStore`; it never sees other namespaces."""

    def __init__(self, store: MemoryStore, name: str):
        if not isinstance(store, MemoryStore):
            raise TypeError(f"MemoryNamespace: store must be a MemoryStore, "
                            f"got {type(store).__name__}")
        self.store, self.name = store, _check_text("namespace", name)

    def __repr__(self) -> str:
        return f"MemoryNamespace({self.store!r}, {self.name!r})"

    def _key(self, key) -> str:
        return _check_text("key", key, self.store.max_key_chars)

    def write(self, key: str, value: str) -> None:
        """Store ``value`` under ``key``, replacing an earlier value; committed at once."""
        key = self._key(key)
        value = _check_text("value", value, self.store.max_value_chars, empty_ok=True)
        limit = self.store.max_entries_per_namespace
        with self.store._write() as conn:
            if conn.execute("SELECT 1 FROM memory WHERE namespace = ? AND key = ?",
                            (self.name, key)).fetchone() is None:
                count = conn.execute("SELECT COUNT(*) FROM memory WHERE namespace = ?",
                                     (self.name,)).fetchone()[0]
                if count >= limit:
                    raise ValueError(f"memory is full ({count} entries, the limit is {limit}); "
                                     "delete an entry or overwrite an existing key")
            conn.execute("INSERT OR REPLACE INTO memory (namespace, key, value) VALUES (?, ?, ?)",
                         (self.name, key, value))

    def read(self, key: str) -> str | None:
        """The value under ``key``, or ``None``."""
        rows = self.store._read("SELECT value FROM memory WHERE namespace = ? AND key = ?",
                                (self.name, self._key(key)))
        return rows[0][0] if rows else None

    def delete(self, key: str) -> bool:
        """Remove ``key``; ``True`` if it existed."""
        key = self._key(key)
        with self.store._write() as conn:
            return conn.execute("DELETE FROM memory WHERE namespace = ? AND key = ?",
                                (self.name, key)).rowcount > 0

    def clear(self) -> int:
        """Remove every entry of this namespace; the number removed."""
        with self.store._write() as conn:
            return conn.execute("DELETE FROM memory WHERE namespace = ?", (self.name,)).rowcount

    def list(self, prefix: str = "", limit: int = 50) -> list[str]:
        """The first ``limit`` keys starting with ``prefix``, sorted by code point."""
        prefix = _check_text("prefix", prefix, empty_ok=True)
        limit = _check_int("limit", limit, 1)
        return [row[0] for row in self.store._read(
            "SELECT key FROM memory WHERE namespace = ? AND substr(key, 1, ?) = ? "
            "ORDER BY key LIMIT ?", (self.name, len(prefix), prefix, limit))]

    def search(self, query: str, limit: int = 5) -> list[tuple[str, str]]:
        """Up to ``limit`` ``(key, value)`` pairs matching a word of ``query`` (at most
        ``max_value_chars`` long; see the module docstring): most words matched first, then key."""
        query = _check_text("query", query, self.store.max_value_chars)
        limit = _check_int("limit", limit, 1)
        words = list(dict.fromkeys(query.casefold().split()))
        if not words:
            raise ValueError("query has no words; pass one or more words separated by spaces")
        patterns = json.dumps([_like_pattern(word) for word in words])
        return [(k, v) for k, v in self.store._read(_SEARCH, (patterns, self.name, limit))]

    def __len__(self) -> int:
        return self.store._read("SELECT COUNT(*) FROM memory WHERE namespace = ?",
                                (self.name,))[0][0]

    def tools(self) -> list[Tool]:
        """``memory_write``, ``memory_read``, ``memory_search``, ``memory_delete`` and
        ``memory_list``, bound to this namespace (outputs: see the module docstring); inline
        tools (one short SQLite statement each, run on the rollout's event-loop thread)."""
        ns = self

        @tool(inline=True)
        def memory_write(key: str, value: str) -> str:
            """Remember a text value under a key, replacing any earlier value of that key.

            Args:
                key: The name to store the value under.
                value: The text to remember.
            """
            ns.write(key, value)
            return f"stored {_quote(key)}"

        @tool(inline=True)
        def memory_read(key: str) -> str:
            """Read the value stored under a key.

            Args:
                key: The exact key to read.
            """
            value = ns.read(key)
            return f"no entry {_quote(key)}" if value is None else value

        @tool(inline=True)
        def memory_search(query: str, limit: int = 5) -> str:
            """Find entries whose key or value contains any word of the query (ignoring case).

            Entries matching the most query words come first, one "key": "value" line each.

            Args:
                query: Words to look for, separated by spaces.
                limit: The most entries to return.
            """
            if isinstance(limit, float) and limit.is_integer():  # JSON "integer" admits 5.0
                limit = int(limit)
            found = ns.search(query, limit)
            if not found:
                return f"no matches for {_quote(query)}"
            lines = [f"{_quote(k)}: {_quote(v)}" for k, v in found]
            return f"{len(found)} match{'es' if len(found) > 1 else ''}, best first:\n" + \
                "\n".join(lines)

        @tool(inline=True)
        def memory_delete(key: str) -> str:
            """Forget the entry stored under a key.

            Args:
                key: The exact key to delete.
            """
            return f"{'deleted' if ns.delete(key) else 'no entry'} {_quote(key)}"

        @tool(inline=True)
        def memory_list(prefix: str = "") -> str:
            """List the keys in memory (sorted), optionally only those starting with a prefix.

            Args:
                prefix: Only keys starting with this text; empty for all keys.
            """
            keys = ns.list(prefix, LIST_TOOL_LIMIT + 1)
            if not keys:
                return "no keys" + (f" starting with {_quote(prefix)}" if prefix else "")
            shown = ", ".join(_quote(k) for k in keys[:LIST_TOOL_LIMIT])
            if len(keys) > LIST_TOOL_LIMIT:
                return f"first {LIST_TOOL_LIMIT} keys (more exist; pass a longer prefix): {shown}"
            return f"{len(keys)} key{'s' if len(keys) > 1 else ''}: {shown}"

        return [memory_write, memory_read, memory_search, memory_delete, memory_list]
