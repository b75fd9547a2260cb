"""MemoryStore: semantics, limits through the tool registry, isolation, durability, snapshots."""

import json
import signal
import sqlite3
import subprocess
import sys
import threading

import pytest

from agentrl_fast.harness.memory import MemoryNamespace, MemoryStore
from agentrl_fast.harness.tool_calls import parse_tool_calls
from agentrl_fast.harness.tools import ToolRegistry


def calls(*items):
    """Model text holding one ``<tool_call>`` per ``(name, arguments)``."""
    return parse_tool_calls("".join(
        f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in items))


def run_tools(ns, *items):
    return ToolRegistry(ns.tools()).execute_sync(calls(*items))


def contents(ns):
    return {key: ns.read(key) for key in ns.list(limit=10_000)}


def test_write_read_overwrite_delete_clear():
    with MemoryStore() as store:
        ns = store.namespace("r1")
        assert ns.read("k") is None and len(ns) == 0
        ns.write("k", "v1")
        assert ns.read("k") == "v1"
        ns.write("k", "v2")  # overwrite: still one entry
        ns.write("empty", "")
        assert ns.read("k") == "v2" and ns.read("empty") == "" and len(ns) == 2
        assert ns.delete("k") is True and ns.delete("k") is False
        assert ns.read("k") is None and len(ns) == 1
        ns.write("text", "line 1\nline 2 ✓ 🙂")
        assert ns.read("text") == "line 1\nline 2 ✓ 🙂"
        assert ns.clear() == 2 and len(ns) == 0 and store.namespaces() == []


def test_list_sorted_with_prefix_and_limit():
    ns = MemoryStore().namespace("r1")
    for key in ["b/2", "a", "b/1", "B", "b/10", "é", "🙂x", "c%", "c_"]:
        ns.write(key, "v")
    assert ns.list() == sorted(["b/2", "a", "b/1", "B", "b/10", "é", "🙂x", "c%", "c_"])
    assert ns.list("b/") == ["b/1", "b/10", "b/2"]  # case-sensitive, by code point
    assert ns.list("b/", limit=2) == ["b/1", "b/10"]
    assert ns.list("🙂") == ["🙂x"] and ns.list("c%") == ["c%"] and ns.list("c_") == ["c_"]
    assert ns.list("%") == [] and ns.list("zzz") == []


def test_search_ranks_by_words_matched_then_key_ignoring_case():
    ns = MemoryStore().namespace("r1")
    ns.write("plan", "Buy APPLES and bananas")
    ns.write("diet", "apples only")
    ns.write("banana-note", "yellow")  # matches through its key
    ns.write("city", "Straße im Zentrum")
    ns.write("other", "nothing here")
    assert ns.search("apple BANANA") == [("plan", "Buy APPLES and bananas"),
                                         ("banana-note", "yellow"), ("diet", "apples only")]
    assert ns.search("apple banana", limit=1) == [("plan", "Buy APPLES and bananas")]
    assert ns.search("apple apple APPLE") == [("diet", "apples only"),
                                              ("plan", "Buy APPLES and bananas")]
    assert ns.search("STRASSE") == [("city", "Straße im Zentrum")]  # Unicode case folding
    assert ns.search("kiwi") == []


@pytest.mark.parametrize("query", ["%", "_", "\\", "%%", "_%_", "\\%"])
def test_search_escapes_like_metacharacters(query):
    ns = MemoryStore().namespace("r1")
    ns.write("plain", "abc")
    ns.write("word", "xyz")
    assert ns.search(query) == []
    ns.write("meta", "100% of a_b \\ c")
    assert ns.search(query) == ([("meta", "100% of a_b \\ c")]
                                if query in "100% of a_b \\ c" else [])


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        MemoryStore(3)
    with pytest.raises(ValueError, match="path must be a file path"):
        MemoryStore("")
    with pytest.raises(ValueError, match="cannot open path"):
        MemoryStore("/nonexistent-dir/x/memory.db")
    with pytest.raises(ValueError, match="max_value_chars must be >= 1"):
        MemoryStore(max_value_chars=0)
    with pytest.raises(TypeError, match="max_entries_per_namespace must be an int"):
        MemoryStore(max_entries_per_namespace=True)
    store = MemoryStore()
    with pytest.raises(ValueError, match="namespace must be a non-empty str"):
        store.namespace("")
    with pytest.raises(TypeError, match="namespace must be a str"):
        store.namespace(7)
    with pytest.raises(TypeError, match="store must be a MemoryStore"):
        MemoryNamespace("store", "r1")
    ns = store.namespace("r1")
    with pytest.raises(TypeError, match="key must be a str"):
        ns.write(1, "v")
    with pytest.raises(TypeError, match="value must be a str"):
        ns.write("k", b"v")
    with pytest.raises(ValueError, match="key contains a NUL"):
        ns.write("a\x00b", "v")
    with pytest.raises(ValueError, match="value is not valid Unicode"):
        ns.write("k", "\ud800")
    with pytest.raises(ValueError, match="query has no words"):
        ns.search("  \n ")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        ns.search("x", limit=0)
    with pytest.raises(TypeError, match="data must be bytes"):
        store.restore("not bytes")
    with pytest.raises(ValueError, match="data is not a memory snapshot"):
        store.restore(b"garbage" * 100)
    store.close()
    store.close()  # idempotent
    with pytest.raises(ValueError, match="is closed"):
        ns.read("k")


