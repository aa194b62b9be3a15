"""RL post-training configs: SFT on generated demonstrations, then GRPO-family RL, then eval.

    python scripts/train_rl.py --config configs/rl.py:grpo_tiny              # RL only (needs an
                                                                             # SFT checkpoint)
    python scripts/demo.py --config configs/rl.py:demo                        # SFT+RL+eval
    python scripts/demo.py --config configs/rl.py:smoke                       # the same, smaller
    ... --config.rl.algo.name=dapo --config.rl.steps=50 --config.model.d_model=96

Variants: demo (the README's main job on 2 CPU cores: arithmetic, code and multi-step terminal
episodes in sandbox sessions), smoke (the same pipeline, smaller), agent (the episodes alone),
grpo_tiny / dapo_tiny / gspo_tiny / drgrpo_tiny / rloo_tiny / ppo_tiny (algorithm presets on the
tiny model; ppo also trains a value head, rl.critic). Every field, its default and its allowed
values are train/run_config.py's (RunConfig.from_config validates a config after its flags);
rl.algo is validated against rl/algorithms.py's registries.

Scale-out (docs/scaling.md): `sharding` holds the mesh and the logical-axis rules
(model.sharding.sharding_config; presets one_device, all_devices, eight_devices,
multihost_slice). The CPU variants above use one_device. Multi-device variants:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/train_rl.py \
        --config configs/rl.py:smoke_8dev --config.rl.init_from=scratch     # 8 fake CPU devices
    python scripts/train_rl.py --config configs/rl.py:small_8dev             # one 8-GPU host
    python scripts/train_rl.py --config configs/rl.py:reference \
        --check_devices=1024 --processes=128                                  # a pod's check

smoke_8dev is the smoke pipeline on an (data 2, fsdp 2, expert 2) mesh with expert-parallel
MoE (all_to_all); small_8dev the `small` model on the same mesh (bf16 compute, f32 params);
reference the reference_2p8t model on the multihost_slice preset (launch lines and their
memory: docs/scaling.md).
"""

import ml_collections

from configs import models
from model import sharding as shd
from train import run_config


