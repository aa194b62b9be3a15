"""Export a checkpoint as sharded safetensors (MXFP4 experts), import one back, or plan one.

    python3 scripts/export.py --mode=plan --config=configs/models.py:reference_2p8t
    python3 scripts/export.py --mode=export --config=configs/rl.py:smoke --checkpoint=sft \
        --out=runs/smoke/export --max_shard_mb=0.2        # after scripts/sft.py (same config)
    python3 scripts/export.py --mode=import --out=runs/smoke/export
    python3 scripts/export.py --mode=hf --config=configs/rl.py:hf \
        --config.hf_dir=tests/model/hf_fixtures/kimi_chat --checkpoint=rl --out=runs/hf/export_hf

plan: the shard plan (files, bytes per file, total) from `jax.eval_shape` alone, nothing
allocated; for reference_2p8t it is compared with the article's 1.56 TB in 96 shards.
export: the config's model restored from --checkpoint (sft | rl | an orbax directory of the
config's workdir layout) or, with --checkpoint=init, freshly initialised; experts are written as
MXFP4 (post-training quantised unless they already are), one shard at a time
(model/interchange.py). import: reads the export back one tensor at a time, rebuilds the model
config from config.json and prints parameter and expert byte counts. hf: a run of a released
checkpoint (configs/rl.py:hf) written back in transformers' layout (model.hf.export_hf: the
trained parameters as they are, f32 or bf16 with --dtype=bfloat16, loadable by from_pretrained)
with the checkpoint's token ids and its tokenizer files beside the weights.
Flags: --experts=mxfp4|bf16, --dtype=keep|bfloat16 (the non-expert tensors), --max_shard_mb.
--dry_run validates the config and the flags (check_request) and exits without planning,
exporting or importing; a missing input (the checkpoint to export, the export to import) is
reported as a note with the command that makes it, not as an error. Flags that --mode does not
use are rejected rather than ignored: plan takes no --checkpoint/--out, import takes only --out
(the model config comes from the export's config.json).
"""

import os

import _common  # noqa: F401  (XLA flags before jax)
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:demo",
                                          "an RL config (its .model) or a model config")
_MODE = flags.DEFINE_enum("mode", "plan", ["plan", "export", "import", "hf"], "what to do")
_CKPT = flags.DEFINE_string("checkpoint", "rl", "export: sft | rl | init | a checkpoint dir")
_OUT = flags.DEFINE_string("out", "", "export / import directory")
_EXPERTS = flags.DEFINE_enum("experts", "mxfp4", ["mxfp4", "bf16"], "expert tensors format")
_DTYPE = flags.DEFINE_enum("dtype", "keep", ["keep", "bfloat16"], "other tensors' dtype")
_SHARD_MB = flags.DEFINE_float("max_shard_mb", 0.0, "max file size in MB (1e6 bytes); 0: "
                               "5000 for export, the article's 1.56e12/96 bytes for plan")
_DRY = flags.DEFINE_bool("dry_run", False, "only validate the config and flags (and say whether "
                         "the inputs exist), then exit without planning, exporting or importing")

ARTICLE_BYTES = 1.56e12
ARTICLE_SHARDS = 96


# the flags each --mode reads (--dry_run aside); giving another one is an error
MODE_FLAGS = {"plan": {"config", "experts", "dtype", "max_shard_mb"},
              "export": {"config", "checkpoint", "out", "experts", "dtype", "max_shard_mb"},
              "import": {"out"},
              "hf": {"config", "checkpoint", "out", "dtype"}}
CHECKPOINT_KINDS = ("sft", "rl", "init")


def _model_config(config):
    from model.config import ModelConfig
    if "model" in config:
        from train.run_config import resolve_checkpoint
        resolve_checkpoint(config)  # a released checkpoint's run: its model section
    return ModelConfig.from_dict(config.model if "model" in config else config)


def _config_cli(config_arg: str, overrides: dict) -> str:
    """The --config part of a command line: the config file and its --config.x=v overrides."""
    return " ".join([f"--config {config_arg}"]
                    + [f"--config.{k}={v}" for k, v in overrides.items()])


def _has_checkpoint(directory: str) -> int | None:
    """The newest committed step under an orbax checkpoint directory (None if there is none);
    reads only, never creates the directory."""
    if not os.path.isdir(directory):
        return None
    from rl.checkpoint import Checkpointer
    ckpt = Checkpointer(directory, keep=None, read_only=True)
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()