def test_limits_raise_in_python_and_overwrite_of_a_full_namespace_works():
    store = MemoryStore(max_key_chars=5, max_value_chars=10, max_entries_per_namespace=2)
    ns = store.namespace("r1")
    with pytest.raises(ValueError, match="key has 6 characters, more than the limit of 5"):
        ns.write("abcdef", "v")
    with pytest.raises(ValueError, match="value has 11 characters, more than the limit of 10"):
        ns.write("k", "x" * 11)
    ns.write("a", "1")
    ns.write("b", "2")
    with pytest.raises(ValueError, match="memory is full"):
        ns.write("c", "3")
    ns.write("a", "changed")  # overwriting needs no new entry
    store.namespace("r2").write("c", "3")  # the limit is per namespace
    assert contents(ns) == {"a": "changed", "b": "2"}


def test_tool_errors_become_responses_and_the_batch_goes_on():
    store = MemoryStore(max_key_chars=8, max_value_chars=20, max_entries_per_namespace=3)
    ns = store.namespace("r1")
    results = run_tools(ns, ("memory_write", {"key": "a", "value": "alpha beta"}),
                        ("memory_write", {"key": "toolong_key", "value": "v"}),
                        ("memory_write", {"key": "", "value": "v"}),
                        ("memory_write", {"key": "b", "value": "x" * 21}),
                        ("memory_search", {"query": "   "}),
                        ("memory_write", {"key": "b", "value": "beta"}))
    assert [r.error for r in results] == [None, "tool_exception", "tool_exception",
                                          "tool_exception", "tool_exception", None]
    assert results[0].content == 'stored "a"' and results[5].content == 'stored "b"'
    assert "key has 11 characters, more than the limit of 8" in results[1].content
    assert "key must be a non-empty str" in results[2].content
    assert "value has 21 characters, more than the limit of 20" in results[3].content
    ns.write("c", "gamma")
    results = run_tools(ns, ("memory_write", {"key": "d", "value": "delta"}),
                        ("memory_read", {"key": "a"}),
                        ("memory_read", {"key": "zz"}),
                        ("memory_search", {"query": "beta gamma", "limit": 2.0}),
                        ("memory_search", {"query": "omega"}),
                        ("memory_list", {}),
                        ("memory_list", {"prefix": "q"}),
                        ("memory_delete", {"key": "zz"}))
    assert results[0].error == "tool_exception" and "memory is full" in results[0].content
    assert [r.content for r in results[1:]] == [
        "alpha beta", 'no entry "zz"',
        '2 matches, best first:\n"a": "alpha beta"\n"b": "beta"',
        'no matches for "omega"', '3 keys: "a", "b", "c"', 'no keys starting with "q"',
        'no entry "zz"']
    results = run_tools(ns, ("memory_delete", {"key": "a"}), ("memory_list", {"prefix": "c"}))
    assert [r.content for r in results] == ['deleted "a"', '1 key: "c"']


def test_memory_list_tool_caps_its_output():
    ns = MemoryStore().namespace("r1")
    for i in range(60):
        ns.write(f"k{i:02d}", "v")
    (result,) = run_tools(ns, ("memory_list", {}))
    assert result.content.startswith('first 50 keys (more exist; pass a longer prefix): "k00"')
    assert result.content.endswith('"k49"')


def test_tool_schemas_have_no_namespace_argument():
    schemas = [t.schema["function"] for t in MemoryStore().namespace("r1").tools()]
    assert [(s["name"], s["parameters"].get("required", [])) for s in schemas] == [
        ("memory_write", ["key", "value"]), ("memory_read", ["key"]), ("memory_search", ["query"]),
        ("memory_delete", ["key"]), ("memory_list", [])]
    assert schemas[2]["parameters"]["properties"]["limit"]["type"] == "integer"
    for s in schemas:
        assert s["description"] and "namespace" not in json.dumps(s["parameters"])
        assert all(p.get("description") for p in s["parameters"]["properties"].values())
    (result,) = run_tools(MemoryStore().namespace("r1"),
                          ("memory_read", {"key": "k", "namespace": "r2"}))
    assert result.error == "unexpected_argument"


