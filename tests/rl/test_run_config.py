"""The run config's schema (train/run_config.py): every configs/rl.py variant validates and
records the keys of its ConfigDict; a config written before a field existed loads with the
value those runs had; unknown fields and bad values are refused naming the dotted field."""

import dataclasses
import json

import pytest

from configs import rl as rl_configs
from train.run_config import ADDED_FIELDS, RunConfig, RunConfigError

HF_DIR = "tests/model/hf_fixtures/kimi_chat"


def _json(d):
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def test_every_variant_validates_and_records_its_configdict():
    for name in sorted(rl_configs.VARIANTS):
        c = rl_configs.get_config(name)
        if "hf_dir" in c:
            c.hf_dir = HF_DIR
        r = RunConfig.from_config(c)
        if name != "hf":  # hf's model section becomes the checkpoint's
            assert _json(r.to_dict()) == _json(c.to_dict()), name
        assert RunConfig.from_config(r.to_dict()) == r, name  # config.json loads back
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.rl.steps = 3


def test_a_config_written_before_a_field_loads_with_the_old_behaviour():
    d = rl_configs.get_config("smoke").to_dict()
    for path in ADDED_FIELDS:
        section, field = path.split(".", 1)
        if section != "model":
            del d[section][field]
    r = RunConfig.from_config(d)
    assert (r.rl.oversample, r.rl.template_power, r.rl.seed, r.sandbox.reuse_verdicts) == (
        1, 1.0, None, 0)


def test_bad_fields_are_refused_naming_them():
    for section, field, value, message in (
            ("rl", "nonsense", 1, r"rl.nonsense: unknown field; valid fields: \['agent'"),
            ("rl", "steps", -1, r"rl.steps must be an int >= 0, got -1"),
            ("rl", "steps", 2.5, r"rl.steps must be an int >= 0, got 2.5"),
            ("sandbox", "workers", 0, r"sandbox.workers must be an int >= 1 \(the local"),
            ("rl", "speculative", "eagle", r"rl.speculative must be one of \('none', 'mtp'\)"),
            ("eval", "greedy", 1, r"eval.greedy must be a bool, got 1"),
            ("tasks", "domains", "arithmetic,chess", r"tasks.domains: unknown task domain 'chess'"),
            ("sft", "domains", "chess", r"sft.domains: unknown task domain 'chess'")):
        d = rl_configs.get_config("smoke").to_dict()
        d[section][field] = value
        with pytest.raises(ValueError, match=message):
            RunConfig.from_config(d)
    d = rl_configs.get_config("smoke").to_dict()
    d["tasks"]["difficulty"]["chess"] = 1
    with pytest.raises(RunConfigError, match="tasks.difficulty.chess: unknown task domain"):
        RunConfig.from_config(d)
    d = rl_configs.get_config("smoke").to_dict()
    d["rl"]["critic"]["hidden_dim"] = -1
    with pytest.raises(RunConfigError, match="rl.critic: CriticConfig.hidden_dim=-1"):
        RunConfig.from_config(d)


def test_renamed_fields_load_from_a_record_and_are_refused_elsewhere():
    """The task-domain fields were named "families" (also the scoring method's word, Task.family):
    a recorded config.json with the old names loads under the new ones; a ConfigDict (flags,
    code) with an old name is refused naming the new one."""
    c = rl_configs.get_config("agent")
    d = c.to_dict()
    d["tasks"]["families"] = d["tasks"].pop("domains")
    d["tasks"]["train_per_family"] = d["tasks"].pop("train_per_domain")
    d["sft"]["families"] = d["sft"].pop("domains")
    assert RunConfig.from_config(d) == RunConfig.from_config(c)
    c.tasks.train_per_family = 5
    with pytest.raises(RunConfigError, match=r"tasks.train_per_family: renamed "
                                             r"tasks.train_per_domain .*--config.tasks.train_per"):
        RunConfig.from_config(c)
    d["tasks"]["domains"] = "code"
    with pytest.raises(RunConfigError, match="tasks.families: renamed tasks.domains, and the "
                                             "config has both"):
        RunConfig.from_config(d)


def test_flags_override_the_schema_defaults_and_the_links_follow():
    c = rl_configs.get_config("grpo_tiny")
    c.rl.seed = 5  # an optional field (a placeholder) takes an int
    c.rl.steps = 7
    c.rl.max_new_tokens = 60
    r = RunConfig.from_config(c)
    assert (r.rl_seed(), r.optim.total_steps, r.rl.algo.max_len, r.eval.batch_prompts) == (
        5, 7, 60, r.rl.prompts_per_batch * r.rl.group_size)


def test_the_task_domain_meta_key_renamed_loads_and_keeps_recorded_digests():
    """Task files naming the domain meta["family_name"] load with meta["domain"]; a data record's
    digest hashes the domain under the key records were written with, so a run directory
    recorded before the rename still resumes (the digest is that of the old form)."""
    import hashlib

    from sandbox.tasks.schema import Task
    from train.data import data_digest

    old = {"id": "a", "family": "stdio", "prompt": "p", "meta": {"family_name": "code", "x": 1}}
    t = Task.from_dict(old)
    assert t.meta == {"domain": "code", "x": 1} and old["meta"] == {"family_name": "code", "x": 1}
    legacy = dataclasses.asdict(t)
    legacy["meta"] = {"family_name": "code", "x": 1}
    want = hashlib.sha256(json.dumps([legacy], sort_keys=True).encode()).hexdigest()
    assert data_digest([t]) == want
    moved = Task.from_dict({**old, "meta": {"family_name": "math"}})
    assert data_digest([moved]) != want  # the domain's value is still hashed
