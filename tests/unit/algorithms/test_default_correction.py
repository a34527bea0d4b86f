"""Stale modes train with a correction unless told not to: MIS by default in async and
one-step-off, the user's own where they name one, none with --no-off-policy-correction;
the resolved config (config.yaml) says which."""

from __future__ import annotations

import pytest
import yaml

from miles.config import ConfigError, default_config
from miles.validation import correction_line


@pytest.mark.parametrize("mode", ["async", "one-step-off"])
def test_stale_modes_default_to_mis(mode, tmp_path) -> None:
    cfg = default_config(mode=mode)
    a = cfg.algorithm
    assert (a.off_policy_correction, a.use_tis, a.tis_mode, a.tis_clip, a.tis_clip_low) == (True, True, "mask", 5.0, 0.5)
    assert "MIS [0.5, 5]" in correction_line(cfg)
    cfg.dump(tmp_path / "config.yaml")
    dumped = yaml.safe_load((tmp_path / "config.yaml").read_text())["algorithm"]
    assert dumped["off_policy_correction"] is True and dumped["use_tis"] is True and dumped["tis_mode"] == "mask"
    again = cfg.replace(seed=7).algorithm  # a re-resolved copy keeps it
    assert (again.use_tis, again.tis_mode, again.tis_clip_low) == (True, "mask", 0.5)


def test_sync_and_opt_out_are_uncorrected() -> None:
    for cfg in (default_config(mode="sync"), default_config(mode="async", off_policy_correction=False)):
        a = cfg.algorithm
        assert (a.off_policy_correction, a.use_tis, a.use_decoupled_loss) == (False, False, False)
        assert "no off-policy correction" in correction_line(cfg)
    assert default_config(mode="sync", off_policy_correction=True).algorithm.use_tis  # asked for: MIS in sync too


def test_a_named_correction_is_kept() -> None:
    tis = default_config(mode="async", use_tis=True, tis_clip=3.0).algorithm
    assert (tis.off_policy_correction, tis.tis_mode, tis.tis_clip, tis.tis_clip_low) == (True, "truncate", 3.0, None)
    dec = default_config(mode="async", use_decoupled_loss=True).algorithm
    assert dec.off_policy_correction and dec.use_decoupled_loss and not dec.use_tis
    own_bounds = default_config(mode="async", tis_clip=2.0).algorithm  # bounds without a switch: MIS with them
    assert own_bounds.use_tis and own_bounds.tis_mode == "mask" and own_bounds.tis_clip == 2.0
    off = default_config(mode="async", use_tis=False).algorithm  # an explicit "no" is a choice
    assert not off.off_policy_correction and not off.use_tis
    with pytest.raises(ConfigError, match="off_policy_correction"):
        default_config(mode="async", off_policy_correction=False, use_tis=True)


def test_cli_flags() -> None:
    from miles.config import build_parser

    ns = build_parser().parse_args(["--no-off-policy-correction"])
    assert ns.off_policy_correction is False
