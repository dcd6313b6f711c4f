"""``--print-resolved`` says which sampling applies: the job's [sampling] carries every request, the
generators' own default ([generators.sampling]) is marked unused (and a job refuses to set it)."""

from __future__ import annotations

import tomli

from torchtitan_rl.config.manager import annotate_toml, config_to_toml, parse_args
from torchtitan_rl.controller.job import RLJob


def _comment_above(text: str, header: str) -> str:
    lines = text.splitlines()
    at = lines.index(header)
    comment = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        comment.insert(0, line)
    return " ".join(comment)


def test_print_resolved_marks_the_generators_sampling_unused():
    config = parse_args(RLJob.Config, [
        "--config", "run_configs/alphabet_sort_cpu.toml", "--warm_start.enabled", "false",
        "--model.size", "tiny"]).config
    text = config_to_toml(RLJob(config).resolve())
    data = tomli.loads(text)  # still TOML
    assert data["sampling"]["max_tokens"] == 80
    assert data["generators"][0]["sampling"]["max_tokens"] == 64
    assert _comment_above(text, "[sampling]").startswith(
        "# What every request of the job samples with")
    assert _comment_above(text, "[generators.sampling]").startswith(
        "# Unused: every request of the job carries [sampling] above.")
    # --print-config: the user's tree says the same of [generator.sampling]
    written = config_to_toml(config)
    assert _comment_above(written, "[generator.sampling]").startswith("# Unused in a job")
    assert tomli.loads(written)["sampling"]["max_tokens"] == 80


def test_annotate_toml_comments_tables_list_entries_and_keys():
    text = "a = 1\n\n[[gen]]\nx = 1\n\n[gen.sub]\ny = 2\n\n[[gen]]\nx = 2\n\n[gen.sub]\ny = 3\n"
    out = annotate_toml(text, {"a": "top key", "gen.sub": "sub table\nsecond line",
                               "gen.x": "a key in a list entry"})
    assert tomli.loads(out) == tomli.loads(text)
    assert out.count("# sub table\n# second line\n[gen.sub]") == 2
    assert out.startswith("# top key\na = 1\n")
    assert out.count("# a key in a list entry\nx = ") == 2
    assert annotate_toml(text, {}) == text


def test_none_over_a_value_default_round_trips_through_print_config():
    """TOML has no null: a None where the default is a value is written "none", which reads
    back as None (a field whose type takes strings keeps the string)."""
    from torchtitan_rl.config.manager import config_from_toml_text

    config = parse_args(RLJob.Config, [
        "--trainer.max_grad_norm", "none", "--generator.block_size", "none",
        "--rollouter.step_timeout_s", "null"]).config
    assert config.trainer.max_grad_norm is None and config.generator.block_size is None
    text = config_to_toml(config)
    assert 'max_grad_norm = "none"' in text and 'block_size = "none"' in text
    assert config_from_toml_text(RLJob.Config, text) == config
    # written by hand in a TOML, too
    loaded = config_from_toml_text(RLJob.Config, '[trainer]\nmax_grad_norm = "none"\n'
                                                 '[task]\ntype = "examples.'
                                                 'alphabet_sort:AlphabetSortTask"\n'
                                                 'system_prompt = "none"\n')
    assert loaded.trainer.max_grad_norm is None
    assert loaded.task.system_prompt == "none"
    # defaults that are None stay out of the printed TOML
    assert 'seed = "none"' not in config_to_toml(RLJob.Config())
