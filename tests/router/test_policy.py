"""The routing policy: sessions stick, prefixes attract, load bounds the attraction."""

from __future__ import annotations

import pytest

from streamer.messages import GenerateRequest
from streamer.router.keys import MAX_KEY_CHARS, body_key, chat_key, request_key, text_key
from streamer.router.policy import NoReplica, RoutingPolicy
from streamer.router.tree import PrefixTree


def test_tree_matches_the_longest_prefix_across_split_edges() -> None:
    t = PrefixTree()
    t.insert("abcdef")
    t.insert("abcxyz")
    assert t.match("abcdefgh") == 6
    assert t.match("abcx") == 4
    assert t.match("abq") == 2
    assert t.match("zzz") == 0
    assert t.size == len("abcdef") + len("xyz")
    t.insert("abc")  # ends on an inner node: nothing new
    assert t.size == 9


def test_tree_stays_bounded_and_drops_the_least_recently_used() -> None:
    t = PrefixTree(max_chars=100)
    t.insert("a" * 40)
    t.insert("b" * 40)
    t.insert("a" * 40)  # a is now more recent than b
    t.insert("c" * 40)  # 120 > 100: prune to <= 90, b goes first
    assert t.size <= 100
    assert t.match("b" * 40) == 0
    assert t.match("a" * 40) == 40
    assert t.match("c" * 40) == 40


def test_a_shared_prefix_goes_where_it_went_before() -> None:
    p = RoutingPolicy(2)
    a, b = text_key("A" * 500 + "q1"), text_key("B" * 500 + "q1")
    ra, rb = p.route(a), p.route(b)
    assert ra != rb  # two new prefixes spread over the replicas (smaller tree, then index)
    for n in range(5):
        assert p.route(text_key("A" * 500 + f"other {n}")) == ra
        assert p.route(text_key("B" * 500 + f"other {n}")) == rb
    assert p.decisions.prefix == 10 and p.decisions.balance == 2


def test_a_short_common_head_is_not_a_hit() -> None:
    p = RoutingPolicy(2)
    p.open(p.route(text_key("You are helpful. " + "x" * 200)))
    # shares 17 characters of 217: below min_match, so the least loaded replica gets it
    assert p.route(text_key("You are helpful. " + "y" * 200)) == 1


def test_load_beyond_the_margin_overrides_the_prefix() -> None:
    p = RoutingPolicy(2, margin=2)
    key = text_key("P" * 100)
    first = p.route(key)
    for _ in range(3):
        i = p.route(key)
        assert i == first
        p.open(i)
    # first has 3 open, the other 0: 3 - 0 > 2
    assert p.route(key) == 1 - first
    assert p.max_spread <= 2
    # now both trees hold the key: of equal matches, the less loaded replica
    assert p.route(key) == 1 - first
    assert p.trees[1 - first].match(key) == len(key)


def test_sessions_stick_past_the_margin_and_move_off_an_unusable_replica() -> None:
    p = RoutingPolicy(2, margin=0)
    i = p.route(text_key("hello"), session="s1")
    for n in range(4):
        p.open(i)
        assert p.route(text_key(f"another prompt {n}"), session="s1") == i
    assert p.decisions.session == 4
    usable = [True, True]
    usable[i] = False
    j = p.route(text_key("hello"), session="s1", usable=usable)
    assert j != i and p.session_replica("s1") == j
    with pytest.raises(NoReplica):
        p.route("x", usable=[False, False])


def test_keys_of_engine_requests_and_http_bodies() -> None:
    msgs = [{"role": "system", "content": "S" * 50}, {"role": "user", "content": "hi"}]
    assert request_key(GenerateRequest(request_id="r", messages=msgs)) == chat_key(msgs)
    assert body_key("/v1/chat/completions", {"messages": msgs}) == chat_key(msgs)
    # a longer conversation extends the shorter one's key
    assert chat_key([*msgs, {"role": "assistant", "content": "hello"}]).startswith(chat_key(msgs))
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat_key(parts) == chat_key([{"role": "user", "content": "ab"}])
    assert body_key("/v1/completions", {"prompt": ["one", "two"]}) == text_key("one")
    ids = body_key("/v1/completions", {"prompt": [1, 2, 3]})
    assert ids == request_key(GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3]))
    assert ids != text_key("\x01\x02\x03")
    assert body_key("/v1/models", None) == ""
    # a response's instructions and input render as chat messages do: a later turn extends the key
    turn = {"instructions": "S" * 50, "input": "hi"}
    assert body_key("/v1/responses", turn) == chat_key(msgs)
    anthropic = {"system": "S" * 50, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert body_key("/v1/messages", anthropic) == chat_key(msgs)
    later = {**turn, "input": [{"role": "user", "content": "hi"}, {"type": "function_call", "arguments": "{}"}]}
    assert body_key("/v1/responses", later).startswith(chat_key(msgs)) and body_key("/v1/responses", later) != \
        chat_key(msgs)
    assert len(text_key("x" * (2 * MAX_KEY_CHARS))) == MAX_KEY_CHARS


def test_each_cuda_replica_sees_its_own_devices(monkeypatch) -> None:
    from types import SimpleNamespace

    from streamer.router.devices import replica_environments

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert replica_environments(SimpleNamespace(device="cuda"), 2) == [  # type: ignore[arg-type]
        {"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    # replicas that are tensor-parallel themselves take tensor_parallel_size devices each
    tp2 = SimpleNamespace(device="cuda", tensor_parallel_size=2)
    assert replica_environments(tp2, 2) == [  # type: ignore[arg-type]
        {"CUDA_VISIBLE_DEVICES": "3,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = replica_environments(SimpleNamespace(device="cpu"), 2)  # type: ignore[arg-type]
    assert cpu[0] == cpu[1] and int(cpu[0]["OMP_NUM_THREADS"]) >= 1
