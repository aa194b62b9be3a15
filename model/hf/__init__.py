"""Released checkpoints in and out: transformers' layouts <-> this model's (ModelConfig, variables).

    from model.hf import export_hf, import_hf, token_ids
    cfg, variables = import_hf("Kimi-Linear-48B-A3B-Instruct")          # config.json + safetensors
    cfg, variables = import_hf(d, dtype="bfloat16", scan_layers=True, mesh=mesh)  # onto a mesh
    cfg, variables = import_hf("DeepSeek-V3.2-Exp", drop_mtp=True)   # FP8 weights dequantised
    export_hf(cfg, variables, "out", extra=token_ids(d))   # loads with from_pretrained
    tok = load_tokenizer(d)      # tokenizer.json / tiktoken.model + the chat template

Covered: `model_type` "kimi_linear" (KDA + NoPE MLA + sigmoid-routed MoE with shared experts and
group-limited routing, dense first layers) and "deepseek_v32" (MLA + lightning indexer + MoE,
YaRN, FP8 block-scaled weights dequantised on load); model/hf/<model_type>.py lists how each
part maps onto this model's layer options. Parity with transformers' own classes is tested on
tiny random models whose fixtures scripts/hf_fixtures.py writes (tests/model/test_hf_*.py):
fp32 logits within 1e-4, 32 greedy tokens identical, prefill + decode through the cache equal
to the reference's full forward, a bf16 import within cosine 0.999 and top-1 agreement; export
then import gives the same bytes. Tokenizers and chat templates: model/hf/tokenizer.py and
model/hf/chat_template.py.

Streaming: every file header and the tensor set are checked before any tensor is read
(model/hf/safetensors_io.py: seek + read, one tensor at a time, no memory map); each recipe's
tensors are converted on the host and placed at once on their device or sharding, so host
memory holds one recipe (at most one layer's stacked experts), not the model. Export plans the
files from shapes, then writes each tensor as it is produced.

Errors: `CheckpointError` names the unsupported model_type or config field (and its value),
the missing / unexpected tensor, the wrong shape or dtype, or the corrupt file header.

Not covered: `glm5_next`; DeepSeek's MTP layers (refused, or left out with drop_mtp=True);
tied embeddings (this model scales a tied head by d_model**-0.5); MXFP4 expert export
(export_hf writes bf16/f32 experts). docs/checkpoints.md has the list.
"""

from model.hf.convert import FAMILIES, export_hf, hf_config, import_hf, token_ids
from model.hf.safetensors_io import CheckpointError
from model.hf.tokenizer import load_tokenizer

__all__ = ["FAMILIES", "CheckpointError", "export_hf", "hf_config", "import_hf",
           "load_tokenizer", "token_ids"]