def check_request(config, *, mode: str, checkpoint: str, out: str, experts: str, dtype: str,
                  max_shard_mb: float, given: set, config_cli: str = "--config <the config>"
                  ) -> list[str]:
    """Validate what `--mode` would do with these flags, touching no device and writing
    nothing: the flags the mode uses (`given`: the flags set on the command line; one the mode
    does not read is an error, not ignored), the model config, the MXFP4 constraints and the
    high-precision list (export and plan), and for an RL config the checkpoint kind.
    Raises ValueError, saying what to change, on what cannot run. Returns notes: for
    export and import, whether the input exists (a missing one is a note naming the command
    that makes it, since a dry run may well precede it)."""
    from model import quant

    if mode not in MODE_FLAGS:
        raise ValueError(f"--mode must be one of {sorted(MODE_FLAGS)}, got {mode!r}")
    unused = sorted(set(given) - MODE_FLAGS[mode] - {"mode", "dry_run"})
    if unused:
        why = (" (import rebuilds the model config from the export's config.json)"
               if mode == "import" else "")
        raise ValueError(f"--mode={mode} does not use --{', --'.join(unused)}{why}: drop "
                             f"{'it' if len(unused) == 1 else 'them'}")
    if max_shard_mb < 0:
        raise ValueError(f"--max_shard_mb must be >= 0 (0: the default), got {max_shard_mb}")
    notes = []
    if mode == "import":
        if not out:
            raise ValueError("--out=DIR (an export of --mode=export) is required for "
                                 "--mode=import")
        from model.interchange import INDEX_FILE
        if os.path.exists(os.path.join(out, INDEX_FILE)):
            notes.append(f"export {out}: found ({INDEX_FILE})")
        else:
            notes.append(f"export {out}: not found (no {INDEX_FILE}); run scripts/export.py "
                         f"--mode=export --out={out} ... first")
        return notes

    cfg = _model_config(config)  # raises ValueError on an invalid model config
    hp = quant.parse_modules(config.quant.high_precision) if "quant" in config else         quant.DEFAULT_HIGH_PRECISION
    quantised = quant.check_high_precision(hp)
    if mode == "hf":
        from model.hf.convert import family_of
        family_of(cfg)  # CheckpointError (a ValueError) when no released layout holds this model
    elif experts == "mxfp4":
        if cfg.moe.num_experts == 0:
            notes.append(f"model {cfg.name} has no routed experts: --experts=mxfp4 quantises "
                         "nothing")
        elif "experts" not in quantised:
            raise ValueError("--experts=mxfp4 but config.quant.high_precision keeps the "
                                 "experts high precision: remove 'experts' from it or pass "
                                 "--experts=bf16")
        else:
            quant.mxfp4_config(cfg, hp)  # d_model and expert_dim multiples of 32
    notes.append(f"model {cfg.name}: " + (f"transformers' layout, tensors {dtype}" if mode == "hf"
                                           else f"experts {experts}, other tensors {dtype}"))
    if mode == "plan":
        return notes

    if not out:
        raise ValueError(f"--out=DIR is required for --mode={mode}")
    is_rl_config = "model" in config and "workdir" in config
    if checkpoint != "init" and not is_rl_config:
        raise ValueError(f"--checkpoint={checkpoint} restores a training run, which needs an "
                             "RL config (configs/rl.py:<variant>, with its workdir); a model "
                             "config can only be exported with --checkpoint=init")
    if checkpoint == "init":
        notes.append("checkpoint init: a freshly initialised model (seed "
                     f"{config.get('seed', 0)})")
    else:
        from train.weights import sft_checkpoint_dir
        if checkpoint == "sft":
            d, make = sft_checkpoint_dir(config), "scripts/sft.py"
        elif checkpoint == "rl":
            d, make = os.path.join(config.workdir, "rl", "checkpoints"), "scripts/train_rl.py"
        else:
            d, make = checkpoint, None
        step = _has_checkpoint(d)
        if step is not None:
            notes.append(f"checkpoint {d}: found (step {step})")
        elif make:
            notes.append(f"checkpoint {d}: not found; run {make} {config_cli} first")
        else:
            notes.append(f"checkpoint {d}: not found (not an orbax checkpoint directory of "
                         f"the config's layout; --checkpoint takes {'|'.join(CHECKPOINT_KINDS)} "
                         "or such a directory)")
    from model.interchange import INDEX_FILE
    if os.path.exists(os.path.join(out, INDEX_FILE)):
        notes.append(f"out {out}: holds an export; files of the same names are overwritten "
                     "and other *.safetensors there stop the export")
    return notes


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


