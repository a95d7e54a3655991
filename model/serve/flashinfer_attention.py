"""FlashInfer attention over the paged KV cache: the GPU `AttentionBackend` behind
`--attention-backend flashinfer` (and `auto` on a GPU where it works).

Same contract as `PagedAttention` (model/serve/paged_attention.py): every call first writes the
step's new K/V at their slots, then attends each query to the keys its sequence has cached, with
the same page layout (k/v_pages [N, page, Hkv, D] per layer is FlashInfer's "NHD" layout, given as
a (k, v) tuple). Decode rows go through one `BatchDecodeWithPagedKVCacheWrapper` per pool (tensor
cores: Beam's GQA groups of 6 query heads per KV head fill an MMA tile), prefill chunks through one
`BatchPrefillWithPagedKVCacheWrapper` per pool (causal, aligned bottom-right: a chunk's queries are
the last keys of its kv range). Every layer of a pool shares the pool's page tables, so the runner
plans once per step (`plan_step`, or `plan_graph` for a CUDA-graph bucket), not per layer.

Key positions: FlashInfer counts a row's keys from the first slot of its first page and puts the
query at the last key. A decode at position p in the full pool has kv length p + 1; in the window
pool the first page starts at `swa_base`, so the kv length is p + 1 - swa_base: the kv range ends
at the query's own token and the window mask (`window_left = window - 1`, relative) is exact.
Full-attention layers run the same sliding-window kernel with a window wider than the whole pool:
the same result, and one JIT module instead of two (each costs minutes of nvcc on first use).

Numerics: NOT the reference's rounding points. The reference (NUMERICS.md) rounds scores to BF16,
scales in BF16 and rounds the FP32 softmax to BF16 before a BF16 P.V; FlashInfer keeps scores,
the online-softmax state and the P.V accumulator in FP32 (P is cast to BF16 only as the MMA
operand) and rounds once, at the output. It is a different, faster and slightly more accurate
numerics, so it is compared to the torch backend with a tolerance (tests/test_serve_flashinfer.py),
never bitwise.

CUDA graphs: each decode bucket has its own wrappers in FlashInfer's cuda-graph mode (fixed batch,
static indptr / indices / last-page-length buffers). `DecodeGraphs` calls `plan_graph` before the
warm-up, the capture and every replay; the plan rewrites those buffers in place.

FlashInfer is imported lazily (only on CUDA); no CPU path depends on it. Its JIT cache goes to
$FLASHINFER_WORKSPACE_BASE (default here: /tmp/flashinfer-jit).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .engine.kv_cache import FULL, SWA, PagedKVCache

BACKENDS = ("auto", "torch", "flashinfer")
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
WORKSPACE_BYTES = 256 * 2**20  # split-kv partial outputs; FlashInfer recommends >= 128 MiB
JIT_DIR = "/tmp/flashinfer-jit"
INSTALL_HINT = ("install flashinfer-python==0.7.0 and apache-tvm-ffi (the wheels in .whl/: "
                "pip install --no-deps .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl)")


# ---- availability and selection ------------------------------------------------------------------
@functools.cache
def _import() -> tuple[object | None, str]:
    """(flashinfer module or None, version or why not). Imported once, on first need."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", JIT_DIR)  # the JIT cache (see docstring)
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install failing at import
        return None, f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return flashinfer, f"flashinfer {getattr(flashinfer, '__version__', '?')}"


