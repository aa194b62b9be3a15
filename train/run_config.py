"""The run config's schema: one frozen dataclass per section (tasks, sft, rl with rl.agent and
rl.critic, optim, eval, sandbox, quant) and the top-level fields, each field with its type, its
default and its allowed values, stated once here.

    RunConfig.from_config(cd)   a ConfigDict (configs/rl.py after --config.* flags) or a plain
                                dict (a recorded config.json, its renamed fields migrated)
                                -> the validated, frozen RunConfig
    RunConfig.to_dict()         the JSON a run directory records (config.json): the keys of the
                                ConfigDict it came from
    defaults(algo)              the ConfigDict of every default (configs/rl.py builds its
                                variants on it; ml_collections placeholders keep the optional
                                fields overridable by flags)

Sections with schemas of their own are validated by them and kept as read-only mappings
(ml_collections.FrozenConfigDict): `model` by model/config.py (ModelConfig.from_dict, and its
vocabulary against the tokenizer), `rl.algo` by rl/algorithms.py's registry (algo_from_config),
`sharding` by model/sharding.py (mesh syntax and rules); rl.critic is rl/critic.py's
CriticConfig. `tasks.difficulty` maps task domains to a level.

A field a config lacks takes the value old runs behaved with when it is listed in ADDED_FIELDS
(fields added after runs were recorded, so an old run directory's config.json still loads and
resumes: train/workdir.py reads the table), else its default; a field renamed since
(RENAMED_FIELDS: the task-domain fields, once named "families") loads from a recorded
config.json under its new name, and its old name on the command line is refused naming the
new one. An unknown field, or a value of the
wrong type or out of range, raises RunConfigError naming the dotted field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from model import quant
from model import sharding as shd
from model.config import ModelConfig
from model.hf import hf_config
from model.tokenizer import load_tokenizer
from rl.algorithms import PRESETS, algo_from_config, preset_fields
from rl.critic import CriticConfig
from sandbox.tasks.domains import generated_domains
from train.data import sft_domains, task_domains


class RunConfigError(ValueError):
    """A run config field is unknown, of the wrong type or out of range."""


# ----------------------------------------------------------------------------- field specs
def _f(kind, default, *, lo=None, hi=None, above=None, below=None, choices=None,
       optional=False, meaning=""):
    """A schema field: `kind` (int, float, bool, str, tuple: a tuple of numbers), its default,
    its range (lo <= v <= hi, above < v < below; hi may name a field of the same section) or
    choices, whether None is allowed, and what the values mean (quoted in errors)."""
    spec = dict(kind=kind, lo=lo, hi=hi, above=above, below=below, choices=choices,
                optional=optional, meaning=meaning)
    return dataclasses.field(default=default, metadata={"spec": spec})


_KIND_WORDS = {int: "an int", float: "a number", bool: "a bool", str: "a string",
               tuple: "a list of numbers"}


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _allowed(spec: dict, section: Mapping[str, Any], prefix: str) -> str:
    if spec["choices"] is not None:
        text = f"one of {tuple(spec['choices'])}"
    else:
        text = _KIND_WORDS[spec["kind"]]
        lo, hi, above, below = (spec[k] for k in ("lo", "hi", "above", "below"))
        hi = f"{prefix}{hi}={section.get(hi)!r}" if isinstance(hi, str) else hi
        if lo is not None and hi is not None:
            text += f" in [{_num(lo)}, {_num(hi)}]"
        elif above is not None and hi is not None:
            text += f" in ({_num(above)}, {_num(hi)}]"
        elif lo is not None and below is not None:
            text += f" in [{_num(lo)}, {_num(below)})"
        elif above is not None and below is not None:
            text += f" in ({_num(above)}, {_num(below)})"
        elif lo is not None:
            text += f" >= {_num(lo)}"
        elif above is not None:
            text += f" > {_num(above)}"
    if spec["optional"]:
        text += " or unset (None)"
    return text + (f" ({spec['meaning']})" if spec["meaning"] else "")


def _typed(v: Any, kind) -> tuple[bool, Any]:
    """(whether v is of `kind`, v as that kind: an int is a float where a float is asked)."""
    if kind is bool:
        return isinstance(v, bool), v
    if isinstance(v, bool):
        return False, v
    if kind is int:
        return isinstance(v, int), v
    if kind is float:
        return isinstance(v, (int, float)), float(v) if isinstance(v, (int, float)) else v
    if kind is str:
        return isinstance(v, str), v
    if kind is tuple:
        ok = isinstance(v, (tuple, list)) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        return ok, tuple(float(x) for x in v) if ok else v
    raise TypeError(kind)


def _check_value(v: Any, spec: dict, section: Mapping[str, Any], path: str, prefix: str) -> Any:
    if v is None and spec["optional"]:
        return None
    ok, v2 = _typed(v, spec["kind"])
    if ok and spec["choices"] is not None:
        ok = v2 in spec["choices"]
    if ok and spec["kind"] in (int, float):
        hi = spec["hi"]
        if isinstance(hi, str):
            hi = section.get(hi)
        ok = ((spec["lo"] is None or v2 >= spec["lo"]) and (hi is None or v2 <= hi)
              and (spec["above"] is None or v2 > spec["above"])
              and (spec["below"] is None or v2 < spec["below"]))
    if not ok:
        raise RunConfigError(f"{path} must be {_allowed(spec, section, prefix)}, got {v!r}")
    return v2


def _plain(d: Any) -> Any:
    if isinstance(d, RunConfig):
        return d.to_dict()
    if hasattr(d, "to_dict"):
        d = d.to_dict()
    if isinstance(d, Mapping):
        return {k: _plain(v) for k, v in d.items()}
    return d


def _frozen(d: Mapping[str, Any]) -> ml_collections.FrozenConfigDict:
    return ml_collections.FrozenConfigDict(dict(d))


def _unknown(values: Mapping[str, Any], names, prefix: str) -> None:
    unknown = sorted(set(values) - set(names))
    if unknown and (why := renamed(prefix + unknown[0])):
        raise RunConfigError(why)
    if unknown:
        raise RunConfigError(f"{prefix}{unknown[0]}: unknown field; valid fields: "
                             f"{sorted(names)}")


# ----------------------------------------------------------------------------- sections
@dataclasses.dataclass(frozen=True)
class TasksConfig:
    """The generated task domains RL and evaluation use (or a JSONL task file for RL prompts),
    with each split's size per domain. A domain is a task generator (sandbox/tasks/domains);
    how its tasks are scored is each Task's `family` (answer_check, python_tests, ...)."""

    domains: str = _f(str, "arithmetic,code,terminal",
                      meaning="comma-separated task domains (sandbox/tasks/domains)")
    task_file: str = _f(str, "", meaning="a JSONL task file replaces the generators for RL")
    train_per_domain: int = _f(int, 3000, lo=0)
    val_per_domain: int = _f(int, 64, lo=0)
    test_per_domain: int = _f(int, 200, lo=0)
    seed: int = _f(int, 1234, lo=0)
    # per-domain difficulty 1..3; 0 cycles through all levels. Arithmetic level 2 (three
    # numbers) is nearly unsolvable for the demo model after SFT, which leaves GRPO no signal in
    # that domain; level 1 is two numbers up to 70.
    difficulty: ml_collections.FrozenConfigDict = dataclasses.field(
        default=_frozen(dict(arithmetic=1, code=0, terminal=0)),
        metadata={"mapping": (int, 0)})


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """SFT on generated demonstrations (train/sft.py:run_sft). Batches hold one row width each
    (train/sft.py:sft_buckets): one-shot rows of seq_len tokens in batches of batch_size,
    multi-turn episodes of episode_seq_len (None: seq_len) in batches of episode_batch_size
    (None: batch_size); episode_share = the fraction of steps that are episode batches (None:
    in proportion to the examples). The weights of MTP, MoE balance and indexer KL are model
    fields (model.mtp.loss_weight, model.moe.aux_loss_coef, model.dsa.indexer_loss_weight),
    shared by SFT and RL."""

    steps: int = _f(int, 600, lo=0)
    batch_size: int = _f(int, 16, lo=1)
    seq_len: int = _f(int, 128, lo=1)
    imperfect_frac: float = _f(float, 0.4, lo=0.0, hi=1.0)
    lr: float = _f(float, 3e-3, above=0.0)
    warmup_steps: int = _f(int, 30, lo=0)
    weight_decay: float = _f(float, 0.01, lo=0.0)
    log_every: int = _f(int, 50, lo=1)
    checkpoint_every: int = _f(int, 500, lo=1)
    # DSA indexer dense warm-up before SFT (DeepSeek-V3.2): indexer only, everything else
    # frozen, dense attention, KL over every causal key; 0 skips it
    indexer_warmup_steps: int = _f(int, 100, lo=0)
    indexer_warmup_lr: float = _f(float, 1e-3, above=0.0)
    # DSA dense stage: the first dense_steps SFT steps attend densely with the indexer KL over
    # every causal key (train/sft.py:sft_dense_steps), the rest through the top-k
    dense_steps: int = _f(int, 0, lo=0, hi="steps")
    # QAT phase after SFT (train/sft.py:run_sft): qat_steps more steps of the same objective with
    # the routed experts fake-quantised to MXFP4 (model.moe.qat for this phase only), lr qat_lr;
    # checkpoints in <workdir>/sft/qat, which are then the SFT weights RL starts from; 0 skips it
    qat_steps: int = _f(int, 0, lo=0, meaning="0: no QAT phase")
    qat_lr: float = _f(float, 3e-4, lo=0.0)
    # the task domains SFT's demonstrations come from ("": tasks.domains, those RL and
    # evaluation use; train/data.py:sft_domains)
    domains: str = _f(str, "")
    episode_seq_len: int | None = _f(int, None, lo=1, optional=True, meaning="None: seq_len")
    episode_batch_size: int | None = _f(int, None, lo=1, optional=True,
                                        meaning="None: batch_size")
    episode_share: float | None = _f(float, None, above=0.0, below=1.0, optional=True,
                                     meaning="None: in proportion to the examples")

    def check(self, prefix: str) -> None:
        if self.qat_steps and not self.qat_lr > 0:
            raise RunConfigError(f"{prefix}qat_steps={self.qat_steps} needs {prefix}qat_lr > 0, "
                                 f"got {self.qat_lr!r}")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Multi-turn episodes (tasks of the "multistep" domain; rl/agent.py, rl/envs.py): rows of
    `width` tokens (prompt, the model's turns, the <tool_response> observations), at most
    `turn_tokens` per model turn, `max_turns` turns, command output cut to
    `observation_tokens`; format_penalty per malformed tool call. SFT renders demonstrations
    with the same settings. cache_turns: each turn continues the episode's decode cache and
    prefills only its new tokens (rl/agent.py; False: every turn re-reads its whole context)."""

    width: int = _f(int, 448, lo=1)
    turn_tokens: int = _f(int, 96, lo=1)
    max_turns: int = _f(int, 6, lo=1)
    observation_tokens: int = _f(int, 48, lo=0)
    command_timeout_s: float = _f(float, 5.0, above=0.0)
    format_penalty: float = _f(float, 0.0)
    cache_turns: bool = _f(bool, True)


# where RL's weights come from: this workdir's SFT checkpoint, a fresh init, or a released
# checkpoint (hf_dir, configs/rl.py:hf)
INIT_FROM = ("sft", "scratch", "hf")
SPECULATIVE = ("none", "mtp")  # rl/draws.py's decoders


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL loop (train/rl.py:run_rl); `algo` is rl/algorithms.py's (preset plus overrides),
    `critic` the value head of algorithms with one (rl.algo.needs_values: ppo; detached: the
    value loss does not train the policy trunk; hidden_dim 0: RMSNorm + linear head; critic
    lr = optim.lr * lr_scale)."""

    steps: int = _f(int, 100, lo=0)
    prompts_per_batch: int = _f(int, 8, lo=1)
    group_size: int = _f(int, 4, lo=1)
    max_prompt_len: int = _f(int, 72, lo=1)
    max_new_tokens: int = _f(int, 48, lo=1)
    # the trainer's log-probs use rl.temperature / top_k / top_p (the sampler's distribution)
    temperature: float = _f(float, 1.0, lo=0.0)
    top_p: float = _f(float, 1.0, above=0.0, hi=1.0)
    top_k: int = _f(int, 0, lo=0, meaning="0: no top-k cut")
    micro_batches: int = _f(int, 1, lo=1)
    # False sets the indexer KL weight to 0 for RL (the indexer stays frozen)
    train_indexer: bool = _f(bool, True)
    # "mtp": rollouts and evals draft rl.draft_tokens tokens with the MTP head and verify them
    # in one trunk pass (rl/speculative.py; same output distribution, greedy identical; slower
    # than plain decoding on CPU, see README)
    speculative: str = _f(str, "none", choices=SPECULATIVE)
    overlap_scoring: bool = _f(bool, True)
    log_every: int = _f(int, 1, lo=1)
    checkpoint_every: int = _f(int, 25, lo=1)
    keep_checkpoints: int = _f(int, 3, lo=1)
    # "sft": the SFT checkpoint in workdir/sft; "scratch": random init; "hf": a released
    # checkpoint's weights (the hf variant, its hf_dir)
    init_from: str = _f(str, "sft", choices=INIT_FROM)
    # "mxfp4": rollouts (and the evals during RL) sample with packed MXFP4 experts (the trained
    # weights quantised once per batch, model/quant.py; grouped MXFP4 matmul) while the trainer
    # keeps bf16/f32 (or QAT: model.moe.qat=True) experts; the sampler/trainer log-prob gap is
    # logged and corrected by TIS (rl.algo.tis_cap, required)
    rollout_experts: str = _f(str, "bf16", choices=("bf16", "mxfp4"))
    # the MTP term's weight in the RL step: None keeps model.mtp.loss_weight (the SFT
    # objective's); 0 skips the MTP forward in the RL step (a share of the step's time:
    # `python scripts/bench.py rl`), leaving the MTP block as SFT trained it
    mtp_loss_weight: float | None = _f(float, None, lo=0.0, optional=True)
    # the separate old-log-prob forward: "auto" skips it when the batch serves one on-policy
    # update and nothing needs old log-probs before the advantages (old = the step's own
    # log-probs, stop-gradient: the same numbers); "always" runs it (train/rollouts.py)
    old_logp_pass: str = _f(str, "auto", choices=("auto", "always"))
    # the reference policy's log-probs (KL term): "auto" computes them inside the train step's
    # program when the KL is in the loss (no separate forward to compile or run; the same
    # numbers up to rounding), "separate" runs them as a forward of their own (train/rollouts.py)
    ref_logp_pass: str = _f(str, "auto", choices=("auto", "separate"))
    draft_tokens: int = _f(int, 1, lo=1)
    # DAPO's dynamic sampling with refill (rl/pipeline.py:select_groups) when k > 1: each update
    # draws k batches' prompts, generates and scores all of them (k rollout calls of the usual
    # shape) and trains on one batch of groups, those whose rewards differ first; logs
    # informative_frac (of drawn groups) and kept_informative_frac
    oversample: int = _f(int, 1, lo=1, meaning="batches' prompts drawn per update")
    # p < 1: RL prompts drawn per generator template, each domain's draws split over its
    # templates in proportion to count ** p (1: every task equally likely; 0: every template
    # equally likely; rl/pipeline.py:template_shares); the domains' shares unchanged
    template_power: float = _f(float, 1.0, lo=0.0, hi=1.0)
    # RL's prompt order and rollout draws (unset: config.seed); RL reruns from the same SFT
    # weights under other draws (config.seed would start SFT over)
    seed: int | None = _f(int, None, lo=0, optional=True, meaning="None: config.seed")
    # share_prefix prefills each prompt once for its group (rl.sampler: same tokens, less
    # generation time); rollout_slots R > 0 decodes the batch in R slots (per
    # process), a finished row's slot taking the next queued row (row refill; 0 = all at once;
    # the same tokens too: each row draws by its id and positions)
    share_prefix: bool = _f(bool, True)
    rollout_slots: int = _f(int, 0, lo=0)
    # the update's programs (train step per row width, rollout-time forward, advantages)
    # compile on a thread behind the weights' loading, the first evaluation and rollouts
    # (single process; train/rl.py:precompile_updates); False compiles each at its first call
    precompile: bool = _f(bool, True)
    algo: ml_collections.FrozenConfigDict = dataclasses.field(
        default=None, metadata={"own_schema": "rl/algorithms.py"})
    critic: CriticConfig = dataclasses.field(default=CriticConfig(),
                                             metadata={"section": CriticConfig})
    agent: AgentConfig = dataclasses.field(default=AgentConfig(),
                                           metadata={"section": AgentConfig})


MU_DTYPES = ("float32", "bfloat16", "")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """RL's optimizer (rl/train_step.py:make_optimizer): AdamW, warmup then cosine to
    final_lr_frac * lr at total_steps (which follows rl.steps). Numerics: mu_dtype = Adam's
    first moment; master_dtype = an f32 master copy of every non-f32 parameter with the
    optimizer (both moments) in f32 (rl.train_step.with_master_copy; no effect on the f32 CPU
    models); "" for either: the parameter's dtype."""

    lr: float = _f(float, 1e-4, above=0.0)
    warmup_steps: int = _f(int, 5, lo=0)
    total_steps: int = _f(int, 100, lo=0)
    final_lr_frac: float = _f(float, 0.5, lo=0.0, hi=1.0)
    weight_decay: float = _f(float, 0.0, lo=0.0)
    b1: float = _f(float, 0.9, lo=0.0, below=1.0)
    b2: float = _f(float, 0.99, lo=0.0, below=1.0)
    eps: float = _f(float, 1e-8, above=0.0)
    clip_norm: float = _f(float, 1.0, lo=0.0, meaning="0: no clipping")
    mu_dtype: str = _f(str, "float32", choices=MU_DTYPES)
    master_dtype: str = _f(str, "float32", choices=("float32", ""))


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation during RL every `every` steps (0: never) on `val_tasks` val tasks,
    greedy or at `temperature`. scripts/demo.py compares the SFT and SFT+RL checkpoints each at
    its best sampling temperature: pass@1 and pass@k swept over `temperatures` on the val split
    (0 = greedy), then measured on the test split at the temperature with the best val pass@1 /
    pass@k. batch_prompts: prompts per generate call (x samples per task = rows), by default the
    RL batch's rows (prompts_per_batch x group_size), so eval and rollouts share one compiled
    sampler."""

    every: int = _f(int, 20, lo=0, meaning="0: no evaluation during RL")
    val_tasks: int = _f(int, 64, lo=1)
    temperature: float = _f(float, 1.0, lo=0.0)
    greedy: bool = _f(bool, True)
    batch_prompts: int = _f(int, 32, lo=1)
    temperatures: tuple = _f(tuple, (0.0, 0.5, 1.0))


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Sandbox scoring, per process (each process scores its own rollouts): workers = the local
    pool's size; remote = comma-separated server URLs (a fleet shared by every process);
    client_concurrency = requests in flight from this process to the fleet, 0 = derived:
    ceil(fleet_slots / process count) so that all processes together keep every fleet slot busy
    (fleet_slots = the fleet's total workers; 0 = unknown -> 16; docs/scaling.md). Time and
    memory limits are per task (Task.timeout_s / memory_mb, set by each task domain).
    reuse_verdicts: a completion identical to one of the last N scored for the same task takes
    its verdict without a sandbox run (sandbox/verifiers.py, "Reused verdicts"); 0 runs all."""

    workers: int = _f(int, 2, lo=1, meaning="the local sandbox pool's size")
    remote: str = _f(str, "")
    client_concurrency: int = _f(int, 0, lo=0, meaning="0: derived from fleet_slots")
    fleet_slots: int = _f(int, 0, lo=0, meaning="0: unknown")
    reuse_verdicts: int = _f(int, 8192, lo=0,
                             meaning="the last N scored (task, completion) pairs whose verdicts "
                                     "identical completions take; 0 = run every completion")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """MXFP4 (model/quant.py): the module groups that stay high precision wherever experts are
    MXFP4 (rollouts, scripts/evaluate.py --experts=mxfp4, scripts/export.py); only "experts" has
    an MXFP4 path, so it is the one group that may be left out (the default)."""

    high_precision: str = _f(
        str, "shared_experts,dense_ffn,router,attention,embeddings,lm_head,norms")

    def check(self, prefix: str) -> None:
        try:
            quant.parse_modules(self.high_precision)
        except ValueError as e:
            raise RunConfigError(f"{prefix}high_precision: {e}") from e


_SECTIONS = {"tasks": TasksConfig, "sft": SFTConfig, "rl": RLConfig, "optim": OptimConfig,
             "eval": EvalConfig, "sandbox": SandboxConfig, "quant": QuantConfig}

# fields added after runs were recorded -> the value runs recorded without them behaved with:
# a config (an old run directory's config.json) that lacks one loads with this value, and the
# resume check (train/workdir.py) takes its absence for this value
ADDED_FIELDS = {"rl.oversample": 1, "model.dsa.indexer_kl_chunk": 0,
                "model.kda.recurrent_max_len": 0, "rl.template_power": 1.0, "rl.seed": None,
                "sandbox.reuse_verdicts": 0}
# fields renamed: old dotted name -> new. A recorded config.json (a plain dict) with an old
# name loads under the new one (migrate); a --config flag or ConfigDict with one is refused,
# pointing to the new name
RENAMED_FIELDS = {"tasks.families": "tasks.domains", "sft.families": "sft.domains",
                  "tasks.train_per_family": "tasks.train_per_domain",
                  "tasks.val_per_family": "tasks.val_per_domain",
                  "tasks.test_per_family": "tasks.test_per_domain"}


def migrate(d: Mapping[str, Any]) -> dict:
    """A recorded config (config.json as a plain dict) with the renamed fields under their new
    names (RENAMED_FIELDS); a config holding both an old and a new name is refused."""
    d = _plain(d)
    for old, new in RENAMED_FIELDS.items():
        (sec, o), (_, n) = old.split("."), new.split(".")
        section = d.get(sec)
        if isinstance(section, dict) and o in section:
            if n in section:
                raise RunConfigError(f"{old}: renamed {new}, and the config has both")
            section = d[sec] = dict(section)
            section[n] = section.pop(o)
    return d


def renamed(path: str) -> str | None:
    """The error for a renamed field's old dotted name (None for any other name)."""
    if path in RENAMED_FIELDS:
        return (f"{path}: renamed {RENAMED_FIELDS[path]} (a task domain, not a scoring family): "
                f"use --config.{RENAMED_FIELDS[path]}")
    return None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A validated run config (RunConfig.from_config); sections are attributes
    (config.rl.agent.width). `model`, `rl.algo`, `sharding` and `tasks.difficulty` are
    read-only ConfigDicts (their own schemas validate them)."""

    name: str = _f(str, "grpo_tiny")
    seed: int = _f(int, 0, lo=0, meaning="SFT's and a fresh init's draws")
    workdir: str = _f(str, "runs/grpo_tiny")
    tokenizer: str = _f(str, "byte", meaning="a model/tokenizer.py name or a checkpoint directory")
    # a released checkpoint's directory (configs/rl.py:hf); None: the config has no such field
    hf_dir: str | None = _f(str, None, optional=True)
    model: ml_collections.FrozenConfigDict = dataclasses.field(
        default=None, metadata={"own_schema": "model/config.py"})
    tasks: TasksConfig = dataclasses.field(default=TasksConfig(),
                                           metadata={"section": TasksConfig})
    sft: SFTConfig = dataclasses.field(default=SFTConfig(), metadata={"section": SFTConfig})
    rl: RLConfig = dataclasses.field(default=RLConfig(), metadata={"section": RLConfig})
    optim: OptimConfig = dataclasses.field(default=OptimConfig(),
                                           metadata={"section": OptimConfig})
    eval: EvalConfig = dataclasses.field(default=EvalConfig(), metadata={"section": EvalConfig})
    sandbox: SandboxConfig = dataclasses.field(default=SandboxConfig(),
                                               metadata={"section": SandboxConfig})
    quant: QuantConfig = dataclasses.field(default=QuantConfig(),
                                           metadata={"section": QuantConfig})
    sharding: ml_collections.FrozenConfigDict = dataclasses.field(
        default=None, metadata={"own_schema": "model/sharding.py"})

    @classmethod
    def from_config(cls, config) -> RunConfig:
        """Validate a run config (a ConfigDict after flags, a dict, a recorded config.json, or a
        RunConfig, returned as it is) into a RunConfig. The schema's fields are checked first
        (nothing loads before), then a released checkpoint's model section is read (hf_dir:
        resolve_checkpoint, on a copy: `config` is left as it is), then the sections with
        schemas of their own: rl.algo, sharding, model against the tokenizer, the task
        domains. Raises RunConfigError (a ValueError) naming the field."""
        if isinstance(config, RunConfig):
            return config
        d = migrate(config) if isinstance(config, dict) else _plain(config)
        if not isinstance(d, dict):
            raise RunConfigError(f"a run config must be a ConfigDict or a dict, got "
                                 f"{type(config).__name__}")
        kw = _build(cls, d, "")
        for own in ("model", "sharding"):
            if d.get(own) is None:
                raise RunConfigError(f"{own}: required section is missing")
        if not isinstance(d["rl"].get("algo") if isinstance(d.get("rl"), dict) else None, dict):
            raise RunConfigError("rl.algo: required section is missing (configs/rl.py's "
                                 "algo_section gives every field of a preset)")
        _check_algo(d["rl"]["algo"])
        _check_sharding(d["sharding"])
        if kw["hf_dir"] is not None:
            cd = ml_collections.ConfigDict(d)
            resolve_checkpoint(cd)
            d = cd.to_dict()
            kw["tokenizer"] = d["tokenizer"]
        _check_model(d["model"], kw["tokenizer"])
        kw["model"] = _frozen(d["model"])
        kw["sharding"] = _frozen(d["sharding"])
        kw["rl"] = dataclasses.replace(kw["rl"], algo=_frozen(d["rl"]["algo"]))
        out = cls(**kw)
        _check_domains(out)
        return out

    def to_dict(self) -> dict:
        """The config as the JSON a run directory records (config.json): every field, the
        sections as nested dicts; hf_dir only where the config has it."""
        d = _to_dict(self)
        if self.hf_dir is None:
            del d["hf_dir"]
        return d

    def __contains__(self, name: str) -> bool:
        """Whether the config has the field or section `name` (helpers that take either a run
        config or one of its sections ask "sharding" in cfg)."""
        return name in self.__dataclass_fields__ and not (name == "hf_dir" and self.hf_dir is None)

    def rl_seed(self) -> int:
        """RL's seed: rl.seed, or config.seed when it is unset (SFT keeps config.seed;
        evaluation keys depend on neither)."""
        return self.seed if self.rl.seed is None else self.rl.seed


def _to_dict(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = _to_dict(v)
        elif isinstance(v, ml_collections.ConfigDict):
            v = v.to_dict()
        out[f.name] = v
    return out


def _build(cls, values: Mapping[str, Any], prefix: str) -> dict:
    """The keyword arguments of `cls` from `values`, every schema field checked (missing ones:
    ADDED_FIELDS' value, else the default); sections built recursively. Fields with their own
    schema are returned as given."""
    names = [f.name for f in dataclasses.fields(cls)]
    _unknown(values, names, prefix)
    kw = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if "own_schema" in f.metadata:
            kw[f.name] = None
            continue
        if f.name not in values:
            v = ADDED_FIELDS.get(path, f.default)
            kw[f.name] = v
            continue
        v = values[f.name]
        if "section" in f.metadata:
            sub = f.metadata["section"]
            if not isinstance(v, Mapping):
                raise RunConfigError(f"{path} must be a section (fields {names_of(sub)}), "
                                     f"got {v!r}")
            kw[f.name] = _section(sub, v, path + ".")
        elif "mapping" in f.metadata:
            kind, lo = f.metadata["mapping"]
            if not isinstance(v, Mapping):
                raise RunConfigError(f"{path} must map task domains to levels, got {v!r}")
            spec = dict(kind=kind, lo=lo, hi=None, above=None, below=None, choices=None,
                        optional=False, meaning="0: every level")
            kw[f.name] = _frozen({k: _check_value(x, spec, v, f"{path}.{k}", path + ".")
                                  for k, x in v.items()})
        else:
            kw[f.name] = _check_value(v, f.metadata["spec"], values, path, prefix)
    return kw


def names_of(cls) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(cls))


def _section(cls, values: Mapping[str, Any], prefix: str):
    if cls is CriticConfig:  # rl/critic.py's own checks
        _unknown(values, names_of(cls), prefix)
        try:
            return cls(**values)
        except ValueError as e:
            raise RunConfigError(f"{prefix[:-1]}: {e}") from e
    kw = _build(cls, values, prefix)
    if cls is RLConfig:
        kw["algo"] = None
    out = cls(**kw)
    if hasattr(out, "check"):
        out.check(prefix)
    return out


def _check_algo(algo: dict) -> None:
    algo_from_config(algo)


def _check_sharding(s: dict) -> None:
    _unknown(s, ("preset", "mesh", "rules"), "sharding.")
    shd.parse_mesh(s.get("mesh", ""))
    shd.rules_from_config(s)


def _check_model(model: dict, tokenizer: str) -> None:
    cfg = ModelConfig.from_dict(model)
    n = load_tokenizer(tokenizer).vocab_size
    if n > cfg.vocab_size:
        raise RunConfigError(f"tokenizer {tokenizer!r} has {n} ids but model.vocab_size is "
                             f"{cfg.vocab_size}: set --config.model.vocab_size={n}")


def _check_domains(config: RunConfig) -> None:
    task_domains(config)
    sft_domains(config)

    valid = generated_domains()
    for k in config.tasks.difficulty:
        if k not in valid:
            raise RunConfigError(f"tasks.difficulty.{k}: unknown task domain; valid: {valid}")


def resolve_checkpoint(config: ml_collections.ConfigDict) -> None:
    """A run from a released checkpoint (`config.hf_dir`, configs/rl.py:hf): its model section
    becomes the checkpoint's config.json translated (model.hf.hf_config; the run keeps its own
    dtype, param_dtype and scan_layers, the only fields configs/rl.py:hf gives it) and its
    tokenizer the checkpoint's tokenizer files and chat template; in place, on the ConfigDict
    (RunConfig.from_config calls it on a copy). A second call changes nothing. Without hf_dir:
    nothing to do."""

    if config.get("hf_dir") is None:
        return
    d = config.hf_dir
    if not d:
        raise RunConfigError("this config starts from a released checkpoint: set "
                             "--config.hf_dir=DIR (a directory in transformers' layout: "
                             "config.json, *.safetensors, tokenizer files; docs/checkpoints.md)")
    if not os.path.isdir(d):
        raise RunConfigError(f"hf_dir={d!r} is not a directory: give a checkpoint directory in "
                             "transformers' layout (config.json, *.safetensors, tokenizer files)")
    m = config.model
    cfg = hf_config(d, dtype=m.dtype, param_dtype=m.param_dtype).replace(
        scan_layers=bool(m.get("scan_layers", False)))
    with config.unlocked():
        config.model = ml_collections.ConfigDict(dataclasses.asdict(cfg))
        config.tokenizer = d


# ----------------------------------------------------------------------------- defaults
# AlgoConfig fields whose preset value may be None, with their type (ml_collections
# placeholders keep them overridable from the command line, e.g. --config.rl.algo.clip_c=3.0)
ALGO_OPTIONAL_TYPES = {"clip_c": float, "max_len": int, "tis_cap": float, "vf_clip": float,
                       "overlong_cache_len": int}


def algo_presets() -> list[str]:
    """The algorithm presets of rl/algorithms.py's registry."""

    return sorted(PRESETS)