def _restore(config, cfg):
    """The variables --checkpoint names: a fresh init (init), the run's SFT or RL weights, or an
    orbax directory of the run's layout."""
    import jax

    import train.weights
    from model.transformer import Model

    model = Model(cfg)
    if _CKPT.value == "init":
        return model.init(jax.random.key(config.get("seed", 0)))
    if _CKPT.value == "sft":
        return train.weights.load_sft_variables(config, model)
    return train.weights.load_rl_variables(config, model, None if _CKPT.value == "rl" else _CKPT.value)


def export(config):
    from model import interchange
    from model.quant import parse_modules

    cfg = _model_config(config)
    variables = _restore(config, cfg)
    hp = parse_modules(config.quant.high_precision) if "quant" in config else None
    max_bytes = int((_SHARD_MB.value or 5000) * 1e6)
    kw = {"high_precision": hp} if hp else {}
    s = interchange.export_safetensors(
        variables, cfg, _OUT.value, max_shard_bytes=max_bytes, experts=_EXPERTS.value,
        dtype=_DTYPE.value, on_shard=lambda i, p, n: print(f"  wrote {p} ({n} bytes)"), **kw)
    print(f"exported {s['tensors']} tensors in {s['files']} files, {s['total_bytes']} bytes "
          f"(experts {s['expert_bytes']}, other {s['other_bytes']}) to {_OUT.value}")


def export_hf(config):
    import shutil

    from model.hf import export_hf as write_hf
    from model.hf import token_ids
    from model.hf.tokenizer import TOKENIZER_FILES

    cfg = _model_config(config)
    variables = _restore(config, cfg)
    src = config.get("hf_dir") or None
    s = write_hf(cfg, variables, _OUT.value, dtype=None if _DTYPE.value == "keep" else _DTYPE.value,
                 extra=token_ids(src) if src else None)
    copied = [f for f in TOKENIZER_FILES if src and os.path.exists(os.path.join(src, f))]
    for f in copied:
        shutil.copy(os.path.join(src, f), os.path.join(_OUT.value, f))
    print(f"exported {s['tensors']} tensors in {s['files']} files ({s['bytes']} bytes) to "
          f"{_OUT.value} in transformers' layout; tokenizer files: {', '.join(copied) or 'none'}")


def do_import():
    from model import interchange, quant

    cfg, variables = interchange.import_safetensors(_OUT.value)
    b = quant.expert_bytes(variables["params"])
    print(f"imported {cfg.name} (experts {cfg.moe.expert_format}): experts {b['experts']} "
          f"bytes ({b['expert_ratio_vs_bf16']:.4f} of bf16), other {b['other']} bytes")


def _check_flags() -> list[str]:
    """check_request on this command line's flags."""
    given = {name for name in set().union(*MODE_FLAGS.values()) if flags.FLAGS[name].present}
    cli = _config_cli(config_flags.get_config_filename(flags.FLAGS["config"]),
                      config_flags.get_override_values(flags.FLAGS["config"]))
    return check_request(_CONFIG.value, mode=_MODE.value, checkpoint=_CKPT.value,
                         out=_OUT.value, experts=_EXPERTS.value, dtype=_DTYPE.value,
                         max_shard_mb=_SHARD_MB.value, given=given, config_cli=cli)


def main(_):
    if _DRY.value:  # orbax's informational log lines when a checkpoint is looked up
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        notes = _check_flags()
    except ValueError as e:
        raise SystemExit(f"scripts/export.py: {e}") from None
    if _DRY.value:
        print(f"--mode={_MODE.value}: OK")
        for n in notes:
            print(f"  {n}")
        return
    _common.setup_jax()
    if _MODE.value == "plan":
        plan(_CONFIG.value)
    elif _MODE.value == "export":
        export(_CONFIG.value)
    elif _MODE.value == "hf":
        export_hf(_CONFIG.value)
    else:
        do_import()


if __name__ == "__main__":
    app.run(main)
