"""load_function: the three accepted forms and clear errors."""

import pytest

from miles.utils.loading import LoadError, load_function, positional_arity


def test_module_forms() -> None:
    assert load_function("os.path:join") is load_function("os.path.join")


def test_file_form(tmp_path) -> None:
    f = tmp_path / "rm.py"
    f.write_text("def reward(sample):\n    return 1.0\n\ndef slime_style(args, sample):\n    return 0.0\n")
    fn = load_function(f"{f}:reward")
    assert fn(None) == 1.0
    assert positional_arity(load_function(f"{f}:slime_style")) == 2


@pytest.mark.parametrize("ref", ["", "nodots", "no_such_mod_xyz:fn", "os.path:nope", "/no/file.py:fn"])
def test_errors(ref) -> None:
    with pytest.raises(LoadError):
        load_function(ref)
