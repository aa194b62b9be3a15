"""Block sizes for the DSA Pallas kernels: one frozen config per call, one heuristics function.

Two kernel flavours differ where the backends differ:

  "gpu" (Triton lowering; also what CPU interpret mode runs by default)
      selected kv rows are gathered with a vector index load ``kv_ref[idx, :]`` (pointer
      arithmetic); every loaded tile must have a power-of-two number of elements, so the wrapper
      pads heads to >= 16 (tl.dot's minimum M) and channel groups to powers of two.
  "tpu" (Mosaic lowering)
      Mosaic has no vector gather from VMEM rows, so the kernel keeps kv in HBM (``pl.ANY``),
      reads the selected indices from SMEM and issues one row DMA per index into a
      double-buffered VMEM scratch; lane dims need no power-of-two padding.

CPU has no compiled Pallas: kernels run with ``interpret=True`` (tests); ``backend`` can still
be forced to "tpu" there so the DMA flavour is checked in interpret mode. ``get_config`` picks
interpret tiles when interpreting and each flavour's compiled tiles otherwise (``interpret=``),
whatever the host: the compiled tiles obey the Mosaic block rules / Triton's dot minimum, and
tests/pallas_kernels/test_lowering.py lowers both flavours for "tpu" / "cuda" from a CPU host.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import backend as _backend

__all__ = ["DSABlockConfig", "get_config", "default_backend"]


@dataclasses.dataclass(frozen=True)
class DSABlockConfig:
    """Frozen block sizes (hashable: passed as a static argument).

    backend:       "gpu" (Triton gather flavour) or "tpu" (Mosaic DMA flavour).
    idx_block_t:   indexer kernel, queries per program.
    idx_block_s:   indexer kernel, keys per program (the [block_t, block_s] f32 output tile).
    attn_block_k:  sparse attention, selected rows gathered per inner (online-softmax) step.
    bwd_chunk_t:   backward, tokens per scatter-add chunk: bounds the f32 [B,chunk,K,D] per-token
                   dkv contributions the backward kernel emits before they are summed into dkv.
    num_warps, num_stages: Triton only.
    """

    backend: str = "gpu"
    idx_block_t: int = 64
    idx_block_s: int = 128
    attn_block_k: int = 64
    bwd_chunk_t: int = 1024
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.backend not in ("gpu", "tpu"):
            raise ValueError(f"backend must be 'gpu' or 'tpu', got {self.backend!r}")
        for f in ("idx_block_t", "idx_block_s", "attn_block_k", "bwd_chunk_t"):
            v = getattr(self, f)
            if v < 1:
                raise ValueError(f"{f} must be >= 1, got {v}")
        if self.backend == "gpu":
            for f in ("idx_block_t", "idx_block_s", "attn_block_k"):
                v = getattr(self, f)
                if v & (v - 1):
                    raise ValueError(f"{f} must be a power of two on the gpu flavour, got {v}")


def default_backend() -> str:
    """Kernel flavour for the current JAX backend ('gpu' on CPU-interpret: cheaper to interpret)."""
    return _backend.default_kernel(cpu_default="gpu")


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def get_config(*, t: int, s: int, topk: int | None = None, heads: int | None = None,
               dim: int | None = None, backend: str | None = None,
               interpret: bool | None = None) -> DSABlockConfig:
    """Heuristic block sizes for a problem shape (the only place tuning lives).

    t, s: query / key lengths; topk: selected keys per query; heads, dim: attention heads and
    per-head channels (bound the per-program working set: H x attn_block_k f32 logits and an
    attn_block_k x dim gathered tile). backend: kernel flavour ("gpu" | "tpu", also "cuda"),
    None -> the running platform's. interpret: pick interpret-mode tiles; None -> on CPU.
    """
    backend = default_backend() if backend is None else _backend.normalize_kernel(backend)
    if interpret is None:
        interpret = _backend.platform() == "cpu"
    if interpret:
        # Interpret mode: cost grows with grid steps and loop trips, not tile size.
        bt, bs, bk = 64, 128, 64
    elif backend == "tpu":
        bt, bs, bk = 128, 512, 128  # (8,128)-aligned output tiles, MXU-sized gathers
    else:
        bt, bs, bk = 64, 128, 64
        if dim is not None and dim > 256:
            bk = 32  # 32 x 576 bf16 rows plus H x 512 f32 acc per program stays in registers/smem
    if backend == "tpu" and not interpret:
        # Mosaic block rule: the [block_t, block_s] score tile's lane dim must be a multiple of
        # 128 (or all of the padded S), its sublane dim a multiple of 8 (16: bf16 inputs pack
        # two rows per sublane); S and T are zero-padded to the blocks.
        bt = min(bt, max(16, _pow2_floor(t)))
        bs = min(bs, -(-s // 128) * 128)
    else:  # compiled Triton: every dot operand dim >= 16 (interpret: anything goes)
        bt = min(bt, max(8 if interpret else 16, _pow2_floor(t)))
        bs = min(bs, max(16, _pow2_floor(s)))
    if topk is not None:
        bk = min(bk, max(16, _pow2_floor(topk)))
    # Backward chunk: keep chunk * topk * dim f32 contributions around 256 MiB.
    per_tok = (topk or 2048) * (dim or 576) * 4
    chunk = max(1, min(t, (256 << 20) // per_tok))
    return DSABlockConfig(backend=backend, idx_block_t=bt, idx_block_s=bs, attn_block_k=bk,
                          bwd_chunk_t=chunk, num_warps=4 if (dim or 0) <= 256 else 8,
                          num_stages=2)
