"""EnvConfig flags, validation rules, and the factory's choice of generate function."""

from __future__ import annotations

import pytest

from miles.actors.factory import build_generate_fn
from miles.config import ConfigError, build_parser, default_config, resolve
from miles.envs import EnvConfig
from miles.rollout import EnvRollout
from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config
from miles.rollout import generate_single_turn


def test_flags_parse_into_the_env_section() -> None:
    ns = build_parser().parse_args(["--env-path", "a.b:E", "--env-kwargs", '{"n": 3, "name": "x"}', "--max-turns", "4",
                                    "--env-stop", "</call>", "STOP", "--env-turn-template", "raw"])
    values = {k: v for k, v in vars(ns).items() if k != "config"}
    c = resolve(values, check=False)
    assert c.env == EnvConfig(env_path="a.b:E", env_kwargs={"n": 3, "name": "x"}, max_turns=4,
                              env_stop=["</call>", "STOP"], env_turn_template="raw")
    ns = build_parser().parse_args(["--env-kwargs", "n=3,name=x,flag=true"])
    assert ns.env_kwargs == {"n": 3, "name": "x", "flag": True}


@pytest.mark.parametrize(("values", "message"), [
    ({"max_turns": 0}, "max_turns must be >= 1"),
    ({"turn_timeout_s": 0}, "turn_timeout_s must be > 0"),
    ({"max_turn_tokens": 0}, "max_turn_tokens must be >= 1"),
    ({"env_turn_template": "<obs>"}, "must be 'auto', 'chat', 'raw' or a format string"),
    ({"env_reward": "mean"}, "--env-reward"),
])
def test_bad_values_are_config_errors(values, message) -> None:
    with pytest.raises(ConfigError, match=message):
        default_config(**values)


def _checked(tmp_path, **flat):
    if not (tmp_path / "ck" / "config.json").is_file():  # a real (tiny) checkpoint: validation reads its headers
        save_pretrained(CausalLM(tiny_config()), tmp_path / "ck")
    (tmp_path / "d.jsonl").write_text('{"input": "x"}\n')
    return resolve({"hf_checkpoint": str(tmp_path / "ck"), "prompt_data": str(tmp_path / "d.jsonl"), **flat})


def test_cross_field_rules(tmp_path) -> None:
    _checked(tmp_path, env_path="pkg.mod:Env")  # the env's rewards are enough
    with pytest.raises(ConfigError, match="both choose the generate function"):
        _checked(tmp_path, env_path="pkg.mod:Env", custom_generate_function_path="pkg.mod:gen")
    with pytest.raises(ConfigError, match="--env-reward none leaves the reward to --custom-rm-path"):
        _checked(tmp_path, env_path="pkg.mod:Env", env_reward="none")
    with pytest.raises(ConfigError, match="file missing.py not found"):
        _checked(tmp_path, env_path="missing.py:Env")
    with pytest.raises(ConfigError, match="no reward"):
        _checked(tmp_path)


def test_factory_picks_the_env_rollout() -> None:
    tok = build_tiny_tokenizer()
    fn = build_generate_fn(default_config(env_path="tests.unit.envs.helpers:CountdownEnv", env_kwargs={"turns": 2}), tok)
    assert isinstance(fn, EnvRollout) and fn.make_env().turns == 2
    assert build_generate_fn(default_config(), tok) is generate_single_turn


def test_turn_template_auto_follows_the_tokenizer() -> None:
    from miles.envs.config import resolve_turn_template

    tok = build_tiny_tokenizer()
    assert EnvConfig().env_turn_template == "auto"
    assert resolve_turn_template("auto", tok) == "chat"
    tok.chat_template = None  # a base checkpoint
    assert resolve_turn_template("auto", tok) == "raw" and resolve_turn_template("chat", tok) == "chat"

    class Env:
        def reset(self, sample):
            return ""

        def step(self, action):
            return "", 0.0, True, {}

    assert EnvRollout(Env, EnvConfig(), tokenizer=tok).template(tok).mode == "raw"  # no failure at build


def test_agent_flags_and_rules(tmp_path) -> None:
    from miles.agent import AgentConfig, AgentRollout

    ns = build_parser().parse_args(["--custom-agent-function-path", "a.b:fn", "--agent-host", "0.0.0.0",
                                    "--agent-port", "8123", "--agent-timeout-s", "5"])
    c = resolve({k: v for k, v in vars(ns).items() if k != "config"}, check=False)
    assert c.agent == AgentConfig(custom_agent_function_path="a.b:fn", agent_host="0.0.0.0", agent_port=8123,
                                  agent_timeout_s=5.0)
    assert AgentConfig().agent_host == "127.0.0.1"  # loopback unless asked
    with pytest.raises(ConfigError, match="agent_timeout_s must be > 0"):
        default_config(agent_timeout_s=0)
    with pytest.raises(ConfigError, match="both choose the generate function"):
        _checked(tmp_path, custom_agent_function_path="pkg.mod:fn", env_path="pkg.mod:Env")
    with pytest.raises(ConfigError, match="file nope.py not found"):
        _checked(tmp_path, custom_agent_function_path="nope.py:fn")
    agent = tmp_path / "agent.py"
    agent.write_text("async def fn(client, sample):\n    return 1.0\n")
    cfg = _checked(tmp_path, custom_agent_function_path=f"{agent}:fn")
    assert isinstance(build_generate_fn(cfg, build_tiny_tokenizer()), AgentRollout)
    from miles.validation import notes

    assert notes(cfg) == []
    open_cfg = _checked(tmp_path, custom_agent_function_path=f"{agent}:fn", agent_host="0.0.0.0")
    assert any("only key" in n for n in notes(open_cfg))
