"""run_batch runs programs concurrently (the engine batches them); a failing program
raises a ProgramError at its own line and leaves the others alone."""

from __future__ import annotations

import pytest

from streamer.lang import ProgramError, function, gen
from tests.lang.conftest import line_of


@function
def complete(s, subject):
    s += f"A short fact about {subject}:" + gen("fact", max_tokens=4)


SUBJECTS = ["cats", "dogs", "rain", "the moon", "bread", "rivers", "music", "glass", "trees", "salt",
            "owls", "clocks", "snow", "copper", "bees", "maps", "tea", "wind", "ships", "chess"]


def test_run_batch_batches_in_the_engine(backend, llm):
    before = llm.stats()
    states = complete.run_batch([{"subject": x} for x in SUBJECTS], backend=backend, parallel=20)
    after = llm.stats()
    assert all(st.error is None for st in states)
    assert [st.text().split(" fact about ")[1].split(":")[0] for st in states] == SUBJECTS, "results in order"
    assert after.max_batch_size > 1
    generated = sum(st.meta("fact")["completion_tokens"] for st in states)
    assert after.steps - before.steps < generated / 2, "one step served many programs"


@function
def faulty(s, how):
    s += "Hello"
    if how == "bad-regex":
        s += gen("x", max_tokens=4, regex="[")  #: bad-regex
    elif how == "missing":
        return s["nope"]  #: missing
    elif how == "bad-type":
        s += 42  #: bad-type
    s += gen("ok", max_tokens=2)
    return s["ok"]


@pytest.mark.parametrize("how, cause", [("bad-regex", "invalid regex"), ("missing", "KeyError"),
                                        ("bad-type", "TypeError")])
def test_an_error_names_the_programs_line(backend, how, cause):
    with pytest.raises(ProgramError) as info:
        faulty.run(how, backend=backend)
    err = info.value
    assert err.where is not None and err.where.filename == __file__
    assert err.where.lineno == line_of(how, __file__)
    assert f"{__file__}:{err.where.lineno}" in str(err)
    assert cause in str(err) and "'faulty'" in str(err)


def test_a_failing_program_does_not_disturb_the_batch(backend):
    hows = ["fine", "bad-regex", "fine", "missing", "fine"]
    states = faulty.run_batch([{"how": h} for h in hows], backend=backend)
    for how, st in zip(hows, states):
        if how == "fine":
            assert st.error is None and isinstance(st["ok"], str) and st.ret == st["ok"]
        else:
            assert isinstance(st.error, ProgramError)
            assert st.error.where.lineno == line_of(how, __file__)
            with pytest.raises(ProgramError):
                st["ok"]
