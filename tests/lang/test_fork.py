"""fork: branches share the prefix (served by the radix cache) and run concurrently."""

from __future__ import annotations

from streamer.lang import function, gen, select

PREFIX = "Three different ways to spend a rainy Sunday afternoon at home with a good book and tea:\n"


@function
def brainstorm(s, n):
    s += PREFIX
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += f"{i + 1}." + gen("idea", max_tokens=6, temperature=1.0, seed=i, stop="\n")
    ideas = forks.join("idea")
    s += "The best one is:" + select("best", [" " + x.strip() for x in ideas])
    return [f.meta("idea") for f in forks]


def test_branches_report_cached_prefix_tokens(backend):
    st = brainstorm.run(3, backend=backend)
    assert len(st["idea"]) == 3, "join gathers each branch's variable into the parent"
    assert all(m["cached_tokens"] >= 16 for m in st.ret), st.ret
    assert st["best"].strip() in [x.strip() for x in st["idea"]]
    assert st.text().startswith(PREFIX + "The best one is:")


def test_branches_are_copies_and_forks_append_to_each(backend):
    @function
    def prog(s):
        s += "Count: 1, 2,"
        forks = s.fork(2, commit=False)
        forks += gen("next", max_tokens=2)
        forks[0] += " (first)"
        s += " done"
        return [f.text() for f in forks]

    st = prog.run(backend=backend)
    first, second = st.ret
    assert first.startswith("Count: 1, 2,") and first.endswith(" (first)")
    assert not second.endswith(" (first)")
    assert st.text() == "Count: 1, 2, done", "branches do not write into the parent"