def _algo(name: str, rl: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The algo section of the preset `name` (train/run_config.py:algo_section: every
    AlgoConfig field, max_len and DAPO's overlong window following rl.max_new_tokens) with this
    project's run choices on top: KL to the SFT policy in the loss (k3, 0.05) unless the
    algorithm folds it into the reward; truncated importance sampling against the sampler's
    log-probs (tis_cap 2: the behaviour-policy correction of the one-batch lookahead, see
    rl/train_step.py)."""
    kw = dict(kl_placement="loss", kl_kind="k3", kl_coef=0.05, tis_cap=2.0)
    if name == "rloo":
        kw["kl_placement"] = "reward"
    if name == "ppo":  # PPO-RLHF: per-token k1 KL folded into the GAE rewards
        kw.update(kl_placement="reward", kl_kind="k1")
    return run_config.algo_section(name, rl, **kw)


def _base(algo: str = "grpo") -> ml_collections.ConfigDict:
    """The schema's defaults (train/run_config.py, where every field is described) on the demo
    model and one device, the algorithm preset `algo`, and the fields that follow others."""
    c = run_config.defaults(models.get_config("demo"), shd.sharding_config("one_device"))
    c.name = f"{algo}_tiny"
    c.workdir = "runs/" + c.name
    c.rl.algo = _algo(algo, c.rl)
    c.optim.total_steps = c.rl.get_ref("steps").identity()  # follows --config.rl.steps
    # eval and rollouts share one compiled sampler: eval prompts per call x 1 sample = the RL
    # batch's rows
    c.eval.batch_prompts = c.rl.get_ref("prompts_per_batch") * c.rl.get_ref("group_size")
    return c


def _episodes(c: ml_collections.ConfigDict, domains: str) -> ml_collections.ConfigDict:
    """`domains` with multi-step terminal episodes (sandbox/tasks/domains/multistep.py level 1:
    two commands, the second needs what the first printed), played through Hermes tool calls in
    sandbox sessions: the tool-call tags as single tokens (model/tokenizer.py "byte_tools", the
    model's vocabulary sized to it), episode rows of rl.agent.width tokens (SFT: up to
    sft.episode_seq_len: the longest level-1 demonstration is 253 tokens), a model turn of at
    most rl.agent.turn_tokens (a level-1 tool call is <= 72 tokens)."""
    from model.tokenizer import load_tokenizer

    c.tokenizer = "byte_tools"
    c.model.vocab_size = load_tokenizer(c.tokenizer).vocab_size
    c.model.max_seq_len = max(c.model.max_seq_len, 512)
    c.tasks.domains = domains
    c.tasks.difficulty.multistep = 1
    c.rl.agent.update(dict(width=352, turn_tokens=80, max_turns=4))
    c.sft.episode_seq_len = 256
    return c


def demo() -> ml_collections.ConfigDict:
    c = _base("grpo")
    c.name = "demo"
    c.workdir = "runs/demo"
    # a higher lr with a weaker KL, for as many RL steps as the 20-minute budget holds: the
    # sweeps behind these values are in docs/results.md
    c.optim.lr = 3e-4
    c.rl.algo.kl_coef = 0.01
    c.rl.steps = 250
    # the terminal domain as multi-step episodes: 60% of the SFT steps are episode batches
    # (16 x 256 tokens), the rest one-shot (arithmetic and code). The skill episodes need,
    # copying a name the model read in a tool response, forms abruptly late in SFT, so SFT
    # gives episodes 720 of its 1200 steps (docs/results.md has the step counts tried)
    _episodes(c, "arithmetic,code,multistep")
    c.sft.update(dict(steps=1200, episode_share=0.6))
    # ... and whether it forms at all depends on the seed when SFT attends through the top-k from
    # the first step. SFT attends densely throughout (RL and sampling through the top-k; the
    # indexer learns the dense attention by KL over every key, so no separate warm-up)
    c.sft.dense_steps = c.sft.get_ref("steps").identity()
    c.sft.indexer_warmup_steps = 0
    # scoring is partly waiting on sandbox processes: 4 workers keep 2 cores busy (more do not
    # shorten an evaluation; scoring is deterministic, so the results do not depend on it)
    c.sandbox.workers = 4
    return c


def smoke() -> ml_collections.ConfigDict:
    c = _base("grpo")
    c.name = "smoke"
    c.workdir = "runs/smoke"
    c.model = models.get_config("test")
    c.tasks.update(dict(train_per_domain=200, val_per_domain=8, test_per_domain=16))
    c.sft.update(dict(steps=30, batch_size=16, log_every=10, checkpoint_every=15))
    c.model.dsa.indexer_loss_weight = 1.0  # as the demo: indexer warm-up, KL in SFT and RL
    c.sft.update(dict(indexer_warmup_steps=4))
    c.rl.update(dict(steps=4, prompts_per_batch=4, group_size=2, max_new_tokens=24,
                     checkpoint_every=2))
    c.eval.update(dict(every=2, val_tasks=8))
    return _episodes(c, "arithmetic,code,multistep")  # the demo's domains


def agent() -> ml_collections.ConfigDict:
    """The demo's multi-step terminal episodes alone (sandbox/tasks/domains/multistep.py level 1:
    the file to copy or count is only named inside another file or in grep's output) on the
    demo model: the demo's SFT (its three domains' demonstrations, 40% well-formed but wrong),
    then GRPO over episodes alone, played in sandbox sessions through Hermes tool calls
    (rl/agent.py), and evaluation on episodes.
        python scripts/demo.py --config configs/rl.py:agent"""
    c = demo()
    c.name = "agent"
    c.workdir = "runs/agent"
    # SFT is the demo's (its three domains, 1200 steps: the same weights, so a copy of
    # runs/demo/sft resumes here); RL and evaluation take the episodes alone. SFT on episodes
    # alone did not form their name copying on every host, where the demo's mix (one-shot
    # completions copy names and numbers from their prompts too) did (docs/results.md)
    c.sft.domains = c.tasks.domains
    c.tasks.domains = "multistep"
    c.rl.update(dict(steps=80))
    c.eval.update(dict(every=20, val_tasks=32))
    return c


def hf() -> ml_collections.ConfigDict:
    """Post-training a released checkpoint (docs/checkpoints.md): a directory in transformers'
    kimi_linear or deepseek_v32 layout with its tokenizer files and chat template. At start-up
    the model section becomes the checkpoint's config.json translated and the tokenizer its
    own (train/run_config.py:resolve_checkpoint); SFT starts from its weights, and so does RL
    (rl.init_from="hf"; "sft" continues from this workdir's SFT). The smoke pipeline's domains
    and sizes, with rows wide enough for a chat template.

        python scripts/sft.py --config configs/rl.py:hf --config.hf_dir=tests/model/hf_fixtures/kimi_chat
        python scripts/train_rl.py --config configs/rl.py:hf --config.hf_dir=tests/model/hf_fixtures/kimi_chat
        python scripts/evaluate.py --config configs/rl.py:hf --config.hf_dir=tests/model/hf_fixtures/kimi_chat --checkpoint=hf
    """
    c = smoke()
    c.name = "hf"
    c.workdir = "runs/hf"
    c.hf_dir = ""  # the checkpoint directory (required)
    # the model section is the checkpoint's; a run chooses only these three (any other
    # --config.model.* override is an unknown field, not silently replaced)
    c.model = ml_collections.ConfigDict(dict(dtype="float32", param_dtype="float32",
                                             scan_layers=False))
    c.sft.update(dict(indexer_warmup_steps=0, seq_len=256, episode_seq_len=512))
    c.rl.update(dict(init_from="hf", max_prompt_len=160))
    c.rl.agent.update(dict(width=640))
    return c


def smoke_8dev() -> ml_collections.ConfigDict:
    """The smoke pipeline on 8 devices (data 2, fsdp 2, expert 2) with expert-parallel MoE:
    runs on 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) and is the
    model of the two-process check (scripts/multihost_check.py), whose processes play their
    multi-turn episodes in lockstep (rl/agent.py)."""
    c = smoke()
    c.name = "smoke_8dev"
    c.workdir = "runs/smoke_8dev"
    c.model.moe.expert_parallel = "all_to_all"
    c.sharding = shd.sharding_config("eight_devices")
    return c


def small_8dev() -> ml_collections.ConfigDict:
    """The `small` model (16 layers, d_model 1024, 32 experts) on one 8-accelerator host:
    (data 2, fsdp 2, expert 2), expert-parallel MoE (all_to_all), bf16 compute with f32 params
    and f32 Adam moments; RL from a fresh init (rl.init_from="scratch"; after
    `python scripts/sft.py --config configs/rl.py:small_8dev`, --config.rl.init_from=sft starts
    from its weights)."""
    c = _base("grpo")
    c.name = "small_8dev"
    c.workdir = "runs/small_8dev"
    c.model = models.get_config("small")
    c.model.moe.expert_parallel = "all_to_all"
    c.model.remat = "full"
    c.sharding = shd.sharding_config("eight_devices")
    c.rl.init_from = "scratch"
    c.sandbox.workers = 8
    return c


def reference() -> ml_collections.ConfigDict:
    """reference_2p8t on a multi-host slice: fsdp=16,expert=8,tensor=8 (1024 devices: 128 nodes
    of 8 GPUs, one process per node; the TPU line of docs/scaling.md overrides the mesh and the
    batch). What makes it train and fit (planner numbers: docs/scaling.md section 4):
      * experts trained as bf16 with QAT (model.moe.qat: the MXFP4 export's forward) and sampled
        as packed MXFP4 (rl.rollout_experts; TIS corrects the remaining gap), so the rollouts'
        gathered expert weights are MXFP4 next to the train state;
      * 128 prompts x 4 = 512 rollout rows: 4 rows, one whole group, per process on 128 row
        blocks (the RL pipeline scores and groups per process);
      * 4 micro-batches: each update trains on 128 rows at a time (one sequence per device);
      * rows of 1024 prompt + 2048 generated tokens: the expert-parallel rows every MoE layer
        keeps into the backward grow with the row, and longer rows do not fit 141 GB (the TPU
        line, 95 GB chips, generates 1024).
    Check a launch line before renting the pod (add --device h200 for the planner's memory):
        python scripts/train_rl.py --config configs/rl.py:reference --check_devices=1024
        python scripts/plan.py --config configs/rl.py:reference --devices 1024 --device h200 \
            --batch 512 --seq 3072"""
    c = _base("grpo")
    c.name = "reference"
    c.workdir = "runs/reference"
    c.model = models.get_config("reference_2p8t")
    c.model.moe.expert_format = "bf16"  # trained: float experts through MXFP4 fake quantisation
    c.model.moe.qat = True
    c.model.moe.expert_parallel = "ragged_all_to_all"  # GPU/TPU (XLA:CPU lacks the collective)
    c.sharding = shd.sharding_config("multihost_slice")
    c.rl.update(dict(prompts_per_batch=128, group_size=4, max_prompt_len=1024,
                     max_new_tokens=2048, micro_batches=4))
    c.rl.rollout_experts = "mxfp4"
    c.sandbox.update(dict(workers=32))  # per host; or remote=<fleet URLs> with fleet_slots
    return c


VARIANTS = {"demo": demo, "smoke": smoke, "smoke_8dev": smoke_8dev, "small_8dev": small_8dev,
            "reference": reference, "agent": agent, "hf": hf}
for _a in run_config.algo_presets():
    VARIANTS[f"{_a}_tiny"] = (lambda a: lambda: _base(a))(_a)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "demo"
    if name not in VARIANTS:
        raise ValueError(f"unknown RL config variant {name!r}; valid: {sorted(VARIANTS)}")
    return VARIANTS[name]()
