"""A YAML config file that is not UTF-8 fails naming the file, not with a bare UnicodeDecodeError."""

import re

import pytest

from m3_rollout.config import ConfigError, load_config


def test_non_utf8_yaml_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes("grpo:\n  # réglages\n  seed: 1\n".encode("latin-1"))
    with pytest.raises(
        ConfigError, match="^" + re.escape(str(path.resolve())) + r": not UTF-8 text \(byte offset 11\)"
    ):
        load_config(path)


def test_non_utf8_parent_is_named_not_the_child(tmp_path):
    (tmp_path / "base.yaml").write_bytes(b"grpo:\n  seed: \xff\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: base.yaml\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="^" + re.escape(str((tmp_path / "base.yaml").resolve())) + ": not UTF-8"):
        load_config(child)
