"""Export a checkpoint as sharded safetensors (MXFP4 experts), import one back, or plan one.

    python3 scripts/export.py --mode=plan --config=configs/models.py:reference_2p8t
    python3 scripts/export.py --mode=export --config=configs/rl.py:smoke --checkpoint=sft \
        --out=runs/smoke/export --max_shard_mb=0.2        # after scripts/sft.py (same config)
    python3 scripts/export.py --mode=import --out=runs/smoke/export

plan: the shard plan (files, bytes per file, total) from `jax.eval_shape` alone, nothing
allocated; for reference_2p8t it is compared with the article's 1.56 TB in 96 shards.
export: the config's model restored from --checkpoint (sft | rl | an orbax directory of the
config's workdir layout) or, with --checkpoint=init, freshly initialised; experts are written as
MXFP4 (post-training quantised unless they already are), one shard at a time
(model/interchange.py). import: reads the export back one tensor at a time, rebuilds the model
config from config.json and prints parameter and expert byte counts.
Flags: --experts=mxfp4|bf16, --dtype=keep|bfloat16 (the non-expert tensors), --max_shard_mb.
"""

import _common  # noqa: F401  (sys.path, cache)
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:demo",
                                          "an RL config (its .model) or a model config")
_MODE = flags.DEFINE_enum("mode", "plan", ["plan", "export", "import"], "what to do")
_CKPT = flags.DEFINE_string("checkpoint", "rl", "export: sft | rl | init | a checkpoint dir")
_OUT = flags.DEFINE_string("out", "", "export / import directory")
_EXPERTS = flags.DEFINE_enum("experts", "mxfp4", ["mxfp4", "bf16"], "expert tensors format")
_DTYPE = flags.DEFINE_enum("dtype", "keep", ["keep", "bfloat16"], "other tensors' dtype")
_SHARD_MB = flags.DEFINE_float("max_shard_mb", 0.0, "max file size in MB (1e6 bytes); 0: "
                               "5000 for export, the article's 1.56e12/96 bytes for plan")

ARTICLE_BYTES = 1.56e12
ARTICLE_SHARDS = 96


def _model_config(config):
    from model.config import ModelConfig
    return ModelConfig.from_dict(config.model if "model" in config else config)


def plan(config) -> dict:
    import jax

    from model import interchange
    from model.transformer import Model

    cfg = _model_config(config)
    max_bytes = int(_SHARD_MB.value * 1e6) if _SHARD_MB.value else int(ARTICLE_BYTES /
                                                                          ARTICLE_SHARDS)
    abstract = jax.tree.map(lambda x: x, interchange._unbox(Model(cfg).abstract_init()))
    specs = interchange.export_specs(abstract, experts=_EXPERTS.value, dtype=_DTYPE.value)
    shards = interchange.plan_shards(specs, max_bytes)
    s = interchange.plan_summary(shards)
    sizes = s["bytes_per_file"]
    print(f"model {cfg.name}: {s['tensors']} tensors, experts {_EXPERTS.value}, other tensors "
          f"{_DTYPE.value}; max shard {max_bytes / 1e9:.3f} GB")
    print(f"  files {s['files']}, total {s['total_bytes'] / 1e12:.4f} TB "
          f"({s['total_bytes']} bytes): experts {s['expert_bytes'] / 1e12:.4f} TB, other "
          f"{s['other_bytes'] / 1e12:.4f} TB")
    print(f"  bytes per file: min {min(sizes) / 1e9:.3f} GB, max {max(sizes) / 1e9:.3f} GB, "
          f"last {sizes[-1] / 1e9:.3f} GB; largest tensor {s['largest_tensor'][0]} "
          f"{s['largest_tensor'][1] / 1e9:.3f} GB")
    if cfg.name == "reference_2p8t":
        print(f"  article: {ARTICLE_BYTES / 1e12:.2f} TB in {ARTICLE_SHARDS} shards: total "
              f"{s['total_bytes'] / ARTICLE_BYTES:.3f}x, files {s['files']} vs {ARTICLE_SHARDS}")
    return s


def export(config):
    import jax

    from model import interchange
    from model.quant import parse_modules
    from model.transformer import Model

    if not _OUT.value:
        raise app.UsageError("--out=DIR is required for --mode=export")
    from rl import loop

    cfg = _model_config(config)
    model = Model(cfg)
    if _CKPT.value == "init":
        variables = model.init(jax.random.key(config.get("seed", 0)))
    elif _CKPT.value == "sft":
        variables = loop.load_sft_variables(config, model)
    else:
        variables = loop.load_rl_variables(config, model,
                                           None if _CKPT.value == "rl" else _CKPT.value)
    hp = parse_modules(config.quant.high_precision) if "quant" in config else None
    max_bytes = int((_SHARD_MB.value or 5000) * 1e6)
    kw = {"high_precision": hp} if hp else {}
    s = interchange.export_safetensors(
        variables, cfg, _OUT.value, max_shard_bytes=max_bytes, experts=_EXPERTS.value,
        dtype=_DTYPE.value, on_shard=lambda i, p, n: print(f"  wrote {p} ({n} bytes)"), **kw)
    print(f"exported {s['tensors']} tensors in {s['files']} files, {s['total_bytes']} bytes "
          f"(experts {s['expert_bytes']}, other {s['other_bytes']}) to {_OUT.value}")


def do_import():
    from model import interchange, quant

    if not _OUT.value:
        raise app.UsageError("--out=DIR is required for --mode=import")
    cfg, variables = interchange.import_safetensors(_OUT.value)
    b = quant.expert_bytes(variables["params"])
    print(f"imported {cfg.name} (experts {cfg.moe.expert_format}): experts {b['experts']} "
          f"bytes ({b['expert_ratio_vs_bf16']:.4f} of bf16), other {b['other']} bytes")


def main(_):
    _common.setup_jax()
    if _MODE.value == "plan":
        plan(_CONFIG.value)
    elif _MODE.value == "export":
        export(_CONFIG.value)
    else:
        do_import()


if __name__ == "__main__":
    app.run(main)
