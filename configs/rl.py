"""RL post-training configs: SFT on generated demonstrations, then GRPO-family RL, then eval.

    python scripts/train_rl.py --config configs/rl.py:grpo_tiny              # RL only (needs an
                                                                             # SFT checkpoint)
    python scripts/demo.py --config configs/rl.py:demo                        # SFT+RL+eval
    python scripts/demo.py --config configs/rl.py:smoke                       # the same, smaller
    ... --config.rl.algo.name=dapo --config.rl.steps=50 --config.model.d_model=96

Variants: demo (the README's main job on 2 CPU cores: arithmetic, code and multi-step terminal
episodes in sandbox sessions), smoke (the same pipeline, smaller), agent (the episodes alone),
grpo_tiny / dapo_tiny / gspo_tiny / drgrpo_tiny / rloo_tiny / ppo_tiny (algorithm presets on the
tiny model; ppo also trains a value head, rl.critic). Every knob is a field here; rl.algo is
validated against rl/algorithms.py's registries.

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
from rl import algorithms

# Types of the AlgoConfig fields whose value may be None (ml_collections placeholders keep them
# overridable from the command line, e.g. --config.rl.algo.clip_c=3.0).
_OPTIONAL_TYPES = {"clip_c": float, "max_len": int, "tis_cap": float, "vf_clip": float,
                   "overlong_cache_len": int}


def _algo(name: str, rl: ml_collections.ConfigDict, **kw) -> ml_collections.ConfigDict:
    """Every AlgoConfig field of the preset `name` (so each one is overridable by a flag), with
    this project's run choices on top (kept when --config.rl.algo.name switches the preset, see
    rl.algorithms.algo_from_config): KL to the SFT policy in the loss (k3, 0.05) unless the
    algorithm folds it into the reward; truncated importance sampling against the sampler's
    log-probs (tis_cap 2: the behaviour-policy correction of the one-batch lookahead, see
    rl/train_step.py); max_len and DAPO's overlong window derived from rl.max_new_tokens (they
    follow an override of it unless set themselves)."""
    d = algorithms.preset_fields(name)
    d.update(kl_placement="loss", kl_kind="k3", kl_coef=0.05, tis_cap=2.0)
    if name == "rloo":
        d["kl_placement"] = "reward"
    if name == "ppo":  # PPO-RLHF: per-token k1 KL folded into the GAE rewards
        d.update(kl_placement="reward", kl_kind="k1")
    d.update(kw)
    c = ml_collections.ConfigDict()
    for k, v in d.items():
        setattr(c, k, ml_collections.config_dict.placeholder(_OPTIONAL_TYPES[k]) if v is None
                else v)
    c.filled_from = name  # --config.rl.algo.name=<other preset> re-fills untouched fields
    c.max_len = rl.get_ref("max_new_tokens").identity()  # the generation budget (tokens)
    # DAPO's soft overlong window (8 of 48 tokens); unused unless overlong_shaping is on
    c.overlong_cache_len = rl.get_ref("max_new_tokens") // 6
    return c


def _base(algo: str = "grpo") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = f"{algo}_tiny"
    c.seed = 0
    c.workdir = "runs/" + c.name
    c.model = models.get_config("demo")
    c.tokenizer = "byte"

    c.tasks = ml_collections.ConfigDict(dict(
        families="arithmetic,code,terminal",
        task_file="",  # a JSONL task file replaces the generators for RL when set
        train_per_family=3000, val_per_family=64, test_per_family=200, seed=1234))
    # per-family difficulty 1..3; 0 cycles through all levels. Arithmetic level 2 (three
    # numbers) is nearly unsolvable for the demo model (3.5% sampled pass@1 after SFT), which
    # leaves GRPO no signal in that domain; level 1 is two numbers up to 70.
    c.tasks.difficulty = ml_collections.ConfigDict(dict(arithmetic=1, code=0, terminal=0))

    # SFT batches hold one row width each (train/sft.py:sft_buckets): one-shot rows of seq_len
    # tokens in batches of batch_size, multi-turn episodes of episode_seq_len (None: seq_len) in
    # batches of episode_batch_size (None: batch_size); episode_share = the fraction of steps
    # that are episode batches (None: in proportion to the examples)
    c.sft = ml_collections.ConfigDict(dict(
        steps=600, batch_size=16, seq_len=128, imperfect_frac=0.4, lr=3e-3, warmup_steps=30,
        weight_decay=0.01, log_every=50, checkpoint_every=500,
        # DSA indexer dense warm-up before SFT (DeepSeek-V3.2): indexer only, everything else
        # frozen, dense attention, KL over every causal key; 0 skips it
        indexer_warmup_steps=100, indexer_warmup_lr=1e-3,
        # DSA dense stage: the first dense_steps SFT steps attend densely with the indexer KL
        # over every causal key (train/sft.py:sft_dense_steps), the rest through the top-k
        dense_steps=0,
        # QAT phase after SFT (train/sft.py:run_sft): qat_steps more steps of the same objective
        # with the routed experts fake-quantised to MXFP4 (model.moe.qat for this phase only),
        # lr qat_lr; checkpoints in <workdir>/sft/qat, which are then the SFT weights RL starts
        # from; 0 skips it
        qat_steps=0, qat_lr=3e-4,
        # the task families SFT's demonstrations come from ("": tasks.families, those RL and
        # evaluation use; train/data.py:sft_families)
        families=""))
    c.sft.episode_seq_len = ml_collections.config_dict.placeholder(int)
    c.sft.episode_batch_size = ml_collections.config_dict.placeholder(int)
    c.sft.episode_share = ml_collections.config_dict.placeholder(float)
    # the weights of MTP, MoE balance and indexer KL are model fields (model.mtp.loss_weight,
    # model.moe.aux_loss_coef, model.dsa.indexer_loss_weight), shared by SFT and RL

    c.rl = ml_collections.ConfigDict(dict(
        steps=100, prompts_per_batch=8, group_size=4, max_prompt_len=72, max_new_tokens=48,
        temperature=1.0, top_p=1.0, top_k=0, micro_batches=1, train_indexer=True,
        speculative="none", overlap_scoring=True, log_every=1, checkpoint_every=25, keep_checkpoints=3,
        init_from="sft"))  # "sft": the SFT checkpoint in workdir/sft; "scratch": random init;
    # "hf": a released checkpoint's weights (the hf variant, its hf_dir)
    # rl.rollout_experts="mxfp4": rollouts (and the evals during RL) sample with packed MXFP4
    # experts (the trained weights quantised once per batch, model/quant.py; grouped MXFP4
    # matmul) while the trainer keeps bf16/f32 (or QAT: model.moe.qat=True) experts; the
    # sampler/trainer log-prob gap is logged and corrected by TIS (rl.algo.tis_cap, required)
    c.rl.rollout_experts = "bf16"
    # the MTP term's weight in the RL step: None (default) keeps model.mtp.loss_weight (the SFT
    # objective's); 0 skips the MTP forward in the RL step (about 15% of the hybrid's step
    # time, benchmarks/rl_loop.py), leaving the MTP block as SFT trained it
    c.rl.mtp_loss_weight = ml_collections.config_dict.placeholder(float)
    # the separate old-log-prob forward: "auto" skips it when the batch serves one on-policy
    # update and nothing needs old log-probs before the advantages (old = the step's own
    # log-probs, stop-gradient: the same numbers); "always" runs it (train/rollouts.py)
    c.rl.old_logp_pass = "auto"
    # the reference policy's log-probs (KL term): "auto" computes them inside the train step's
    # program when the KL is in the loss (no separate forward to compile or run; the same
    # numbers up to rounding), "separate" runs them as a forward of their own (train/rollouts.py)
    c.rl.ref_logp_pass = "auto"
    # the trainer's log-probs use rl.temperature / top_k / top_p (the sampler's distribution);
    # rl.train_indexer=False sets the indexer KL weight to 0 for RL (the indexer stays frozen)
    # rl.speculative="mtp": rollouts and evals draft rl.draft_tokens tokens with the MTP head and
    # verify them in one trunk pass (rl/speculative.py; same output distribution, greedy
    # identical; slower than plain decoding on CPU, see README)
    c.rl.draft_tokens = 1
    # rollouts: share_prefix prefills each prompt once for its group (rl.sampler: same tokens,
    # ~2x faster generation on the demo shapes); rollout_slots R > 0 decodes the batch in R
    # slots (per process), a finished row's slot taking the next queued row (row refill; 0 =
    # all at once; the same tokens too: each row draws by its id and positions)
    # oversample k > 1: DAPO's dynamic sampling with refill (rl/pipeline.py:select_groups):
    # each update draws k batches' prompts, generates and scores all of them (k rollout calls of
    # the usual shape) and trains on one batch of groups, those whose rewards differ first;
    # logs informative_frac (of drawn groups) and kept_informative_frac
    c.rl.oversample = 1
    # template_power p < 1: RL prompts drawn per generator template, each domain's draws split
    # over its templates in proportion to count ** p (1: every task equally likely; 0: every
    # template equally likely; rl/pipeline.py:template_shares); the domains' shares unchanged
    c.rl.template_power = 1.0
    # rl.seed: RL's prompt order and rollout draws (unset: config.seed); RL reruns from the
    # same SFT weights under other draws (config.seed would start SFT over)
    c.rl.seed = ml_collections.config_dict.placeholder(int)
    c.rl.share_prefix = True
    c.rl.rollout_slots = 0
    # precompile: the update's programs (train step per row width, rollout-time forward,
    # advantages) compile on a thread behind the weights' loading, the first evaluation and
    # rollouts (single process; train/rl.py:precompile_updates); False compiles each at its
    # first call
    c.rl.precompile = True
    c.rl.algo = _algo(algo, c.rl)
    # the value head of algorithms with a critic (rl.algo.needs_values: ppo); see
    # rl/critic.py:CriticConfig. detached: the value loss does not train the policy trunk;
    # hidden_dim 0: RMSNorm + linear head; critic lr = optim.lr * lr_scale.
    c.rl.critic = ml_collections.ConfigDict(dict(detached=True, hidden_dim=0, lr_scale=10.0))
    # multi-turn episodes (tasks of the "multistep" family; rl/agent.py, rl/envs.py): rows of
    # `width` tokens (prompt, the model's turns, the <tool_response> observations), at most
    # `turn_tokens` per model turn, `max_turns` turns, command output cut to
    # `observation_tokens`; format_penalty per malformed tool call. SFT renders demonstrations
    # with the same settings. cache_turns: each turn continues the episode's decode cache and
    # prefills only its new tokens (rl/agent.py; False: every turn re-reads its whole context).
    c.rl.agent = ml_collections.ConfigDict(dict(
        width=448, turn_tokens=96, max_turns=6, observation_tokens=48, command_timeout_s=5.0,
        format_penalty=0.0, cache_turns=True))

    # numerics: mu_dtype = Adam's first moment; master_dtype = an f32 master copy of every
    # non-f32 parameter with the optimizer (both moments) in f32 (rl.train_step.with_master_copy;
    # no effect on the f32 CPU models); "" for either: the parameter's dtype
    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-4, warmup_steps=5, total_steps=100, final_lr_frac=0.5, weight_decay=0.0,
        b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0, mu_dtype="float32", master_dtype="float32"))
    c.optim.total_steps = c.rl.get_ref("steps").identity()  # follows --config.rl.steps

    c.eval = ml_collections.ConfigDict(dict(
        every=20, val_tasks=64, temperature=1.0, greedy=True, batch_prompts=32))
    # scripts/demo.py compares the SFT and SFT+RL checkpoints each at its best sampling
    # temperature: pass@1 and pass@k swept over these on the val split (0 = greedy), then
    # measured on the test split at the temperature with the best val pass@1 / pass@k
    c.eval.temperatures = (0.0, 0.5, 1.0)
    # prompts per generate call (x samples per task = rows) = the RL batch's rows
    # (prompts_per_batch x group_size), so eval and rollouts share one compiled sampler
    c.eval.batch_prompts = c.rl.get_ref("prompts_per_batch") * c.rl.get_ref("group_size")
    # sandbox scoring, per process (each process scores its own rollouts): workers = the local
    # pool's size; remote = comma-separated server URLs (a fleet shared by every process);
    # client_concurrency = requests in flight from this process to the fleet, 0 = derived:
    # ceil(fleet_slots / process count) so that all processes together keep every fleet slot
    # busy (fleet_slots = the fleet's total workers; 0 = unknown -> 16). docs/scaling.md.
    # Time and memory limits are per task (Task.timeout_s / memory_mb, set by each task domain).
    # reuse_verdicts: a completion identical to one of the last N scored for the same task takes
    # its verdict without a sandbox run (sandbox/verifiers.py, "Reused verdicts"); 0 runs all
    c.sandbox = ml_collections.ConfigDict(dict(
        workers=2, remote="", client_concurrency=0, fleet_slots=0, reuse_verdicts=8192))
    # MXFP4 (model/quant.py): the module groups that stay high precision wherever experts are
    # MXFP4 (rollouts, scripts/evaluate.py --experts=mxfp4, scripts/export.py); only "experts"
    # has an MXFP4 path, so it is the one group that may be left out (the default)
    c.quant = ml_collections.ConfigDict(dict(
        high_precision="shared_experts,dense_ffn,router,attention,embeddings,lm_head,norms"))
    # mesh + logical-axis rules (model/sharding.py); the CPU variants run on one device
    c.sharding = shd.sharding_config("one_device")
    return c


def _episodes(c: ml_collections.ConfigDict, families: str) -> ml_collections.ConfigDict:
    """`families` with multi-step terminal episodes (sandbox/tasks/domains/multistep.py level 1:
    two commands, the second needs what the first printed), played through Hermes tool calls in
    sandbox sessions: the tool-call tags as single tokens (model/tokenizer.py "byte_tools", the
    model's vocabulary sized to it), episode rows of rl.agent.width tokens (SFT: up to
    sft.episode_seq_len: the longest level-1 demonstration is 253 tokens), a model turn of at
    most rl.agent.turn_tokens (a level-1 tool call is <= 72 tokens)."""
    from model.tokenizer import load_tokenizer

    c.tokenizer = "byte_tools"
    c.model.vocab_size = load_tokenizer(c.tokenizer).vocab_size
    c.model.max_seq_len = max(c.model.max_seq_len, 512)
    c.tasks.families = families
    c.tasks.difficulty.multistep = 1
    c.rl.agent.update(dict(width=352, turn_tokens=80, max_turns=4))
    c.sft.episode_seq_len = 256
    return c


def demo() -> ml_collections.ConfigDict:
    c = _base("grpo")
    c.name = "demo"
    c.workdir = "runs/demo"
    # measured on one SFT checkpoint (100 GRPO steps, sampled pass@1 on 200 held-out tasks per
    # domain): lr 1e-4 / kl 0.05 gave code +11, terminal +5; lr 3e-4 / kl 0.01 code +23,
    # terminal +9. 250 RL steps fit the 20-minute budget; on one SFT checkpoint they gave
    # arithmetic +19.0 (pass@4 +10.0) against +15.5 (+6.0) at 130 steps, code and multistep as
    # at 130 (docs/results.md)
    c.optim.lr = 3e-4
    c.rl.algo.kl_coef = 0.01
    c.rl.steps = 250
    # the terminal domain as multi-step episodes: 60% of the SFT steps are episode batches
    # (16 x 256 tokens), the rest one-shot (arithmetic and code). The skill episodes need,
    # copying a name the model read in a tool response, forms abruptly late in SFT, and when
    # depends on the machine's float rounding. Measured (README): with 400 episode steps the
    # model does not yet copy the name (greedy episode success 1 of 21 val tasks); 600 of 900
    # steps gave 66% greedy / 6.9% sampled; 600 of 1000 gave 86.5% / 10.4% on one machine and
    # 9.4% greedy on val on another (an AVX-512 host: names copied with a character or two
    # wrong), where 720 of 1200 gave 98.4%
    _episodes(c, "arithmetic,code,multistep")
    c.sft.update(dict(steps=1200, episode_share=0.6))
    # ... and whether it forms at all depended on the seed where SFT attended through the top-k
    # from the first step (this machine: seed 0 1.6%, seed 1 90.6% greedy on val). SFT attends
    # densely throughout (RL and sampling through the top-k; the indexer learns the dense
    # attention by KL over every key, so no separate warm-up): seeds 0 and 1 95.3% (README, "Agents")
    c.sft.dense_steps = c.sft.get_ref("steps").identity()
    c.sft.indexer_warmup_steps = 0
    # scoring is partly waiting on sandbox processes: on 2 cores a test evaluation (600 tasks x
    # 4 samples at T=1) took 90 s with 2 workers, 68 s with 4 and the same with 6 (identical
    # results: scoring is deterministic)
    c.sandbox.workers = 4
    return c


def smoke() -> ml_collections.ConfigDict:
    c = _base("grpo")
    c.name = "smoke"
    c.workdir = "runs/smoke"
    c.model = models.get_config("test")
    c.tasks.update(dict(train_per_family=200, val_per_family=8, test_per_family=16))
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
    # alone formed their name copying on one host after 600 steps, but not on another (0 of 64
    # val episodes after 600 or 900 dense steps), where the demo's mix (720 episode batches
    # beside 480 one-shot ones, whose completions copy names and numbers from their prompts)
    # formed it at 95% (docs/results.md)
    c.sft.families = c.tasks.families
    c.tasks.families = "multistep"
    c.rl.update(dict(steps=80))
    c.eval.update(dict(every=20, val_tasks=32))
    return c


def hf() -> ml_collections.ConfigDict:
    """Post-training a released checkpoint (docs/checkpoints.md): a directory in transformers'
    kimi_linear or deepseek_v32 layout with its tokenizer files and chat template. At start-up
    the model section becomes the checkpoint's config.json translated and the tokenizer its
    own (train/models.py:resolve_checkpoint); SFT starts from its weights, and so does RL
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
      * 4 micro-batches: each update trains on 128 rows at a time (one sequence per device).
    Check a launch line before renting the pod (add --device h200 for the planner's memory):
        python scripts/train_rl.py --config configs/rl.py:reference --check_devices=1024
        python scripts/plan.py --config configs/rl.py:reference --devices 1024 --device h200 \
            --batch 512 --seq 4096"""
    c = _base("grpo")
    c.name = "reference"
    c.workdir = "runs/reference"
    c.model = models.get_config("reference_2p8t")
    c.model.moe.expert_format = "bf16"  # trained: float experts through MXFP4 fake quantisation
    c.model.moe.qat = True
    c.model.moe.expert_parallel = "ragged_all_to_all"  # GPU/TPU (XLA:CPU lacks the collective)
    c.sharding = shd.sharding_config("multihost_slice")
    c.rl.update(dict(prompts_per_batch=128, group_size=4, max_prompt_len=1024,
                     max_new_tokens=3072, micro_batches=4))
    c.rl.rollout_experts = "mxfp4"
    c.sandbox.update(dict(workers=32))  # per host; or remote=<fleet URLs> with fleet_slots
    return c


VARIANTS = {"demo": demo, "smoke": smoke, "smoke_8dev": smoke_8dev, "small_8dev": small_8dev,
            "reference": reference, "agent": agent, "hf": hf}
for _a in ("grpo", "dapo", "gspo", "drgrpo", "rloo", "ppo"):
    VARIANTS[f"{_a}_tiny"] = (lambda a: lambda: _base(a))(_a)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "demo"
    if name not in VARIANTS:
        raise ValueError(f"unknown RL config variant {name!r}; valid: {sorted(VARIANTS)}")
    return VARIANTS[name]()
