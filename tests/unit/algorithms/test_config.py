"""AlgorithmConfig: flag names, slime defaults, validation naming the field."""

import msgspec
import pytest

from miles.algorithms import AlgorithmConfig, AlgorithmConfigError

FLAGS = {
    "advantage_estimator", "gamma", "lam", "reward_kl_coef", "eps_clip", "eps_clip_high",
    "dual_clip_c", "use_tis", "tis_clip", "tis_clip_low", "tis_level", "tis_mode", "tis_veto",
    "use_decoupled_loss", "prox_logp", "kl_coef", "kl_type", "entropy_coef", "loss_agg",
    "loss_agg_max_tokens", "off_policy_correction", "grpo_std_eps", "grpo_std_level", "grpo_std_unbiased",
}


def test_fields_are_the_flag_names_and_defaults_follow_slime() -> None:
    assert set(AlgorithmConfig.__struct_fields__) == FLAGS
    cfg = AlgorithmConfig()
    assert cfg.advantage_estimator == "grpo"
    assert (cfg.eps_clip, cfg.eps_clip_high, cfg.clip_high) == (0.2, None, 0.2)
    assert (cfg.tis_clip, cfg.tis_clip_low, cfg.tis_level, cfg.tis_mode) == (2.0, None, "token", "truncate")
    assert (cfg.gamma, cfg.lam, cfg.kl_coef, cfg.kl_type, cfg.entropy_coef) == (1.0, 1.0, 0.0, "k1", 0.0)
    assert cfg.importance_mode == "tis"
    assert AlgorithmConfig(tis_mode="mask").importance_mode == "mask"
    assert AlgorithmConfig(advantage_estimator="gspo").sequence_ratio
    assert AlgorithmConfig(eps_clip_high=0.28).clip_high == 0.28


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("advantage_estimator", "grpoo"),
        ("tis_level", "tokens"),
        ("tis_mode", "tis"),
        ("prox_logp", "rollout"),
        ("kl_type", "k4"),
        ("loss_agg", "mean"),
        ("eps_clip", 0.0),
        ("eps_clip_high", -0.1),
        ("dual_clip_c", 1.0),
        ("tis_clip", 0.0),
        ("tis_clip_low", 3.0),
        ("tis_veto", 0.0),
        ("gamma", 1.5),
        ("lam", -0.1),
        ("kl_coef", -1.0),
        ("entropy_coef", float("nan")),
        ("loss_agg_max_tokens", 0),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(AlgorithmConfigError, match=f"AlgorithmConfig.{field}") as info:
        AlgorithmConfig(**{field: value})
    assert info.value.field == field
    # The config layer's path (msgspec.convert) rejects it too, naming the field.
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert({field: value}, AlgorithmConfig)


def test_convert_from_flags_mapping() -> None:
    cfg = msgspec.convert(
        {"advantage_estimator": "rloo", "use_tis": True, "tis_mode": "mask", "tis_clip": 5.0,
         "tis_clip_low": 0.5, "eps_clip_high": 0.28},
        AlgorithmConfig,
    )
    assert cfg.advantage_estimator == "rloo" and cfg.importance_mode == "mask"
    assert msgspec.convert(msgspec.to_builtins(cfg), AlgorithmConfig) == cfg
