"""The session bookkeeping every backend shares (``actors.backends.session_table``), on its own: sessions here are
plain records, standing in for a backend's KV and sampler."""

from __future__ import annotations

import dataclasses

import pytest

from actors.backend import StepOutput
from actors.backends.session_table import SessionTable, Wording, choice_seed
from schemas.constraint import JsonObjectConstraint, ToolCallConstraint
from schemas.errors import BadRequestError, CapacityError, SessionNotFoundError
from schemas.session import SamplingParams
from schemas.tools import FunctionSpec


@dataclasses.dataclass
class Record:
    position: int = 0
    choice: int = 0


def table(max_sessions: int = 3, *, tail: bool = True, constraints: bool = True,
          wording: Wording | None = None) -> SessionTable[Record]:
    return SessionTable[Record]("toy", max_sessions, tail=tail, constraints=constraints, wording=wording)


def first(fork: Record) -> StepOutput:
    """The fork's first token: its choice number, so that a test can tell which fork it came from."""
    return StepOutput(token=fork.choice)


def opened(t: SessionTable[Record], *ids: str, position: int = 0) -> SessionTable[Record]:
    for session_id in ids:
        t.admit(session_id, SamplingParams())
        t.add(session_id, Record(position=position))
    return t


def test_sessions_are_found_by_id_in_the_order_they_opened() -> None:
    t = opened(table(), "b", "a")
    assert t.ids() == ["b", "a"] and len(t) == 2 and "a" in t and "c" not in t
    assert t["a"] is not t["b"] and [r.position for r in t.values()] == [0, 0]
    with pytest.raises(SessionNotFoundError, match="^session c is not open on this node$"):
        t["c"]


def test_admit_refuses_an_open_id_and_a_full_table() -> None:
    t = opened(table(max_sessions=2), "a")
    with pytest.raises(BadRequestError, match="^session a is already open on this node$"):
        t.admit("a", SamplingParams())
    opened(t, "b")
    with pytest.raises(CapacityError, match=r"^toy node holds 2 sessions \(max 2\)$"):
        t.admit("c", SamplingParams())
    assert t.ids() == ["a", "b"]


def test_closing_frees_room_and_is_idempotent() -> None:
    t = opened(table(max_sessions=1), "a")
    closed = t.pop("a")
    assert closed is not None and t.pop("a") is None and t.ids() == []
    opened(t, "b")  # the room "a" held
    t.clear()
    assert len(t) == 0


@pytest.mark.parametrize(("constraint", "param"), [(JsonObjectConstraint(), "response_format"),
                                                   (ToolCallConstraint(tools=[FunctionSpec(name="f")]), "tools")])
def test_a_tail_without_constraints_refuses_them_by_field(constraint: object, param: str) -> None:
    sampling = SamplingParams(constraint=constraint)
    with pytest.raises(BadRequestError, match="^the toy backend does not enforce output constraints") as info:
        table(constraints=False).admit("a", sampling)
    assert info.value.param == param
    table(tail=False, constraints=False).admit("a", sampling)  # only the tail samples: other hops take it
    table().admit("a", sampling)  # a backend that enforces them lets the session in


def test_a_backend_words_its_own_refusals() -> None:
    wording = Wording(full="all {max} of {name}'s {open} slots are taken ({free} free)",
                      forks_full="{forks} forks, {free} free", step_forks_full="step: {forks} forks, {free} free",
                      unsampled="sample first", export_range="{session} at {position}: no [{start}, {end})",
                      truncate_range="{session} at {position}: not to {to}")
    t = opened(table(max_sessions=1, wording=wording), "a", position=4)
    with pytest.raises(CapacityError, match=r"^all 1 of toy's 1 slots are taken \(0 free\)$"):
        t.check_room()
    with pytest.raises(CapacityError, match="^2 forks, 0 free$"):
        t.fork(["x", "y"], lambda choice: Record(), first, sampled=True)
    with pytest.raises(CapacityError, match="^step: 1 forks, 0 free$"):
        t.check_step_forks(["x"])
    with pytest.raises(BadRequestError, match=r"^a at 4: no \[2, 5\)$"):
        t.exporting("a", 2, 5)
    with pytest.raises(BadRequestError, match="^a at 4: not to 5$"):
        t.truncating("a", 5)
    t.pop("a")
    with pytest.raises(BadRequestError, match="^sample first$"):
        t.fork(["x"], lambda choice: Record(), first, sampled=False)


