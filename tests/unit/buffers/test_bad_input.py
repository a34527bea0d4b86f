"""Bad input: a clear error naming the field, and the buffer's state unchanged."""

from collections.abc import Callable

import pytest

from miles.buffers import BufferConfig, BufferFull
from miles.types import PromptSample, Segment, Status, Trajectory, TrajectoryError

from tests.unit.buffers.helpers import generate, make_buffer, prompts, ray_copy, snapshot


def _setup():
    buf = make_buffer(n_samples_per_prompt=2, capacity=8)
    buf.add_prompts(prompts(2))
    buf.set_version(3)
    leased = buf.lease("w", 3)
    buf.put(generate(leased[2], 3, status=Status.PARTIAL), "w")  # some partial state too
    return buf, leased


def _result(t: Trajectory, **changes) -> Trajectory:
    out = generate(t, 3)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


def _edit(fn: Callable[[Trajectory], object]) -> Callable[[Trajectory], Trajectory]:
    def make(t: Trajectory) -> Trajectory:
        out = _result(t)
        fn(out)
        return out

    return make


BAD_PUTS: list[tuple[str, Callable[[Trajectory], Trajectory], str]] = [
    ("logprobs length", _edit(lambda r: r.logprobs.pop()), "logprobs"),
    ("versions length", _edit(lambda r: r.versions.append(3)), "versions"),
    ("loss_mask length", _edit(lambda r: r.loss_mask.append(1)), "loss_mask"),
    ("routed_experts length", lambda t: _result(t, routed_experts=[[[0]]]), "routed_experts"),
    ("negative version", _edit(lambda r: r.versions.__setitem__(0, -1)), "versions"),
    ("future version", _edit(lambda r: r.versions.__setitem__(0, 4)), "versions"),
    ("unknown group", lambda t: _result(t, id="x/0", group_id="nope"), "group_id"),
    ("changed group", lambda t: _result(t, group_id="nope"), "group_id"),
    ("changed prompt", lambda t: _result(t, prompt_id="nope"), "prompt_id"),
    ("changed index", lambda t: _result(t, index_in_group=5), "index_in_group"),
    ("unknown id", lambda t: _result(t, id=t.group_id + "/9"), "id"),
    ("still running", lambda t: _result(t, status=Status.RUNNING), "status"),
    ("bad segments", lambda t: _result(t, segments=[Segment(0, 1)]), "segments"),
]


@pytest.mark.parametrize(("what", "make", "field"), BAD_PUTS, ids=[b[0] for b in BAD_PUTS])
def test_bad_put_names_field_and_changes_nothing(what, make, field) -> None:
    buf, leased = _setup()
    before = snapshot(buf)
    with pytest.raises(TrajectoryError) as err:
        buf.put(make(leased[0]), "w")
    assert err.value.field == field, what
    assert snapshot(buf) == before


def test_bad_item_in_put_many_changes_nothing() -> None:
    buf, leased = _setup()
    before = snapshot(buf)
    bad = _result(leased[1])
    bad.versions[0] = 99
    with pytest.raises(TrajectoryError, match="versions"):
        buf.put_many([_result(leased[0]), bad], "w")
    assert snapshot(buf) == before
    with pytest.raises(TrajectoryError, match="twice") as err:
        buf.put_many([_result(leased[0]), _result(leased[0])], "w")
    assert err.value.field == "id" and snapshot(buf) == before


def test_put_not_leased_or_wrong_worker() -> None:
    buf, leased = _setup()
    before = snapshot(buf)
    with pytest.raises(TrajectoryError, match="leased to 'w', not 'other'"):
        buf.put(_result(leased[0]), "other")
    with pytest.raises(TrajectoryError, match="not leased") as err:
        buf.put(_result(leased[2]), "w")  # already returned as PARTIAL
    assert err.value.field == "id"
    queued = next(t for t in buf.state_dict()["records"] if t[1] == 0)
    fake = Trajectory(id=queued[0], prompt_id="p1", group_id=queued[0].split("/")[0], status=Status.COMPLETED)
    with pytest.raises(TrajectoryError, match="not leased"):
        buf.put(fake)
    assert snapshot(buf) == before


def test_filter_that_raises_changes_nothing() -> None:
    def needs_reward(group):
        return all(t.scalar_reward() > 0 for t in group)

    buf = make_buffer(n_samples_per_prompt=2, group_filters=[needs_reward])
    buf.add_prompts(prompts(1))
    a, b = buf.lease("w", 2)
    buf.put(generate(a, 0), "w")
    before = snapshot(buf)
    with pytest.raises(TrajectoryError, match="no reward"):
        buf.put(generate(b, 0, reward=None), "w")
    assert snapshot(buf) == before
    buf.put(generate(b, 0), "w")
    assert buf.ledger().groups.ready == 1


def test_bad_admission_changes_nothing() -> None:
    buf, _ = _setup()
    before = snapshot(buf)
    with pytest.raises(BufferFull):
        buf.add_prompts(prompts(5))
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        buf.add_prompts(prompts(1), n_samples_per_prompt=0)
    with pytest.raises(TypeError, match="PromptSample"):
        buf.add_prompts([PromptSample(prompt_id="ok"), {"prompt_id": "x"}])  # type: ignore[list-item]
    held = buf.state_dict()["records"][0][0]
    dup = Trajectory(id=held, prompt_id="q", group_id="q#new")
    with pytest.raises(TrajectoryError, match="duplicate") as err:
        buf.add_groups([[dup]])
    assert err.value.field == "id"
    twice = [Trajectory(id="z/0", prompt_id="z", group_id="z"), Trajectory(id="z/0", prompt_id="z", group_id="z", index_in_group=1)]
    with pytest.raises(TrajectoryError, match="duplicate"):
        buf.add_groups([twice])
    gap = [Trajectory(id="y/0", prompt_id="y", group_id="y", index_in_group=1)]
    with pytest.raises(TrajectoryError) as err:
        buf.add_groups([gap])
    assert err.value.field == "index_in_group"
    future = Trajectory(id="f/0", prompt_id="f", group_id="f", status=Status.PARTIAL)
    future.append([1], [-0.1], 7)
    with pytest.raises(TrajectoryError, match="newer"):
        buf.add_groups([[future]])
    assert snapshot(buf) == before


def test_bad_versions_and_batch_args() -> None:
    buf, _ = _setup()
    before = snapshot(buf)
    with pytest.raises(ValueError, match="version"):
        buf.set_version(2)  # backwards
    with pytest.raises(ValueError, match="num_groups"):
        buf.get_batch(0, 3)
    with pytest.raises(ValueError, match="trainer_version"):
        buf.get_batch(1, -1)
    assert snapshot(buf) == before


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_staleness", -1), ("stale_policy", "ignore"), ("capacity", 0),
     ("lease_timeout_s", 0.0), ("n_samples_per_prompt", 0)],
)
def test_config_validation_names_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        BufferConfig(**{field: value})


def test_ray_copy_is_faithful() -> None:
    t = Trajectory(id="a", prompt_id="p", group_id="g")
    t.append([1], [-0.1], 0)
    assert ray_copy(t) == t
