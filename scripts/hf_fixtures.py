"""Reference fixtures and checks from transformers' own model classes (run in a venv with torch
and transformers, not the project's: the project's tests read the fixtures with numpy only).

    python scripts/hf_fixtures.py write --out tests/model/hf_fixtures
    python scripts/hf_fixtures.py verify --family kimi_linear --dir EXPORTED_DIR \\
        --fixture tests/model/hf_fixtures/kimi_linear
    python scripts/hf_fixtures.py big --out /tmp/kimi_1b          # ~1B-parameter random checkpoint
    python scripts/hf_fixtures.py big --family deepseek_v32 --out /tmp/dsv_1b   # ... FP8

`write` builds a tiny random model of each family with transformers' classes (fp32, CPU, eager
attention; every layer kind, MoE with a shared expert and group-limited routing, a dense first
layer), saves it with `save_pretrained` (config.json + model.safetensors) and beside it
reference.npz: `ids` [2,24] random tokens and `logits` [2,24,V] of the reference's full forward;
`prompt` [1,8] and `greedy` [1,32] its greedy continuation (argmax of a full forward per step),
`greedy_logits` [1,40,V] the full forward over prompt + continuation. Weights are drawn wider
than the families' init (std 0.02 makes every logit nearly equal) but not so wide that the
random model turns chaotic: at std 0.06 its logits spread with std 0.5 and rounding the weights
to bf16 keeps every logit row at cosine >= 0.9999; at std 0.15 that rounding alone moved one row
to cosine 0.68. Norm weights, the routers' correction biases and the gates' A_log / dt_bias are
random too, so a wrongly mapped tensor shows.

`verify` loads a directory written by this project's `export_hf` with `from_pretrained`, fails
on any missing or unexpected weight (output_loading_info), and compares its logits on the
fixture's `ids` with the fixture's (max abs difference), or with --expect's (an npz of `ids`
and `logits`, e.g. the engine's after training the imported model).

`big` writes a Kimi-Linear-shaped random checkpoint of about 1B parameters (bf16, sharded, as a
release is), or with --family deepseek_v32 a DeepSeek-V3.2-shaped one with FP8 layer weights
and block scales, for the import time and memory measurements (docs/checkpoints.md); nothing of
it is kept in the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

SEED = 0
VOCAB = 128


def kimi_linear_config(**over):
    from transformers import KimiLinearConfig

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, num_local_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2 + ["linear_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 4, rms_norm_eps=1e-5,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, initializer_range=0.02)
    kw.update(over)
    return KimiLinearConfig(**kw)


def deepseek_v32_config(**over):
    from transformers import DeepseekV32Config

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=8,
        first_k_dense_replace=1, rms_norm_eps=1e-6, max_position_embeddings=64,
        # YaRN as the released model has it (factor 40 over 4096 there): the 40 positions of
        # the greedy check reach past the original 16, so the scaled frequencies matter
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    kw.update(over)
    return DeepseekV32Config(**kw)


FAMILIES = {"kimi_linear": kimi_linear_config, "deepseek_v32": deepseek_v32_config}


def _model_class(family: str):
    from transformers import DeepseekV32ForCausalLM, KimiLinearForCausalLM

    return {"kimi_linear": KimiLinearForCausalLM, "deepseek_v32": DeepseekV32ForCausalLM}[family]


def randomise(model: torch.nn.Module, seed: int, std: float = 0.06) -> None:
    """Every parameter and buffer drawn at random (module docstring says why)."""
    g = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict())  # not the non-persistent buffers (rotary inv_freq)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or name not in saved:
                continue
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or "layernorm" in name:
                v = 1.0 + 0.2 * r
            elif leaf == "e_score_correction_bias":
                v = 0.1 * r
            elif leaf == "A_log":
                v = torch.log(torch.rand(p.shape, generator=g) * 15 + 1)
            elif leaf == "dt_bias":
                v = 0.5 * r - 2.0
            elif "embed_tokens" in name:
                v = r
            else:
                v = std * r
            p.copy_(v.to(p.dtype))


@torch.no_grad()
def full_logits(model, ids: np.ndarray) -> np.ndarray:
    out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=False)
    return out.logits.float().numpy()


@torch.no_grad()
def greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    """Greedy continuation by a full forward per step (no cache: the reference forward only)."""
    seq = prompt.copy()
    for _ in range(n):
        nxt = full_logits(model, seq)[:, -1].argmax(-1)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    return seq[:, prompt.shape[1]:]


def write(out: str, only: str | None = None) -> None:
    for family, make_config in FAMILIES.items():
        if only and family != only:
            continue
        torch.manual_seed(SEED)
        cfg = make_config()
        model = _model_class(family)._from_config(cfg, attn_implementation="eager",
                                                  dtype=torch.float32).eval()
        randomise(model, SEED)
        d = os.path.join(out, family)
        model.save_pretrained(d)
        rng = np.random.default_rng(SEED)
        ids = rng.integers(3, VOCAB, size=(2, 24)).astype(np.int32)
        prompt = rng.integers(3, VOCAB, size=(1, 8)).astype(np.int32)
        cont = greedy(model, prompt, 32).astype(np.int32)
        seq = np.concatenate([prompt, cont], axis=1)
        gen = model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=32,
                             do_sample=False, min_new_tokens=32).numpy()[:, 8:]
        np.savez_compressed(os.path.join(d, "reference.npz"), ids=ids,
                            logits=full_logits(model, ids), prompt=prompt, greedy=cont,
                            greedy_logits=full_logits(model, seq))
        for f in ("generation_config.json",):  # not read by the import
            if os.path.exists(os.path.join(d, f)):
                os.remove(os.path.join(d, f))
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"{family}: {sum(p.numel() for p in model.parameters())} parameters, "
              f"{size / 1e6:.2f} MB in {d}; reference generate() with its cache "
              f"{'equals' if (gen == cont).all() else 'DIFFERS FROM'} the full-forward greedy")


def verify(family: str, exported: str, fixture: str, expect: str | None = None) -> int:
    """Load an export with transformers and compare logits with the fixture's, or with
    `expect` (an .npz with `ids` and `logits`, e.g. this project's engine after training the
    imported model; 0: ok)."""
    import warnings

    cls = _model_class(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = cls.from_pretrained(exported, output_loading_info=True,
                                          attn_implementation="eager", dtype=torch.float32)
    model.eval()
    ref = np.load(expect or os.path.join(fixture, "reference.npz"))
    diff = float(np.abs(full_logits(model, ref["ids"]) - ref["logits"]).max())
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} or None
    print(json.dumps({"loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
                      "warnings": [str(w.message) for w in caught],
                      "max_abs_logit_diff": diff}, indent=1))
    return 0 if bad is None and not info.get("error_msgs") and diff <= 1e-4 else 1


def big(out: str) -> None:
    """~1B parameters in Kimi-Linear-48B-A3B's proportions (27 layers, KKKD, dense first layer,
    shared expert), random bf16, 2 GB shards."""
    cfg = kimi_linear_config(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=256,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        num_local_experts=48, num_experts_per_tok=8, n_group=1, topk_group=1,
        kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        linear_head_dim=64, linear_num_heads=16,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention"
                     for i in range(24)],
        mlp_layer_types=["dense"] + ["sparse"] * 23)
    torch.manual_seed(SEED)
    model = _model_class("kimi_linear")._from_config(cfg, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, max_shard_size="2GB")
    print(f"{n / 1e9:.3f}B parameters written to {out}")


def big_fp8(out: str) -> None:
    """~1B parameters in DeepSeek-V3.2's proportions (dense first layers, MLA + indexer, 8 of 64
    routed experts in 8 groups, YaRN), written as the release is: every Linear weight of the
    layers F8_E4M3 with 128 x 128 `weight_scale_inv` blocks, the rest bf16, 2 GB files."""
    cfg = deepseek_v32_config(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=256,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
        kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, index_n_heads=16, index_head_dim=64, index_topk=256,
        first_k_dense_replace=2, max_position_embeddings=16384,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    import shutil
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    model = _model_class("deepseek_v32")._from_config(cfg, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    tmp = tempfile.mkdtemp()
    model.save_pretrained(tmp, max_shard_size="2GB")  # the release's tensor names
    del model
    os.makedirs(out, exist_ok=True)
    tensors, files, size, weight_map = {}, [], 0, {}

    def flush():
        nonlocal tensors, size
        if tensors:
            name = f"part-{len(files) + 1:05d}.safetensors"
            save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in tensors})
            files.append(name)
        tensors, size = {}, 0

    for src in sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors")):
        with safe_open(os.path.join(tmp, src), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                quant = (t.dim() == 2 and ".layers." in name and "norm" not in name
                         and "mlp.gate." not in name and "weights_proj" not in name
                         and t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0)
                if quant:
                    o, i = t.shape
                    blocks = t.float().reshape(o // 128, 128, i // 128, 128)
                    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
                    q = (blocks / scale[:, None, :, None]).reshape(o, i)
                    new = {name: q.to(torch.float8_e4m3fn), name + "_scale_inv": scale}
                else:
                    new = {name: t.contiguous()}
                nb = sum(x.numel() * x.element_size() for x in new.values())
                if size + nb > 2e9:
                    flush()
                tensors.update(new)
                size += nb
    flush()
    total = len(files)
    renamed = {}
    for k, f in enumerate(files):
        final = f"model-{k + 1:05d}-of-{total:05d}.safetensors"
        os.rename(os.path.join(out, f), os.path.join(out, final))
        renamed[f] = final
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": {k: renamed[v] for k, v in
                                                   weight_map.items()}}, fh)
    with open(os.path.join(tmp, "config.json")) as fh:
        raw = json.load(fh)
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(raw, fh, indent=1)
    shutil.rmtree(tmp)
    print(f"{n / 1e9:.3f}B parameters written to {out} (FP8 layer weights)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--out", default="tests/model/hf_fixtures")
    w.add_argument("--family", choices=sorted(FAMILIES), default=None, help="default: all")
    v = sub.add_parser("verify")
    v.add_argument("--family", choices=sorted(FAMILIES), required=True)
    v.add_argument("--dir", required=True)
    v.add_argument("--fixture", required=True)
    v.add_argument("--expect", default=None, help="npz with ids and logits to compare with "
                   "instead of the fixture's")
    b = sub.add_parser("big")
    b.add_argument("--out", required=True)
    b.add_argument("--family", choices=sorted(FAMILIES), default="kimi_linear",
                   help="deepseek_v32: FP8 layer weights with block scales")
    a = ap.parse_args(argv)
    if a.cmd == "write":
        write(a.out, a.family)
    elif a.cmd == "verify":
        return verify(a.family, a.dir, a.fixture, a.expect)
    elif a.family == "deepseek_v32":
        big_fp8(a.out)
    else:
        big(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
