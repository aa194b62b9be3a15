"""Long-context retrieval benchmark: accuracy, decode-state bytes and speed by layout and length.

    python scripts/longctx.py --config configs/longctx.py          # full (run times: README)
    python scripts/longctx.py --config configs/longctx.py:smoke    # the same pipeline, smaller

Variants:
  full   4 layouts x 3 training seeds, 1500 steps at 32 tokens (the first 40% on the copy
         task, then mqar + needle), evaluated at 32..512 (16x), speed
         and live state bytes at 32..2048, the tiny model's 16K-token prefill memory (compiled
         memory analysis, 1K chunks vs one shot). Writes runs/longctx/longctx.json and .png.
  smoke  the same cells, smaller: 30 steps, 2 seeds (one-seed intervals are undefined), lengths
         32 and 128, 8 examples per cell, no 16K memory section. Checks the pipeline, not
         accuracy.

Layouts (model.layouts: name -> layer pattern and DSA overrides), all of one width and depth, all
trained with the same steps, batch, learning rate and data stream:
  kda     all KDA (linear attention, O(1) state)
  dsa     all DSA at a fixed top-k of 8 (RoPE; sparse after a dense warm-up of
          train.dense_warmup_frac of the steps)
  hybrid  KDA then DSA ("KD": at 2 layers the article's 3:1 "KKKD" does not fit), DSA with NoPE
          as in Kimi Linear (the KDA layer carries position)
  dense   all dense MLA attention (the DSA layer's dense path, RoPE): the upper bound
Any field can be overridden: --config.train.steps=600 --config.eval.lengths=64,128.
"""

import ml_collections

from configs import models


def _model() -> ml_collections.ConfigDict:
    """The shared small model: 2 layers, d_model 64, dense FFN (the layouts differ only in their
    attention; MoE routing is beside the point of this benchmark), no MTP."""
    c = models.get_config("test")
    c.name = "longctx"
    c.vocab_size = 64  # the tasks' vocabulary (scripts/longctx.py: Vocab)
    c.d_model = 64
    c.num_layers = 2
    c.max_seq_len = 1 << 15
    c.kda.update(dict(num_heads=2, head_dim=32))
    c.dsa.update(dict(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=16, v_head_dim=32, index_n_heads=2, index_head_dim=16,
                      index_rope_dim=8, index_topk=8, indexer_loss_weight=1.0))
    c.moe.update(dict(num_experts=0, dense_dim=128))
    c.mtp.depth = 0
    return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "full"
    if name not in ("full", "smoke"):
        raise ValueError(f"unknown longctx variant {name!r}; valid: ['full', 'smoke']")
    c = ml_collections.ConfigDict()
    c.name = name
    c.out_dir = f"runs/longctx{'' if name == 'full' else '_' + name}"
    c.model = _model()
    # name -> "pattern" plus DSA field overrides "field=value" (comma separated)
    c.layouts = ml_collections.ConfigDict(dict(
        kda="KK",
        dsa="DD",
        hybrid="KD;positions=nope",
        dense="DD;indexer_stage=dense_warmup,indexer_loss_weight=0.0",
    ))
    c.seeds = 3  # training seeds (init + data stream); intervals are over these
    c.task = ml_collections.ConfigDict(dict(
        n_keys=16, n_values=16,  # token ids: scripts/longctx.py Vocab (the rest is noise)
        mqar_pairs=4,  # key-value pairs hidden among noise tokens
        mqar_queries=4,  # of them, queried after the marker
        needle_depths=(0.1, 0.5, 0.9),  # needle position as a fraction of the context
    ))
    c.train = ml_collections.ConfigDict(dict(
        length=32, steps=1500, batch=32, lr=3e-3, warmup=100, weight_decay=0.01,
        dense_warmup_frac=0.2,  # DSA layouts: first fraction of steps on the dense path
        # first fraction of steps on the copy task (scripts/longctx.py copy_task): forms the
        # induction circuit the attention-only layouts cannot form from the sparse answer targets
        copy_frac=0.4,
    ))
    c.eval = ml_collections.ConfigDict(dict(
        lengths=(32, 64, 128, 256, 512), examples=48, batch=48, prefill_chunk=128,
    ))
    c.speed = ml_collections.ConfigDict(dict(
        lengths=(32, 128, 512, 2048), batch=4, decode_steps=32, prefill_chunk=256, repeats=2,
    ))
    c.memory = ml_collections.ConfigDict(dict(
        enabled=True, model="tiny", length=16384, chunk=1024,
    ))
    if name == "smoke":
        c.seeds = 2
        c.train.update(dict(steps=30, warmup=5, batch=8))
        c.eval.update(dict(lengths=(32, 128), examples=8, batch=8, prefill_chunk=64))
        c.speed.update(dict(lengths=(32, 128), batch=2, decode_steps=4, repeats=1))
        c.memory.enabled = False
    return c