def available(head_dim: int | None = None, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether FlashInfer can serve here (CUDA, sm80+, head_dim and dtype it has kernels for,
    importable), and a reason either way."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False, f"the engine runs on {dev.type}, FlashInfer needs a CUDA device"
    cc = torch.cuda.get_device_capability(dev)
    if cc < (8, 0):
        return False, f"compute capability {cc} < (8, 0)"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {dtype} (FlashInfer attention takes bfloat16 / float16)"
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        return False, f"head_dim {head_dim} (FlashInfer kernels: {SUPPORTED_HEAD_DIMS})"
    module, why = _import()
    return module is not None, why


def resolve_backend(name: str, device: torch.device | str, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> tuple[str, str]:
    """(backend, why): `auto` is flashinfer when available on CUDA, else torch; `flashinfer`
    where it cannot run raises ValueError naming the fix."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {list(BACKENDS)}")
    dev = torch.device(device)
    if name == "torch":
        return "torch", "asked for"
    if dev.type != "cuda":
        if name == "flashinfer":
            raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, but the engine "
                             f"runs on {dev.type}; use --attention-backend torch (or auto, which "
                             "picks torch off the GPU)")
        return "torch", f"auto: {dev.type} device"
    ok, why = available(head_dim, dtype, dev)
    if ok:
        return "flashinfer", ("asked for" if name == "flashinfer" else "auto") + f": {why}"
    if name == "flashinfer":
        fix = INSTALL_HINT if "importable" in why else "use a supported model/dtype"
        raise ValueError(f"attention backend 'flashinfer' is unavailable: {why}; {fix}, or use "
                         "--attention-backend torch (or auto)")
    return "torch", f"auto: FlashInfer unavailable ({why})"


def select_backend(name: str, device: torch.device | str, head_dim: int | None = None,
                   dtype: torch.dtype | None = None) -> str:
    return resolve_backend(name, device, head_dim, dtype)[0]


# ---- page tables in FlashInfer's CSR form -----------------------------------------------------
def csr_rows(rows: Sequence[tuple[Sequence[int], int]], page_size: int
             ) -> tuple[list[int], list[int], list[int]]:
    """(indptr, indices, last_page_len) of rows (pages, kv length): a row's keys are the first
    kv length slots of its pages."""
    indptr, indices, last = [0], [], []
    for pages, n in rows:
        need = -(-n // page_size)
        if n < 1 or need > len(pages):
            raise ValueError(f"a row of kv length {n} needs {need} pages of {page_size}, it has "
                             f"{len(pages)} (the cache must be allocated for this step first)")
        indices += pages[:need]
        indptr.append(len(indices))
        last.append((n - 1) % page_size + 1)
    return indptr, indices, last


def _i32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)  # host: plan() reads it without a sync


@dataclass
class _Pool:
    """One pool's wrappers for the planned step (None: no such rows)."""

    decode: object | None = None
    prefill: object | None = None


@dataclass
class _Plan:
    num_tokens: int
    num_decode: int
    pools: dict[str, _Pool] = field(default_factory=dict)


class FlashInferAttention:
    """AttentionBackend over a PagedKVCache through FlashInfer; call `plan_step` (the runner
    does) or `plan_graph` before each forward."""

    def __init__(self, cache: PagedKVCache, ops: Callable[[], object] | None = None, *,
                 num_qo_heads: int, max_model_len: int,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        module, why = _import()
        if module is None:
            raise ValueError(f"FlashInferAttention: {why}; {INSTALL_HINT}")
        self.fi = module
        self.cache = cache
        self.ops = ops  # unused: kept so both backends take the same arguments
        lay = cache.layout
        self.page = lay.page_size
        self.num_qo_heads, self.max_model_len = num_qo_heads, max_model_len
        self.scale = lay.head_dim**-0.5  # Beam's; __call__ checks what the model passes
        self.groups = [g for g in (FULL, SWA) if lay.layers(g)]
        # Full layers: a window wider than the pool = no window (see the module docstring).
        self.window_left = {FULL: max(cache.pools[FULL].num_pages * self.page, max_model_len),
                            SWA: lay.window - 1}
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=cache.device)
        self.eager = {g: _Pool(self._decode_wrapper(), self._prefill_wrapper())
                      for g in self.groups}
        self.graph_pools: dict[int, dict[str, _Pool]] = {}
        self._plan: _Plan | None = None

    # ---- wrappers ---------------------------------------------------------------------------
    def _decode_wrapper(self, bucket: int = 0, width: int = 0):
        if not bucket:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                              use_tensor_cores=True)
        dev = self.cache.device
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(bucket + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(bucket * width, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(bucket, dtype=torch.int32, device=dev))

    def _prefill_wrapper(self):
        # fa2 (not auto, which picks fa3 on Hopper): the module tensor-core decode uses too.
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    def _graph_widths(self) -> dict[str, int]:
        lay = self.cache.layout
        return {FULL: math.ceil(self.max_model_len / self.page),
                SWA: math.ceil(lay.window / self.page) + 1 if lay.window else 1}

    # ---- planning ---------------------------------------------------------------------------
    def _rows(self, group: str, chunks: Sequence) -> list[tuple[list[int], int]]:
        """(pages, kv length) per chunk: the kv range ends at the chunk's last token."""
        rows = []
        for c in chunks:
            full, swa, swa_base = self.cache.page_tables(c.seq_id)
            stop = c.start + c.num_tokens
            rows.append((full, stop) if group == FULL else (swa, stop - swa_base))
        return rows

    def _common(self, group: str) -> dict:
        dtype = self.cache.layout.dtype
        return dict(window_left=self.window_left[group], sm_scale=self.scale,
                    q_data_type=dtype, kv_data_type=dtype, pos_encoding_mode="NONE")

    def _plan_decode(self, group: str, wrapper, rows) -> None:
        lay = self.cache.layout
        indptr, indices, last = csr_rows(rows, self.page)
        wrapper.plan(_i32(indptr), _i32(indices), _i32(last), self.num_qo_heads,
                     lay.num_kv_heads, lay.head_dim, self.page, **self._common(group))

    def plan_step(self, chunks: Sequence, num_decode: int) -> None:
        """Plan a step laid out as the runner's `prepare` lays it out (num_decode single-token
        chunks first); chunks carry seq_id, start and num_tokens, allocated in the cache."""
        lay = self.cache.layout
        plan = _Plan(sum(c.num_tokens for c in chunks), num_decode)
        rest = chunks[num_decode:]
        for g in self.groups:
            pool, wrappers = _Pool(), self.eager[g]
            if num_decode:
                self._plan_decode(g, wrappers.decode, self._rows(g, chunks[:num_decode]))
                pool.decode = wrappers.decode
            if rest:
                indptr, indices, last = csr_rows(self._rows(g, rest), self.page)
                qo = [0]
                for c in rest:
                    qo.append(qo[-1] + c.num_tokens)
                wrappers.prefill.plan(_i32(qo), _i32(indptr), _i32(indices), _i32(last),
                                      self.num_qo_heads, lay.num_kv_heads, lay.head_dim,
                                      self.page, causal=True, **self._common(g))
                pool.prefill = wrappers.prefill
            plan.pools[g] = pool
        self._plan = plan

    def plan_graph(self, bucket: int, chunks: Sequence) -> None:
        """Plan a CUDA-graph decode bucket: `chunks` (single tokens), then padded rows that
        read the null page 0 (kv length 1), as DecodeGraphs lays them out."""
        pools = self.graph_pools.get(bucket)
        if pools is None:
            widths = self._graph_widths()
            pools = {g: _Pool(self._decode_wrapper(bucket, widths[g])) for g in self.groups}
            self.graph_pools[bucket] = pools
        pad = [([0], 1)] * (bucket - len(chunks))
        for g in self.groups:
            self._plan_decode(g, pools[g].decode, self._rows(g, chunks) + pad)
        self._plan = _Plan(bucket, bucket, pools)

    # ---- the backend --------------------------------------------------------------------------
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int, scale: float, batch) -> torch.Tensor:
        group, k_pages, v_pages = self.cache.layer_cache(layer)
        slots = batch.swa_write if group == SWA else batch.full_write
        k_pages.view(-1, *k_pages.shape[2:]).index_copy_(0, slots, k)
        v_pages.view(-1, *v_pages.shape[2:]).index_copy_(0, slots, v)
        plan = self._plan
        if plan is None or plan.num_tokens != q.shape[0] or plan.num_decode != batch.num_decode:
            raise RuntimeError(
                f"FlashInferAttention is planned for {plan and plan.num_tokens} tokens "
                f"({plan and plan.num_decode} decodes), got {q.shape[0]} ({batch.num_decode}); "
                "call plan_step (ModelRunner.prepare does) or plan_graph before the forward")
        want = self.cache.layout.window if group == SWA else 0
        if window != want or not math.isclose(scale, self.scale, rel_tol=1e-9):
            raise ValueError(f"layer {layer}: window {window}, scale {scale}; the plan has "
                             f"window {want}, scale {self.scale} (head_dim**-0.5)")
        q = q.contiguous()
        pool, nd, parts = plan.pools[group], plan.num_decode, []
        if pool.decode is not None:
            parts.append(pool.decode.run(q[:nd], (k_pages, v_pages)))
        if pool.prefill is not None:
            parts.append(pool.prefill.run(q[nd:], (k_pages, v_pages)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def make_backend(name: str, cache: PagedKVCache, ops: Callable[[], object], *,
                 num_qo_heads: int, max_model_len: int):
    """(backend, its name, note) for ModelRunner: the `--attention-backend` choice, resolved."""
    from .paged_attention import PagedAttention

    lay = cache.layout
    chosen, why = resolve_backend(name, cache.device, lay.head_dim, lay.dtype)
    note = f"attention backend: {chosen} ({why})"
    if chosen == "torch":
        return PagedAttention(cache, ops), chosen, note
    return FlashInferAttention(cache, ops, num_qo_heads=num_qo_heads,
                               max_model_len=max_model_len), chosen, note