@pytest.mark.parametrize("name", ["r2", "%", "_", "r1%", "x'; DROP TABLE memory; --", "r1 OR 1=1"])
def test_namespaces_are_isolated(name):
    store = MemoryStore()
    mine, other, third = store.namespace("r1"), store.namespace(name), store.namespace("r10")
    for ns in (mine, other, third):
        ns.write("shared", f"value of {ns.name}")
    mine.write("only-mine", "secret apple")
    assert other.read("shared") == f"value of {name}" and other.read("only-mine") is None
    assert other.list() == ["shared"] and len(other) == 1
    assert other.search("apple secret value") == [("shared", f"value of {name}")]
    assert other.delete("only-mine") is False and mine.read("only-mine") == "secret apple"
    assert other.clear() == 1
    assert contents(mine) == {"shared": "value of r1", "only-mine": "secret apple"}
    assert contents(third) == {"shared": "value of r10"}
    (result,) = run_tools(other, ("memory_search", {"query": "secret apple"}))
    assert result.content == 'no matches for "secret apple"'
    assert store.namespaces() == ["r1", "r10"]


def test_file_store_is_in_wal_mode(tmp_path):
    path = tmp_path / "memory.db"
    with MemoryStore(path) as store:
        store.namespace("r1").write("k", "v")
        with sqlite3.connect(path) as other:  # another reader sees the committed write
            assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert other.execute("SELECT value FROM memory").fetchall() == [("v",)]


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_entries_survive_a_process_restart(tmp_path, ending):
    path = tmp_path / "memory.db"
    child = (
        "import os, signal, sys\n"
        "from agentrl_fast.harness.memory import MemoryStore\n"
        "store = MemoryStore(sys.argv[1])\n"
        "ns = store.namespace('agent-7')\n"
        "for i in range(3):\n"
        "    ns.write(f'k{i}', f'value {i}')\n"
        "ns.delete('k1')\n"
        "if sys.argv[2] == 'sigkill':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", child, str(path), ending], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == (-signal.SIGKILL if ending == "sigkill" else 0), done.stderr
    with MemoryStore(path) as store:
        assert store.namespaces() == ["agent-7"]
        assert contents(store.namespace("agent-7")) == {"k0": "value 0", "k2": "value 2"}


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_snapshot_restore_round_trip(tmp_path, kind):
    path = tmp_path / "memory.db" if kind == "file" else ":memory:"
    store = MemoryStore(path)
    a, b = store.namespace("a"), store.namespace("b")
    a.write("k1", "one")
    a.write("k2", "two")
    b.write("k1", "bee")
    data = store.snapshot()
    assert isinstance(data, bytes)
    a.write("k1", "changed")
    a.delete("k2")
    b.clear()
    store.namespace("c").write("new", "entry")
    store.restore(data)
    expected = {"a": {"k1": "one", "k2": "two"}, "b": {"k1": "bee"}}
    assert {n: contents(store.namespace(n)) for n in store.namespaces()} == expected
    a.write("k3", "after restore")  # the store stays writable
    a.delete("k3")
    if kind == "file":
        store.close()
        with MemoryStore(path) as reopened:  # the file's content was replaced
            assert {n: contents(reopened.namespace(n)) for n in reopened.namespaces()} == expected
            assert reopened._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for target in (MemoryStore(), MemoryStore(tmp_path / f"other-{kind}.db")):
        target.namespace("z").write("gone", "after restore")
        target.restore(data)
        assert {n: contents(target.namespace(n)) for n in target.namespaces()} == expected
        target.close()


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_concurrent_writes_lose_nothing(tmp_path, kind):
    store = MemoryStore(tmp_path / "memory.db" if kind == "file" else ":memory:")
    start = threading.Barrier(8)
    errors = []

    def writer(t):
        try:
            start.wait()
            shared, own = store.namespace("shared"), store.namespace(f"t{t}")
            for i in range(100):
                shared.write(f"t{t}-{i:03d}", str(i))
                if i % 10 == 0:
                    own.write(f"{i:03d}", str(i))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(store.namespace("shared")) == 800
    assert store.namespace("shared").read("t7-099") == "99"
    assert [len(store.namespace(f"t{t}")) for t in range(8)] == [10] * 8
    # Concurrent tool calls of one turn (the registry runs sync tools in worker threads).
    ns = store.namespace("tools")
    results = run_tools(ns, *[("memory_write", {"key": f"k{i:02d}", "value": "v"})
                              for i in range(40)])
    assert all(r.ok for r in results) and len(ns) == 40