def test_forks_open_all_at_once_as_choices_one_two_and_so_on() -> None:
    t = opened(table(max_sessions=4), "s")
    outputs = t.fork(("f1", "f2", "f3"), lambda choice: Record(position=t["s"].position, choice=choice), first,
                     sampled=True)
    assert [o.token for o in outputs] == [1, 2, 3]
    assert t.ids() == ["s", "f1", "f2", "f3"] and [t[f].choice for f in ("f1", "f2", "f3")] == [1, 2, 3]


def test_forks_off_the_tail_sample_nothing_and_need_no_logits() -> None:
    t = opened(table(max_sessions=3, tail=False), "s")
    outputs = t.fork(["a", "b"], lambda choice: Record(choice=choice), first, sampled=False)
    assert outputs == [StepOutput(), StepOutput()] and t.ids() == ["s", "a", "b"]


def test_forks_are_refused_whole() -> None:
    t = opened(table(max_sessions=3), "s", "o")
    made: list[int] = []

    def make(choice: int) -> Record:
        made.append(choice)
        return Record(choice=choice)

    with pytest.raises(BadRequestError, match=r"^fork ids must be new and distinct, got \['x', 'x'\]$"):
        t.fork(["x", "x"], make, first, sampled=True)
    with pytest.raises(BadRequestError, match=r"new and distinct, got \['o'\]"):
        t.fork(["o"], make, first, sampled=True)
    with pytest.raises(CapacityError, match=r"^2 forks do not fit: the toy node holds 2 sessions \(max 3\)$"):
        t.fork(["x", "y"], make, first, sampled=True)
    with pytest.raises(BadRequestError, match="^a session forks on the tail after the step that sampled"):
        t.fork(["x"], make, first, sampled=False)
    assert made == [] and t.ids() == ["s", "o"]  # refused before anything was made


def test_a_fork_that_fails_to_build_discards_the_ones_built() -> None:
    t = opened(table(max_sessions=4), "s")
    discarded: list[int] = []

    def make(choice: int) -> Record:
        if choice == 3:
            raise RuntimeError("no grammar for choice 3")
        return Record(choice=choice)

    with pytest.raises(RuntimeError, match="choice 3"):
        t.fork(["a", "b", "c"], make, first, sampled=True, discard=lambda r: discarded.append(r.choice))
    assert discarded == [1, 2] and t.ids() == ["s"]


def test_a_step_s_forks_are_checked_before_it_runs() -> None:
    t = opened(table(max_sessions=3), "s")
    t.check_step_forks([])
    t.check_step_forks(["a", "b"])  # exactly the room left
    with pytest.raises(CapacityError, match=r"^this step forks 3 sessions; the toy node holds 1 \(max 3\)$"):
        t.check_step_forks(["a", "b", "c"])
    with pytest.raises(BadRequestError, match="new and distinct"):
        t.check_step_forks(["a", "a"])
    with pytest.raises(BadRequestError, match="new and distinct"):
        t.check_step_forks(["s"])
    assert t.ids() == ["s"]  # checking opens nothing


def test_exports_and_truncations_stay_within_the_positions_held() -> None:
    t = opened(table(), "s", position=5)
    assert t.exporting("s", 0, 5) is t["s"] and t.exporting("s", 4, 5) is t["s"]
    for start, end in [(0, 6), (3, 3), (-1, 2), (4, 2)]:
        with pytest.raises(BadRequestError, match=rf"^session s holds positions \[0, 5\); cannot export "
                                                  rf"\[{start}, {end}\)$"):
            t.exporting("s", start, end)
    assert t.truncating("s", 0) is t["s"] and t.truncating("s", 5) is t["s"]
    for position in (6, -1):
        with pytest.raises(BadRequestError, match=rf"^session s is at position 5; cannot truncate to {position}$"):
            t.truncating("s", position)
    with pytest.raises(SessionNotFoundError):
        t.truncating("gone", 0)
    assert t["s"].position == 5  # the table checks; moving the position is the backend's


def test_choice_i_samples_with_seed_plus_i() -> None:
    assert [choice_seed(41, i) for i in (1, 2)] == [42, 43]
    assert choice_seed(None, 1) is None
