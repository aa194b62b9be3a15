"""RL post-training configs: SFT on generated demonstrations, then GRPO-family RL, then eval.

    python scripts/train_rl.py --config configs/rl.py:grpo_tiny              # RL only (needs an
                                                                             # SFT checkpoint)
    python scripts/demo.py --config configs/rl.py:demo                        # SFT+RL+eval, <=20 min
    python scripts/demo.py --config configs/rl.py:smoke                       # ~2 min
    ... --config.rl.algo.name=dapo --config.rl.steps=50 --config.model.d_model=96

Variants: demo (the README's main job on 2 CPU cores), smoke (the same pipeline, smaller),
grpo_tiny / dapo_tiny / gspo_tiny / drgrpo_tiny / rloo_tiny (algorithm presets on the tiny
model). Every knob is a field here; rl.algo is validated against rl/algorithms.py's registries.
"""

import ml_collections

from configs import models


def _algo(name: str, **kw) -> ml_collections.ConfigDict:
    d = {"name": name, "kl_placement": "loss", "kl_kind": "k3", "kl_coef": 0.05}
    if name in ("drgrpo", "dapo"):
        d["max_len"] = 48  # = rl.max_new_tokens (constant normaliser / overlong budget)
    if name == "dapo":
        d["overlong_cache_len"] = 8
    if name in ("rloo",):
        d["kl_placement"] = "reward"
    d.update(kw)
    return ml_collections.ConfigDict(d)


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
    # per-family difficulty 1..3; 0 cycles through all levels (arithmetic level 1 has too few
    # distinct tasks for these split sizes)
    c.tasks.difficulty = ml_collections.ConfigDict(dict(arithmetic=2, code=0, terminal=0))

    c.sft = ml_collections.ConfigDict(dict(
        steps=600, batch_size=16, seq_len=128, imperfect_frac=0.4, lr=3e-3, warmup_steps=30,
        weight_decay=0.01, log_every=50, checkpoint_every=500))  # MTP weight: model.mtp

    c.rl = ml_collections.ConfigDict(dict(
        steps=100, prompts_per_batch=8, group_size=4, max_prompt_len=72, max_new_tokens=48,
        temperature=1.0, top_p=1.0, top_k=0, micro_batches=1, mtp_loss_weight=0.1,
        overlap_scoring=True, log_every=1, checkpoint_every=25, keep_checkpoints=3,
        init_from="sft"))  # "sft": the SFT checkpoint in workdir/sft; "scratch": random init
    c.rl.algo = _algo(algo)

    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-4, warmup_steps=5, total_steps=100, final_lr_frac=0.5, weight_decay=0.0,
        b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0))

    c.eval = ml_collections.ConfigDict(dict(
        every=20, val_tasks=64, temperature=1.0, greedy=True, batch_prompts=100))
    c.sandbox = ml_collections.ConfigDict(dict(
        workers=2, timeout_s=5.0, memory_mb=256, remote=""))  # remote: comma-separated URLs
    return c


def demo() -> ml_collections.ConfigDict:
    c = _base("grpo")
    c.name = "demo"
    c.workdir = "runs/demo"
    return c


def smoke() -> ml_collections.ConfigDict:
    c = _base("grpo")
    c.name = "smoke"
    c.workdir = "runs/smoke"
    c.model = models.get_config("test")
    c.tasks.update(dict(train_per_family=200, val_per_family=8, test_per_family=16))
    c.sft.update(dict(steps=30, batch_size=16, log_every=10, checkpoint_every=15))
    c.rl.update(dict(steps=4, prompts_per_batch=4, group_size=2, max_new_tokens=24,
                     checkpoint_every=2))
    c.rl.algo = _algo("grpo")
    c.optim.total_steps = 4
    c.eval.update(dict(every=2, val_tasks=8))
    return c


VARIANTS = {"demo": demo, "smoke": smoke}
for _a in ("grpo", "dapo", "gspo", "drgrpo", "rloo"):
    VARIANTS[f"{_a}_tiny"] = (lambda a: lambda: _base(a))(_a)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "demo"
    if name not in VARIANTS:
        raise ValueError(f"unknown RL config variant {name!r}; valid: {sorted(VARIANTS)}")
    return VARIANTS[name]()
