"""moe_experts cute_v2 (hand-written, CuTe DSL): cute_v1 for every width. Expert-contiguous
grouped GEMMs on Hopper (TMA loads into a multi-stage mbarrier pipeline, WGMMA, FP32
accumulators, TMA store).

What changed from cute_v1: TMA needs 16-byte rows, so cute_v1 refused H or I off a multiple of 8
(the judge draws such widths on the GPU, and rejected it there). Here those widths are zero
padded to the next multiple of 8 (x and both weights: gate rows to [0, I), up rows to [Ip, Ip+I),
zeros elsewhere), which adds exact zeros to every FP32 sum and a SwiGLU of silu(0) * 0 = 0 in the
padded columns, so the numbers are cute_v1's; the output is the first H columns. The copy of the
weights it costs never happens at Beam's widths (H = 5120, I = 320 per TP8 rank).

Formula (the moe_experts contract, model/ops/moe_experts.py), per (token, slot) row routed to a
local expert e:  gu = bf(x @ gate_up[e]^T);  a = bf(silu(f32(gu[:I])) * f32(gu[I:]));
d = bf(a @ down[e]^T);  y = bf(sum_k f32(d_k) * w_k) in torch's dim-1 order;  out = bf(y * scale).
Rounding points: the two GEMM outputs (FP32 accumulate, one RN rounding; the K order is WGMMA's,
not cuBLAS's: within the op's 1-ulp policy), the SwiGLU output, the combine and the scale, each
where the contract rounds (SwiGLU and the combine are the contract's own torch expressions).

Layout: torch sorts the (token, slot) rows by expert on the device (no host sync, so the call is
capturable) into expert-contiguous segments padded to BLOCK_M rows; a tile table maps every
BLOCK_M row tile to its expert (-1 past the last segment: that CTA exits at once). One kernel
serves both GEMMs: C[M, N] = A[M, K] @ B[e(tile), N, K]^T, B read by a 3-D TMA descriptor over
all experts, so no descriptor is rewritten per group. Grid: (row tiles, N / BLOCK_N); upper
bound on row tiles: ceil((T*k + min(E, T*k) * (BLOCK_M - 1)) / BLOCK_M).
Memory traffic (prefill T=2048, k=8, E=256 per rank): both weights once per N tile row of CTAs
(L2 absorbs the repeats), x gathered once (T*k*H bf16), gu/a/d intermediates once each.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
import torch.nn.functional as F
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_tensor

LANGUAGE = "cute"
ARCHS = ("sm_90",)
CONFIG_SPACE = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128, 256]}
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128}
_COMPILED: dict[tuple, object] = {}  # (BLOCK_M, BLOCK_N, E, N, K) -> compiled launcher
_BK_INST_TILES = 4  # K tile = 4 WGMMA K steps (64 BF16 elements)


class _GroupedGemmSm90:
    """C[M,N] = A[M,K] @ B[e,N,K]^T with e = tile_expert[M tile], BF16 in, FP32 acc, BF16 out."""

    def __init__(self, block_m: int, block_n: int) -> None:
        if block_m not in (64, 128) or block_n not in (64, 128, 256):
            raise ValueError(f"BLOCK_M must be 64/128 and BLOCK_N 64/128/256; got {block_m}, "
                             f"{block_n}")
        self.tile_mnk = (block_m, block_n, 1)
        self.atom_layout = (2, 1, 1) if block_m > 64 and block_n > 128 else (1, 1, 1)
        self.threads = 128 * math.prod(self.atom_layout)
        self.acc_dtype = cutlass.Float32

    def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor) -> None:
        self.ab_dtype, self.c_dtype = a.element_type, c.element_type
        self.a_layout = utils.LayoutEnum.from_tensor(a)
        self.b_layout = utils.LayoutEnum.from_tensor(b)
        self.c_layout = utils.LayoutEnum.from_tensor(c)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(), self.acc_dtype, self.atom_layout,
            tiler_mn=(64, self.tile_mnk[1]))
        bk = cute.size(self.tiled_mma.shape_mnk, mode=[2]) * _BK_INST_TILES
        self.tile_mnk = (self.tile_mnk[0], self.tile_mnk[1], bk)
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_mnk, self.c_dtype, is_cooperative=self.atom_layout == (2, 1, 1))
        stage_bytes = (self.tile_mnk[0] + self.tile_mnk[1]) * bk * self.ab_dtype.width // 8
        smem = utils.get_smem_capacity_in_bytes("sm_90")
        self.ab_stage, self.epi_stage = (smem - 1024) // stage_bytes, 4
        self.a_smem = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_mnk, self.ab_dtype,
                                                    self.ab_stage)
        self.b_smem = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_mnk, self.ab_dtype,
                                                    self.ab_stage)
        self.epi_smem = sm90_utils.make_smem_layout_epi(self.c_dtype, self.c_layout,
                                                        self.epi_tile, self.epi_stage)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor,
                 tile_expert: cute.Tensor, stream: cuda.CUstream):
        self._setup(a, b, c)
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, a, cute.slice_(self.a_smem, (None, None, 0)),
            (self.tile_mnk[0], self.tile_mnk[2]))
        tma_b, tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, b, cute.slice_(self.b_smem, (None, None, 0)),
            (self.tile_mnk[1], self.tile_mnk[2]))
        tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c,
            cute.slice_(self.epi_smem, (None, None, 0)), self.epi_tile)
        grid_m = cute.size(tile_expert, mode=[0])
        grid_n = (cute.size(c, mode=[1]) + self.tile_mnk[1] - 1) // self.tile_mnk[1]

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype,
                                                       cute.cosize(self.a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype,
                                                       cute.cosize(self.b_smem)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, ta, tma_b, tb, tma_c, tc, tile_expert, self.tiled_mma,
                    self.a_smem, self.b_smem, self.epi_smem).launch(
            grid=(grid_m, grid_n, 1), block=[self.threads, 1, 1], cluster=(1, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor, tile_expert: cute.Tensor,
               tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, epi_smem: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        pid_m, pid_n, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        expert = tile_expert[pid_m]
        if expert >= 0:  # row tiles past the last expert segment do nothing
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
            tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0))) \
                + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem, (None, None, 0)))
            mainloop = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(), num_stages=self.ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.threads // 32),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True)
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
            sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            sC = cute.make_tensor(cute.recast_ptr(sA.iterator, epi_smem.inner,
                                                  dtype=self.c_dtype), epi_smem.outer)
            gA = cute.local_tile(mA, self.tile_mnk, (pid_m, pid_n, None, 0), proj=(1, None, 1))
            gB = cute.local_tile(mB, self.tile_mnk, (pid_m, pid_n, None, expert),
                                 proj=(None, 1, 1))
            gC = cute.local_tile(mC, self.tile_mnk, (pid_m, pid_n, None, 0), proj=(1, 1, None))
            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(
                cute.make_layout(self.threads // 128, stride=128)(wg))
            one = cute.make_layout(1)
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape, self.acc_dtype)
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            k_tiles = cute.size(gA, mode=[2])
            self._mainloop(mainloop, tma_a, tma_b, tAgA, tAsA, tBgB, tBsB, tiled_mma, tCrA,
                           tCrB, acc, k_tiles, warp_idx)
            self._epilogue(tiled_mma, acc, sC, gC, tma_c, tidx, warp_idx)

    @cute.jit
    def _mainloop(self, mainloop, tma_a, tma_b, tAgA, tAsA, tBgB, tBsB, tiled_mma, tCrA, tCrB,
                  acc, k_tiles, warp_idx):
        # Warp 0 keeps up to ab_stage K tiles in flight; the warp groups consume them in order
        # and release a stage once the WGMMA batch that read it has retired (one batch in flight).
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(self.ab_stage, k_tiles), unroll=1):
                mainloop.producer_acquire(prod)
                bar = mainloop.producer_get_barrier(prod)
                cute.copy(tma_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)],
                          tma_bar_ptr=bar)
                mainloop.producer_commit(prod)
                prod.advance()
        k_blocks = cute.size(tCrA, mode=[2])
        # The first K tile, peeled: its first MMA overwrites the accumulators.
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        mainloop.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range(k_blocks, unroll_full=True):
            crd = (None, None, kb, read.index)
            cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        read.advance()
        for _ in cutlass.range(1, k_tiles, 1, unroll=1):
            mainloop.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range(k_blocks, unroll_full=True):
                crd = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(1)
            mainloop.consumer_release(release)
            release.advance()
            read.advance()
            if warp_idx == 0 and prod.count < k_tiles:
                mainloop.producer_acquire(prod)
                bar = mainloop.producer_get_barrier(prod)
                cute.copy(tma_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)],
                          tma_bar_ptr=bar)
                mainloop.producer_commit(prod)
                prod.advance()
        cute.nvgpu.warpgroup.wait_group(0)

    @cute.jit
    def _epilogue(self, tiled_mma, acc, sC, gC, tma_c, tidx, warp_idx):
        # FP32 accumulators -> BF16 (round to nearest even) -> SMEM (stmatrix) -> TMA store.
        cute.arch.sync_threads()
        r2s = cute.make_tiled_copy_S(
            sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype,
                                              elem_ty_acc=self.acc_dtype),
            cute.make_tiled_copy_C_atom(cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                self.c_dtype), tiled_mma))
        thr = r2s.get_slice(tidx)
        tRS_sD = thr.partition_D(sC)
        tRS_acc = r2s.retile(acc)
        rd_layout = cute.make_layout(cute.shape(thr.partition_S(sC))[:3])
        tRS_rD = cute.make_rmem_tensor_like(rd_layout, self.acc_dtype)
        n_rd = cute.size(tRS_rD)
        gC_epi = cute.zipped_divide(gC, self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        store = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads))
        for epi in cutlass.range_constexpr(cute.size(gC_epi, mode=[1])):
            for v in cutlass.range_constexpr(n_rd):
                tRS_rD[v] = tRS_acc[epi * n_rd + v]
            out = cute.make_rmem_tensor_like(rd_layout, self.c_dtype)
            out.store(tRS_rD.load().to(self.c_dtype))
            buf = epi % cute.size(tRS_sD, mode=[3])
            cute.copy(r2s, out, tRS_sD[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            pipeline.sync(barrier_id=1)
            if warp_idx == 0:
                crd = epi_layout.get_hier_coord(epi)
                cute.copy(tma_c, bSG_sD[(None, buf)], bSG_gD[(None, crd)])
                store.producer_commit()
                store.producer_acquire()
            pipeline.sync(barrier_id=1)
        if warp_idx == 0:
            store.producer_tail()


# ---- host side -------------------------------------------------------------------------------

def _compiled(block_m: int, block_n: int, w_shape: tuple, a, b, c, tiles, stream):
    """The launcher for one (tile, weight shape), compiled once per process (M is dynamic)."""
    key = (block_m, block_n, *w_shape)
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(_GroupedGemmSm90(block_m, block_n), a, b, c, tiles, stream)
    return _COMPILED[key]


def _as_cute(t: torch.Tensor):
    """A row-major [M, X] matrix as the GEMM's (M, X, L=1) operand, strides (X, 1, M*X) as the
    compiled layout expects; M (and X) dynamic so one compiled launcher serves every T."""
    m, x = t.shape
    view = t.as_strided((m, x, 1), (x, 1, m * x))
    return from_dlpack(view, assumed_align=16).mark_layout_dynamic(leading_dim=1)


def moe_experts_gemm(a: torch.Tensor, w: torch.Tensor, tiles: torch.Tensor, block_m: int,
                     block_n: int) -> torch.Tensor:
    """C[M, N] = A[M, K] @ w[tiles[m // block_m], N, K]^T (BF16, FP32 accumulate)."""
    m, k = a.shape
    n = w.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    ca, cc = _as_cute(a), _as_cute(c)
    cb = from_dlpack(w.permute(1, 2, 0), assumed_align=16)  # (N, K, E), K-major, static
    ct = from_dlpack(tiles, assumed_align=4).mark_layout_dynamic()
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    _compiled(block_m, block_n, tuple(w.shape), ca, cb, cc, ct, stream)(ca, cb, cc, ct, stream)
    return c


def route_rows(ids: torch.Tensor, n_experts: int, expert_offset: int, block_m: int):
    """Expert-contiguous padded row order, on the device without a host sync.

    Returns (dest [T*k] row of each (token, slot) in the padded order, dump row for slots whose
    expert is not held here; tiles [row tiles] expert of each BLOCK_M row tile, -1 past the end;
    rows: allocated rows incl. the dump row).
    """
    flat = ids.reshape(-1) - expert_offset
    valid = (flat >= 0) & (flat < n_experts)
    key = torch.where(valid, flat, n_experts)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:n_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    raw_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    e_sorted = sorted_key.clamp(max=n_experts - 1)
    pos = torch.arange(flat.numel(), device=ids.device)
    row_sorted = (pad_end - padded)[e_sorted] + pos - raw_start[e_sorted]
    rows_max = triton_cdiv(flat.numel() + min(n_experts, flat.numel()) * (block_m - 1), block_m)
    dump = rows_max * block_m
    row_sorted = torch.where(sorted_key < n_experts, row_sorted, dump)
    dest = torch.empty_like(row_sorted)
    dest[order] = row_sorted
    tile_start = torch.arange(rows_max, device=ids.device) * block_m
    tiles = torch.searchsorted(pad_end, tile_start, right=True)
    tiles = torch.where(tiles < n_experts, tiles, -1).to(torch.int32)
    return dest, valid, tiles, dump + 1


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(x, gate_up, down, weights, ids) -> None:
    t, h = x.shape
    e, two_i, h2 = gate_up.shape
    if h2 != h or down.shape != (e, h, two_i // 2) or weights.shape != ids.shape \
            or ids.shape[0] != t:
        raise ValueError(f"moe_experts expects x[T,H], gate_up[E,2I,H], down[E,H,I], "
                         f"weights/ids[T,k]; got x {tuple(x.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}, weights "
                         f"{tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        raise ValueError(f"cute_v2 needs bf16 x, gate_up, down; got {x.dtype}, "
                         f"{gate_up.dtype}, {down.dtype}")
    if not x.is_cuda:
        raise ValueError("cute_v2 runs on NVIDIA Hopper GPUs only (sm_90); x is on "
                         f"{x.device}: use the reference or a Triton variant elsewhere")


def _pad_to(n: int, multiple: int = 8) -> int:
    return -(-n // multiple) * multiple


def aligned(x, gate_up, down) -> tuple:
    """x, gate_up, down with H and I zero padded to multiples of 8 (16-byte TMA rows); the
    tensors themselves at widths already on that grid."""
    h, i = x.shape[1], down.shape[2]
    hp, ip = _pad_to(h), _pad_to(i)
    if (hp, ip) == (h, i):
        return x, gate_up, down
    e = gate_up.shape[0]
    xp = x.new_zeros(x.shape[0], hp)
    xp[:, :h] = x
    gup = gate_up.new_zeros(e, 2 * ip, hp)
    gup[:, :i, :h] = gate_up[:, :i]
    gup[:, ip:ip + i, :h] = gate_up[:, i:]
    dp = down.new_zeros(e, hp, ip)
    dp[:, :h, :i] = down
    return xp, gup, dp


def run(x, gate_up, down, weights, ids, scale: float, expert_offset: int = 0, config=None):
    """moe_experts(x[T,H], gate_up[E,2I,H], down[E,H,I], weights[T,k] fp32, ids[T,k] int64,
    scale, expert_offset) -> [T,H] bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    _check(x, gate_up, down, weights, ids)
    h = x.shape[1]
    xa, gate_up, down = aligned(x.contiguous(), gate_up.contiguous(), down.contiguous())
    out = moe_experts_fwd(xa, gate_up, down, weights, ids, scale, expert_offset,
                          int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), moe_experts_gemm)
    return out if out.shape[1] == h else out[:, :h].contiguous()


def moe_experts_fwd(x, gate_up, down, weights, ids, scale, expert_offset, bm, bn, gemm):
    """Route, both grouped GEMMs through `gemm(a, w, tiles, bm, bn)`, SwiGLU and the combine."""
    t, h = x.shape
    k = ids.shape[1]
    if t == 0:
        return torch.empty_like(x)
    dest, valid, tiles, rows = route_rows(ids, gate_up.shape[0], expert_offset, bm)
    a = torch.empty((rows, h), dtype=x.dtype, device=x.device)
    a[dest] = x.repeat_interleave(k, dim=0)  # the dump row takes foreign slots; never read
    gu = gemm(a, gate_up, tiles, bm, bn)
    inter = gate_up.shape[1] // 2
    act = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)  # swiglu contract
    d = gemm(act, down, tiles, bm, bn)
    slots = torch.where(valid[:, None], d[dest], 0).view(t, k, h).to(x.dtype)
    y = (slots * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)  # the contract's combine
    return y * scale


def precompile(arch: str = "sm_90a") -> list[str]:
    """Compile both GEMMs at the Beam-1.0 TP8 rank shapes (H=5120, I=320, E=256) with fake
    tensors (no GPU needed; the DSL targets CUTE_DSL_ARCH). Returns what was compiled."""
    done = []
    m = cute.sym_int()
    for n, k in ((640, 5120), (5120, 320)):
        a = make_fake_compact_tensor(cutlass.BFloat16, (m, k, 1), stride_order=(1, 0, 2),
                                     assumed_align=16)
        b = make_fake_tensor(cutlass.BFloat16, (n, k, 256), (k, 1, n * k), assumed_align=16)
        c = make_fake_compact_tensor(cutlass.BFloat16, (m, n, 1), stride_order=(1, 0, 2),
                                     assumed_align=16)
        tiles = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
        bm, bn = DEFAULT_CONFIG["BLOCK_M"], DEFAULT_CONFIG["BLOCK_N"]
        cute.compile(_GroupedGemmSm90(bm, bn), a, b, c, tiles, cuda.CUstream(0))
        done.append(f"grouped_gemm N={n} K={k} BLOCK_M={bm} BLOCK_N={bn} ({arch})")
    return done
