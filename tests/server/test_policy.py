"""The server's part of a request's parameters (no engine): the cache namespace under
--cache-isolation per-key, the --request-timeout cap, the API keys, and the engine-failure
statuses a client sees."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamer.config import ServerConfig
from streamer.errors import ConfigError
from streamer.messages import ENGINE_DOWN, ENGINE_STALLED, RequestOutput, SamplingParams
from streamer.server.guard import KEY_ID, bearer, key_id, matching_key
from streamer.server.state import ServerState, engine_down, failure

ENGINE = SimpleNamespace(stats=lambda: None, dead=None, stalled=None)


def state(**config) -> ServerState:
    return ServerState(ENGINE, ServerConfig(**config))


def test_per_key_isolation_salts_every_request_by_its_key_and_keeps_the_request_salt():
    st = state(api_keys=("alice", "bob"), cache_isolation="per-key")
    alice, bob = {KEY_ID: key_id("alice")}, {KEY_ID: key_id("bob")}
    plain = SamplingParams()
    assert st.apply_policy(plain, alice).cache_salt == f"key:{key_id('alice')}"
    assert st.apply_policy(plain, alice).cache_salt != st.apply_policy(plain, bob).cache_salt
    salted = SamplingParams(cache_salt="s")
    assert st.apply_policy(salted, alice).cache_salt == f"key:{key_id('alice')}:s"
    assert "alice" not in key_id("alice") and len(key_id("alice")) == 16, "the key itself never appears"


def test_without_isolation_the_request_salt_alone_counts():
    st = state(api_keys=("alice",))
    assert st.apply_policy(SamplingParams(), {KEY_ID: key_id("alice")}).cache_salt is None
    assert st.apply_policy(SamplingParams(cache_salt="s"), {}).cache_salt == "s"


def test_the_server_timeout_is_the_default_and_the_cap():
    st = state(request_timeout=10.0)
    assert st.apply_policy(SamplingParams(), {}).timeout == 10.0
    assert st.apply_policy(SamplingParams(timeout=3.0), {}).timeout == 3.0
    assert st.apply_policy(SamplingParams(timeout=300.0), {}).timeout == 10.0
    assert state().apply_policy(SamplingParams(timeout=300.0), {}).timeout == 300.0


def test_bad_settings_are_refused_with_a_clear_message():
    with pytest.raises(ConfigError, match="--api-key"):
        ServerConfig(cache_isolation="per-key")
    with pytest.raises(ConfigError, match="cache_isolation"):
        ServerConfig(cache_isolation="per-user")
    with pytest.raises(ConfigError, match="request_timeout"):
        ServerConfig(request_timeout=0)


def test_every_key_is_accepted_and_only_those():
    keys = ("k1", "k2")
    assert matching_key(keys, bearer("Bearer k2")) == "k2"
    assert matching_key(keys, bearer("bearer  k1 ")) == "k1"
    assert matching_key(keys, bearer("Bearer k3")) is None
    assert matching_key(keys, bearer("Basic k1")) is None
    assert matching_key(keys, None) is None


def test_engine_failures_are_503s_and_a_deadline_a_504():
    def out(**kw) -> RequestOutput:
        return RequestOutput("r", [], "", finished=True, **kw)

    down = failure(out(finish_reason="error", error="the engine is down: gone", error_code=ENGINE_DOWN))
    assert (down.status, down.code) == (503, ENGINE_DOWN)
    stalled = failure(out(finish_reason="error", error="not responding", error_code=ENGINE_STALLED))
    assert (stalled.status, stalled.code) == (503, ENGINE_STALLED)
    late = failure(out(finish_reason="timeout", error="the request timed out"))
    assert (late.status, late.code, late.type) == (504, "request_timeout", "server_error")
    assert failure(out(finish_reason="error", error="internal error: x")).status == 500
    assert failure(out(finish_reason="error", error="bad grammar")).status == 400
    dead = SimpleNamespace(dead="crashed", stalled=None)
    err = engine_down(dead)
    assert err is not None and (err.status, err.code) == (503, ENGINE_DOWN)
    assert engine_down(SimpleNamespace(dead=None, stalled="no heartbeat")).code == ENGINE_STALLED  # type: ignore[union-attr]
    assert engine_down(ENGINE) is None
