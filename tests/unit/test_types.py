"""Trajectory model: append/segments, validation naming the field, codecs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles import types as T


def _traj(**kw) -> T.Trajectory:
    return T.Trajectory(id="t0", prompt_id="p0", group_id="g0", prompt_tokens=[1, 2], **kw)


def test_append_builds_segments_and_masks() -> None:
    t = _traj()
    t.append([3, 4], [-0.1, -0.2], 0)
    t.append([5], [-0.3], 1)  # same kind: the model segment grows
    t.append([6, 7], [0.0, 0.0], 1, kind="env")
    assert t.segments == [T.Segment(0, 3, "model"), T.Segment(3, 5, "env")]
    assert t.loss_mask == [1, 1, 1, 0, 0]
    assert t.versions == [0, 0, 1, 1, 1]
    assert t.oldest_version == 0 and t.newest_version == 1
    assert t.max_staleness(3) == 3
    t.validate(current_version=1)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda t: t.logprobs.pop(), "logprobs"),
        (lambda t: t.versions.append(0), "versions"),
        (lambda t: t.loss_mask.__setitem__(0, 2), "loss_mask"),
        (lambda t: t.versions.__setitem__(0, -1), "versions"),
        (lambda t: setattr(t, "segments", [T.Segment(0, 1)]), "segments"),
        (lambda t: setattr(t, "routed_experts", [[[0]]]), "routed_experts"),
    ],
)
def test_validate_names_the_field(mutate, field) -> None:
    t = _traj()
    t.append([3, 4], [-0.1, -0.2], 0)
    mutate(t)
    with pytest.raises(T.TrajectoryError) as err:
        t.validate()
    assert err.value.field == field


@given(st.lists(st.integers(-3, 300), min_size=1, max_size=60), st.booleans())
def test_version_stats_is_min_max_sum(versions: list[int], sort: bool) -> None:
    """The counting fast path (the ends of the list bound every version) and the fallback
    (a version outside the ends) both give exactly min, max and sum."""
    if sort:
        versions = sorted(versions)
    assert T.version_stats(versions) == (min(versions), max(versions), sum(versions))


@given(st.lists(st.tuples(st.integers(0, 12), st.sampled_from(["model", "env"]), st.integers(1, 5)), max_size=6))
def test_validate_returns_the_loss_token_stats(spans: list[tuple[int, str, int]]) -> None:
    """What ``validate`` returns is ``loss_version_stats`` of the trajectory: the buffer keeps
    it instead of computing it again."""
    t = T.Trajectory(id="a", prompt_id="p", group_id="g")
    for version, kind, n in spans:
        t.append([1] * n, [0.0] * n, version, kind=kind)
    assert t.validate() == T.loss_version_stats(t.versions, t.loss_mask)
    stats, runs = t.validate_runs()
    assert stats == t.validate()
    if runs is not None:  # found by the check's own pass: only where every token carries loss
        assert all(t.loss_mask) and runs == T.version_runs(t.versions)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=60), st.booleans(), st.booleans())
def test_validate_runs_finds_the_runs_of_ascending_versions(versions: list[int], sort: bool, big: bool) -> None:
    """Where every token carries loss, ``validate_runs`` hands back ``version_runs`` of the
    versions whenever those are runs of fewer than 8 ascending versions (what the buffer
    keeps for the mask policy), and None otherwise; the stats are ``validate``'s."""
    if sort:
        versions = sorted(versions)
    if big:
        versions = [int(str(v + 1000)) for v in versions]  # past the small-int cache
    n = len(versions)
    t = T.Trajectory(id="a", prompt_id="p", group_id="g", response_tokens=[1] * n, logprobs=[0.0] * n,
                     versions=versions, loss_mask=[1] * n)
    stats, runs = t.validate_runs()
    assert stats == t.validate() == T.loss_version_stats(versions, [1] * n)
    assert runs == T.version_runs(versions)


@given(st.lists(st.tuples(st.integers(0, 400), st.integers(1, 40)), min_size=1, max_size=6), st.booleans())
def test_version_stats_of_runs(runs: list[tuple[int, int]], shuffle: bool) -> None:
    """Runs of versions (a generation across weight updates), in order or not, past the
    small-int cache or not: exactly min, max and sum."""
    versions = [int(str(v)) for v, k in sorted(runs) for _ in range(k)]  # distinct int objects
    if shuffle:
        versions = versions[1:] + versions[:1]
    assert T.version_stats(versions) == (min(versions), max(versions), sum(versions))


def test_version_stats_on_typical_and_odd_lists() -> None:
    assert T.version_stats([3] * 4 + [5] * 3 + [4] * 2 + [5]) == (3, 5, 40)  # runs out of order
    assert T.version_stats([2, 2, 3, 1, 3]) == (1, 3, 11)  # a run's slice holds a lower version
    assert T.version_stats([2] * 3 + [9] * 2) == (2, 9, 24)
    assert T.version_stats([4] * 500) == (4, 4, 2000)
    assert T.version_stats([3] * 10 + [4] * 5 + [6] * 2) == (3, 6, 62)
    assert T.version_stats([5, 1, 5]) == (1, 5, 11)  # a middle version below both ends
    assert T.version_stats([0, 100, 7]) == (0, 100, 107)  # ends too far apart: fallback
    assert T.version_stats([300, 299, 300]) == (299, 300, 899)  # past the small-int cache
    with pytest.raises(T.TrajectoryError, match="loss_mask"):
        _traj(response_tokens=[1, 2], logprobs=[0.0, 0.0], versions=[0, 0], loss_mask=[1, 3]).validate()


def test_future_version_rejected() -> None:
    t = _traj()
    t.append([3], [-0.1], 5)
    with pytest.raises(T.TrajectoryError, match="newer"):
        t.validate(current_version=4)


def test_codecs_round_trip() -> None:
    t = _traj(reward={"acc": 1.0, "fmt": 0.5}, label="42", metadata={"k": [1, 2]})
    t.append([3, 4], [-0.1, -0.2], 0)
    assert T.decode(T.encode(t)) == t
    assert T.from_json(T.to_json(t)) == t
    assert t.scalar_reward() == 1.5 and t.scalar_reward("acc") == 1.0


def test_finish_to_status() -> None:
    assert T.finish_to_status("length") is T.Status.TRUNCATED
    assert T.Status.ABORTED.finished and not T.Status.PARTIAL.finished


def test_multi_turn_trajectory_with_routed_experts_round_trips() -> None:
    t = _traj(routed_experts=[])
    t.append([3, 4], [-0.1, -0.2], 0)  # model turn
    t.append([8, 9, 10], [0.0] * 3, 1, kind="env")  # tool output: no loss
    t.append([5], [-0.3], 1)  # model turn under a newer policy
    t.routed_experts = [[[0, 1]], [[2, 3]], [[0, 0]], [[0, 0]], [[0, 0]], [[1, 2]]]
    t.validate(current_version=1)
    assert [s.kind for s in t.segments] == ["model", "env", "model"]
    assert t.loss_versions() == [0, 0, 1] and t.num_loss_tokens == 3
    assert T.decode(T.encode(t)) == t and T.from_json(T.to_json(t)) == t