def _node(d: Mapping[str, Any], types: Mapping[str, type]) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    for k, v in d.items():
        setattr(c, k, config_dict.placeholder(types[k]) if v is None else v)
    return c


def algo_section(name: str, rl: ml_collections.ConfigDict, **kw) -> ml_collections.ConfigDict:
    """Every AlgoConfig field of the preset `name` (so each one is overridable by a flag), with
    `kw` on top (kept when --config.rl.algo.name switches the preset, see
    rl.algorithms.algo_from_config); max_len follows rl.max_new_tokens and DAPO's overlong
    window (unused unless overlong_shaping is on) is a sixth of it, unless set themselves."""

    d = preset_fields(name)
    d.update(kw)
    c = _node(d, ALGO_OPTIONAL_TYPES)
    c.filled_from = name  # --config.rl.algo.name=<other preset> re-fills untouched fields
    c.max_len = rl.get_ref("max_new_tokens").identity()  # the generation budget (tokens)
    c.overlong_cache_len = rl.get_ref("max_new_tokens") // 6
    return c


def _defaults_node(cls) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if "own_schema" in f.metadata:
            continue
        if "section" in f.metadata:
            setattr(c, f.name, _defaults_node(f.metadata["section"]) if f.metadata["section"]
                    is not CriticConfig else ml_collections.ConfigDict(
                        dataclasses.asdict(f.default)))
        elif "mapping" in f.metadata:
            setattr(c, f.name, ml_collections.ConfigDict(f.default.to_dict()))
        elif f.default is None:
            spec = f.metadata["spec"]
            setattr(c, f.name, config_dict.placeholder(spec["kind"]))
        else:
            setattr(c, f.name, f.default)
    return c


def defaults(model: ml_collections.ConfigDict, sharding: ml_collections.ConfigDict
             ) -> ml_collections.ConfigDict:
    """The ConfigDict of every schema default with the given model and sharding sections
    (hf_dir left out: a variant that starts from a released checkpoint adds it). The caller
    adds rl.algo (algo_section) and the links between fields."""
    c = _defaults_node(RunConfig)
    del c["hf_dir"]
    c.model = model
    c.sharding = sharding
    return c
