"""attention flashinfer_v1 (library-backed): FlashInfer's paged attention kernels behind the
registry's `attention` contract.

What it is: flashinfer-python 0.7.0's `BatchDecodeWithPagedKVCacheWrapper` (tensor cores: Beam's
6 query heads per KV head fill an MMA tile) for decode steps (one query per page-table row) and
`BatchPrefillWithPagedKVCacheWrapper` (fa2, causal, aligned bottom-right) otherwise, over the
layer's pages in FlashInfer's "NHD" layout ([P, page, Hkv, D], as given). The contract's
per-token description becomes FlashInfer's CSR page lists on the host: a row's kv range starts at
its first page (kv_base) and ends at its last query (kv length = last position + 1 - kv_base),
and the window is FlashInfer's `window_left = window - 1` (full layers: a window wider than any
row, so both layer kinds share one JIT module). Every call plans on the host (it reads the
metadata back, a sync), so the variant runs eagerly: inside CUDA-graph capture that read fails
and the runner decodes eagerly, saying why. `plan(...)` gives a planned callable for callers
that plan outside a graph (benchmarks).

How it rounds: NOT at the reference's rounding points. Scores and the online-softmax state stay
FP32 (no BF16 score or scaled-score rounding), probabilities are cast to BF16 only as the P.V MMA
operand, relative to the running max, and the output is rounded once. It is closer to FP64
attention than the eager reference, and the `attention` op's verifier finds it closer to the
`fp32_probs` / `fp32_scores` near misses than to the reference: it is recorded for comparison and
explicit use (`--attention-backend flashinfer`), not for the tuned set.
Imported lazily, on CUDA only; kernels JIT-compile on first use (~20-35 s each on an H200) into
FlashInfer's cache directory.
"""

from __future__ import annotations

import torch

LANGUAGE = "library"
LIBRARY = "flashinfer-python==0.7.0"
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 256 * 2**20  # split-kv partial outputs; FlashInfer recommends >= 128 MiB
_STATE: dict = {}


def _flashinfer():
    if "module" not in _STATE:
        try:
            import flashinfer
        except Exception as exc:  # ImportError, or a broken install failing at import
            raise RuntimeError(f"attention/flashinfer_v1 needs {LIBRARY} (and apache-tvm-ffi): "
                               f"{exc!r}") from exc
        _STATE["module"] = flashinfer
    return _STATE["module"]


def rows(page_table, kv_base, q_seq, q_pos, page: int):
    """Host-side plan inputs: (qo_indptr, kv_indptr, kv_indices, last_page_len, max kv length)
    of the runs of consecutive tokens of one row; a run's positions must be consecutive."""
    seqs, pos = q_seq.tolist(), q_pos.tolist()
    table, bases = page_table.tolist(), kv_base.tolist()
    qo, indptr, indices, last = [0], [0], [], []
    start, longest = 0, 1
    while start < len(seqs):
        stop = start
        while stop < len(seqs) and seqs[stop] == seqs[start]:
            stop += 1
        if pos[start:stop] != list(range(pos[start], pos[start] + stop - start)):
            raise ValueError(f"flashinfer_v1: row {seqs[start]}'s query positions are not "
                             "consecutive (FlashInfer aligns a chunk's queries to its last keys)")
        row = seqs[start]
        kv_len = pos[stop - 1] + 1 - bases[row]
        need = -(-kv_len // page)
        if kv_len < stop - start or need > len(table[row]):
            raise ValueError(f"flashinfer_v1: row {row} needs {need} pages for {kv_len} keys, "
                             f"its table has {len(table[row])}")
        qo.append(stop)
        indices += table[row][:need]
        indptr.append(len(indices))
        last.append((kv_len - 1) % page + 1)
        longest = max(longest, kv_len)
        start = stop
    return qo, indptr, indices, last, longest


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)  # host: plan() reads it without a sync


def _wrapper(fi, device, decode: bool, graph_rows: int = 0, graph_pages: int = 0):
    key = (str(device), decode, graph_rows, graph_pages)
    if key not in _STATE:
        ws = _STATE.setdefault(("workspace", str(device)),
                               torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
        if not decode:
            _STATE[key] = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        elif not graph_rows:
            _STATE[key] = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        else:  # static buffers, for a caller that captures the run in a CUDA graph
            _STATE[key] = fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(graph_rows + 1, dtype=torch.int32,
                                                   device=device),
                paged_kv_indices_buffer=torch.zeros(graph_pages, dtype=torch.int32,
                                                    device=device),
                paged_kv_last_page_len_buffer=torch.zeros(graph_rows, dtype=torch.int32,
                                                          device=device))
    return _STATE[key]


def plan(q_shape, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int,
         scale: float, graph: bool = False):
    """A callable q -> out planned for this metadata (host work done now, not per call);
    `graph=True` plans decode into static buffers, so the call can be captured."""
    fi = _flashinfer()
    t, hq, d = q_shape
    _, page, hkv, _ = k_cache.shape
    qo, indptr, indices, last, longest = rows(page_table, kv_base, q_seq, q_pos, page)
    decode = len(last) == t
    common = dict(window_left=window - 1 if window else longest, sm_scale=scale,
                  q_data_type=k_cache.dtype, kv_data_type=k_cache.dtype,
                  pos_encoding_mode="NONE")
    dev = k_cache.device
    if decode:
        w = _wrapper(fi, dev, True, len(last) if graph else 0, len(indices) if graph else 0)
        w.plan(_i32(indptr), _i32(indices), _i32(last), hq, hkv, d, page, **common)
    else:
        w = _wrapper(fi, dev, False)
        w.plan(_i32(qo), _i32(indptr), _i32(indices), _i32(last), hq, hkv, d, page,
               causal=True, **common)
    return lambda q: w.run(q.contiguous(), (k_cache, v_cache))


def _check(q, k_cache) -> None:
    if not q.is_cuda:
        raise RuntimeError("attention/flashinfer_v1 runs on CUDA devices only")
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
        raise ValueError(f"flashinfer_v1 takes bf16/fp16 q and cache, got {q.dtype}, "
                         f"{k_cache.dtype}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"flashinfer_v1 has kernels for head_dim {HEAD_DIMS}, not "
                         f"{q.shape[-1]}")


def run(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int, scale: float,
        config: dict | None = None) -> torch.Tensor:
    """attention(...) -> [T, Hq, D] through FlashInfer (planned on the host for this call)."""
    _check(q, k_cache)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return plan(tuple(q.shape), k_cache, v_cache, page_table, kv_base, q_seq, q_pos,
                int(window), float(scale))(q)
