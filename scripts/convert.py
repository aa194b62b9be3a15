"""Convert between a released checkpoint (transformers' layout) and this project's export format.

    python3 scripts/convert.py --from_hf tests/model/hf_fixtures/kimi_linear --out /tmp/kimi_own
    python3 scripts/convert.py --to_hf /tmp/kimi_own --out /tmp/kimi_hf \
        --like tests/model/hf_fixtures/kimi_linear
    python3 scripts/convert.py --from_hf tests/model/hf_fixtures/kimi_linear --out /tmp/x --dry_run

--from_hf DIR: model.hf.import_hf (config.json translated, every header and tensor checked, one
tensor at a time), then model.interchange.export_safetensors into --out (bf16/f32 experts as
imported, the ModelConfig in its config.json; what scripts/export.py --mode=import and the
training configs read). --to_hf DIR: model.interchange.import_safetensors of such an export
(packed MXFP4 experts are dequantised), then model.hf.export_hf into --out; --like HF_DIR copies
that checkpoint's token ids into config.json and its tokenizer files beside the weights.
--drop_mtp leaves out a checkpoint's MTP layers (refused otherwise).
--dtype float32|bfloat16: the parameters' dtype (from_hf) or the written tensors' (to_hf; default
the variables' own). --dry_run: every check of the conversion (config, headers, tensor names,
shapes and dtypes; for to_hf whether the config is expressible), then a summary; nothing is
written. On any error nothing is written either: the output directory is created only after the
input has been read in full.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import _common  # noqa: F401  (XLA flags before jax)

from model.hf.tokenizer import TOKENIZER_FILES  # noqa: E402


def _param_count(variables) -> int:
    import jax

    return sum(int(x.size) for x in jax.tree.leaves(variables.get("params", {})))


def from_hf(src: str, out: str, dtype: str, dry_run: bool, drop_mtp: bool = False) -> dict:
    from model import interchange
    from model.hf import convert as hfc
    from model.hf.safetensors_io import Checkpoint

    if dry_run:
        cfg = hfc.hf_config(src, dtype=dtype)
        raw, fam = hfc.read_config(src)
        skip = hfc.skipped_prefixes(src, cfg, drop_mtp)
        ckpt = Checkpoint(src)
        hfc.check_checkpoint(ckpt, fam.recipes(cfg), hfc.fp8_block_of(fam, raw), skip)
        return {"dry_run": True, "model": cfg.name, "layer_pattern": cfg.layer_pattern,
                "num_layers": cfg.num_layers, "tensors": len(ckpt.tensors),
                "bytes": sum(t.nbytes for t in ckpt.tensors.values()), "out": out}
    _check_empty(out)
    t0 = time.perf_counter()
    cfg, variables = hfc.import_hf(src, dtype=dtype, drop_mtp=drop_mtp)
    t1 = time.perf_counter()
    summary = interchange.export_safetensors(variables, cfg, out, experts="bf16")
    return {"model": cfg.name, "parameters": _param_count(variables),
            "import_s": round(t1 - t0, 2), "write_s": round(time.perf_counter() - t1, 2),
            "files": summary["files"], "bytes": summary["total_bytes"], "out": out}


def to_hf(src: str, out: str, dtype: str | None, like: str | None, dry_run: bool) -> dict:
    from model import interchange
    from model.hf import convert as hfc

    cfg = interchange.load_config(src)
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format="bf16", qat=False))
    fam = hfc.family_of(cfg)
    hf_cfg = fam.from_config(cfg)  # raises naming a field the layout cannot hold
    extra = hfc.token_ids(like) if like else None
    if dry_run:
        return {"dry_run": True, "model": cfg.name, "tensors": sum(
            len(r.hf) for r in fam.recipes(cfg.replace(scan_layers=False))),
            "architectures": hf_cfg["architectures"], "token_ids": extra, "out": out}
    _check_empty(out)
    cfg, variables = interchange.import_safetensors(src, experts="float")
    summary = hfc.export_hf(cfg, variables, out, dtype=dtype, extra=extra)
    copied = []
    for f in TOKENIZER_FILES if like else ():
        if os.path.exists(os.path.join(like, f)):
            shutil.copy(os.path.join(like, f), os.path.join(out, f))
            copied.append(f)
    return {**summary, "parameters": _param_count(variables), "copied": copied}


def _check_empty(out: str) -> None:
    if os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"--out {out} is not empty: convert into a new directory")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from_hf", help="a transformers checkpoint directory to import")
    src.add_argument("--to_hf", help="a scripts/export.py directory to write as transformers'")
    ap.add_argument("--out", required=True, help="output directory (new or empty)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--like", default=None,
                    help="to_hf: a checkpoint whose token ids and tokenizer files to carry over")
    ap.add_argument("--drop_mtp", action="store_true",
                    help="from_hf: leave out a checkpoint's MTP layers (otherwise refused)")
    ap.add_argument("--dry_run", action="store_true", help="check everything, write nothing")
    a = ap.parse_args(argv)
    from model.hf import CheckpointError

    try:
        if a.from_hf:
            if a.like:
                ap.error("--like is for --to_hf")
            res = from_hf(a.from_hf, a.out, a.dtype or "float32", a.dry_run, a.drop_mtp)
        else:
            res = to_hf(a.to_hf, a.out, a.dtype, a.like, a.dry_run)
    except (CheckpointError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
