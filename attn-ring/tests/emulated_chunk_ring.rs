//! The chunk ring with its blocks on the CUDA path without a GPU: the CUDA launch plans
//! (`attn_kernels::cuda::launch_plan`) of every block, epilogue and backward executed by the
//! CPU emulation of the `.cu` kernels (`attn_kernels::cuda::emulation`), host buffers
//! standing in for device memory. Every golden file of `conformance/dilated` and
//! `conformance/features`, both layouts: bf16 at world sizes 2..=4 in two rounds, handing
//! buffers on in process; f32 and f16 at world size 2 in one round, staged as bytes (the
//! emulation runs a 128-thread block per tile on one core, so the sweep is sized to stay
//! within minutes); every file of `conformance/blocks` (block masks, read by the row
//! kernels) in bf16 at world size 2, zigzag, in two rounds; Ulysses (P = 2, 3) and the
//! hybrid (2, 4) over the dilated and feature files, and uneven and shared key/value heads
//! against the float64 reference, the kernels given each slot as a head window. Needs a
//! C++20 compiler (`$CXX`, default `g++`); without one the test fails, naming it.
#![cfg(feature = "cuda")]

use crate::common;
use crate::ulysses::{golden_dir_through_layouts, uneven_heads_case};

use std::marker::PhantomData;
use std::time::Duration;

use attn_core::{AttnError, Mixing, PackedSequences, Result, Shape4};
use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::emulation::{Emulator, HostAccs, HostArgs};
use attn_kernels::cuda::launch_plan::{BlockGeometry, BlockMaskShape};
use attn_kernels::cuda::plan::head_window::HeadWindow;
use attn_kernels::cuda::plan::out_scale;
use attn_ring::chunk_ring::{ChunkBlock, ChunkCompute, ChunkGrads, ChunkOptions, ChunkUpstream, HeadSlot, HostRows};
use attn_ring::{Layout, RingProblem, Strategy, ThreadComm};
use common::{ChunkBackend, LseRows, Moves, both_layouts, chunk_sweep_setups};
use half::{bf16, f16};
use proptest::strategy::{Strategy as _, ValueTree};

fn emulator() -> &'static Emulator {
    Emulator::shared(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")))
        .unwrap_or_else(|e| panic!("the CUDA kernel emulation needs a C++20 compiler ($CXX or g++): {e}"))
}

/// f32 values `[batch, rows, heads, d]` (accumulators) or `[batch, rows, heads]` (per row)
/// of a piece of `shape`, as the CUDA compute keeps them.
#[derive(Debug, Clone)]
struct Flat {
    shape: Shape4,
    data: Vec<f32>,
}

impl LseRows for Flat {
    fn to_bsh(&self) -> Vec<f32> {
        self.data.clone()
    }
}

/// The forward partial: out and lse, flat.
#[derive(Debug)]
struct Partial {
    out: Flat,
    lse: Vec<f32>,
}

/// Key padding flags, packed sequences and the block mask (entries and sizes).
struct Masks {
    kpad: Option<Vec<u8>>,
    cu_seqlens: Option<Vec<usize>>,
    block: Option<(Vec<u8>, BlockMaskShape)>,
}

/// The CUDA chunk compute's steps on the emulation (`CudaChunks` on host buffers).
struct EmulatedChunks;

fn geometry<'a, T>(
    b: &ChunkBlock<'a, HostRows<T>, Masks>,
    g_strides: Option<[usize; 4]>,
    packing: Option<PackedSequences<'a>>,
) -> BlockGeometry<'a> {
    let (qs, ks) = (b.q.shape, b.k.shape);
    BlockGeometry {
        cfg: &b.problem.cfg,
        q: (qs, qs.contiguous_strides()),
        q_start: b.q_start,
        k: (ks, ks.contiguous_strides()),
        v_strides: ks.contiguous_strides(),
        k_start: b.k_start,
        g_strides,
        band: b.problem.cfg.band(),
        kpad_seq: b.masks.kpad.as_ref().map(|_| b.problem.seq),
        packing,
        block_mask: b.masks.block.as_ref().map(|(_, shape)| *shape),
        window: match b.heads {
            HeadSlot::Every => None,
            HeadSlot::Slot { first, kv_first } => {
                Some(HeadWindow { heads: b.problem.heads, kv_heads: b.problem.kv_heads, first, kv_first })
            }
        },
    }
}

impl Flat {
    /// A copy of heads `heads` of every row.
    fn take_heads(&self, heads: std::ops::Range<usize>) -> Result<Flat> {
        let s = self.shape;
        if heads.end > s.heads || heads.is_empty() {
            return Err(AttnError::InvalidArgument(format!("heads {heads:?} of {} heads", s.heads)));
        }
        let (row, d) = (s.heads * s.head_dim, s.head_dim);
        let data = self.data.chunks_exact(row).flat_map(|r| &r[heads.start * d..heads.end * d]).copied().collect();
        Ok(Flat { shape: Shape4 { heads: heads.len(), ..s }, data })
    }

    /// Add `src` to heads `first..first + src heads` of every row.
    fn add_heads(&mut self, first: usize, src: &Flat) -> Result<()> {
        let (s, o) = (self.shape, src.shape);
        if (o.batch, o.seq, o.head_dim) != (s.batch, s.seq, s.head_dim) || first + o.heads > s.heads {
            return Err(AttnError::InvalidArgument(format!("heads {first}+{} of {} heads", o.heads, s.heads)));
        }
        let (row, run) = (s.heads * s.head_dim, o.heads * o.head_dim);
        for (dst, add) in self.data.chunks_exact_mut(row).zip(src.data.chunks_exact(run)) {
            let at = first * s.head_dim;
            dst[at..at + run].iter_mut().zip(add).for_each(|(a, &b)| *a += b);
        }
        Ok(())
    }
}

fn bytes_to_f32(shape: Shape4, bytes: &[u8]) -> Result<Flat> {
    if bytes.len() != shape.numel() * 4 {
        return Err(AttnError::InvalidArgument(format!("{} bytes for {} f32 values", bytes.len(), shape.numel())));
    }
    Ok(Flat { shape, data: bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() })
}

impl<T: CudaElement> ChunkCompute<T> for EmulatedChunks {
    type Rows = HostRows<T>;
    type Partial = Partial;
    type Acc = Flat;
    type RowStats = Flat;
    type Masks = Masks;

    fn shape_of(&self, rows: &HostRows<T>) -> Shape4 {
        rows.shape
    }
    fn masks(&self, problem: &RingProblem) -> Result<Masks> {
        let kpad = problem.masks.key_padding().map(|k| k.view().flags().iter().map(|&x| u8::from(x)).collect());
        let block = problem.masks.block_mask().map(|m| (m.view().keep().to_vec(), BlockMaskShape::from(m.view())));
        Ok(Masks { kpad, cu_seqlens: problem.masks.cu_seqlens().map(<[usize]>::to_vec), block })
    }
    fn empty_partial(&self, q: Shape4) -> Result<Partial> {
        Ok(Partial { out: Flat { shape: q, data: vec![0.0; q.numel()] }, lse: vec![f32::NEG_INFINITY; q.lse_len()] })
    }
    fn zero_acc(&self, shape: Shape4) -> Result<Flat> {
        Ok(Flat { shape, data: vec![0.0; shape.numel()] })
    }
    fn forward_block(&self, b: &ChunkBlock<'_, HostRows<T>, Masks>, p: &mut Partial) -> Result<()> {
        let packing = b.masks.cu_seqlens.as_deref().map(PackedSequences::new).transpose()?;
        let args = HostArgs {
            q: &b.q.data,
            k: &b.k.data,
            v: &b.v.data,
            g: None,
            lse: None,
            delta: None,
            kpad: b.masks.kpad.as_deref(),
            bmask: b.masks.block.as_ref().map(|(keep, _)| keep.as_slice()),
        };
        let acc = HostAccs { q_acc: &mut p.out.data, lse: Some(&mut p.lse), dk: None, dv: None };
        emulator().forward_block(&geometry(b, None, packing), &args, acc)
    }
    fn finish_forward(&self, problem: &RingProblem, p: &Partial) -> Result<(HostRows<T>, Flat)> {
        let shape = p.out.shape;
        let mut out = vec![T::default(); shape.numel()];
        emulator().store_scaled(shape, &p.out.data, out_scale(&problem.cfg), &mut out)?;
        Ok((HostRows { shape, data: out }, Flat { shape, data: p.lse.clone() }))
    }
    fn delta(&self, grad_out: &HostRows<T>, out: &HostRows<T>, l: Option<(&Flat, &Flat)>) -> Result<Flat> {
        let lse_grad = l.map(|(g, l)| (&g.data[..], &l.data[..]));
        Ok(Flat { shape: out.shape, data: emulator().delta(out.shape, &grad_out.data, &out.data, lse_grad)? })
    }
    fn stats_shape(&self, stats: &Flat) -> Option<Shape4> {
        (stats.data.len() == stats.shape.lse_len()).then_some(Shape4 { head_dim: 1, ..stats.shape })
    }
    fn stats_from_bsh(&self, shape: Shape4, values: &[f32]) -> Result<Flat> {
        match values.len() == shape.lse_len() {
            true => Ok(Flat { shape, data: values.to_vec() }),
            false => Err(AttnError::InvalidArgument(format!("{} per-row values for {shape:?}", values.len()))),
        }
    }
    fn backward_block(
        &self,
        b: &ChunkBlock<'_, HostRows<T>, Masks>,
        up: &ChunkUpstream<'_, HostRows<T>, Flat>,
        g: ChunkGrads<'_, Flat>,
    ) -> Result<()> {
        let packing = b.masks.cu_seqlens.as_deref().map(PackedSequences::new).transpose()?;
        let args = HostArgs {
            q: &b.q.data,
            k: &b.k.data,
            v: &b.v.data,
            g: Some(&up.grad_out.data),
            lse: Some(&up.lse.data),
            delta: Some(&up.delta.data),
            kpad: b.masks.kpad.as_deref(),
            bmask: b.masks.block.as_ref().map(|(keep, _)| keep.as_slice()),
        };
        let acc = HostAccs { q_acc: &mut g.dq.data, lse: None, dk: Some(&mut g.dk.data), dv: Some(&mut g.dv.data) };
        emulator().backward_block(&geometry(b, Some(b.q.shape.contiguous_strides()), packing), &args, acc)
    }
    fn store_acc(&self, acc: &Flat) -> Result<HostRows<T>> {
        let mut data = vec![T::default(); acc.shape.numel()];
        emulator().store_scaled(acc.shape, &acc.data, 1.0, &mut data)?;
        Ok(HostRows { shape: acc.shape, data })
    }
    fn rows_to_bytes(&self, rows: &HostRows<T>, out: &mut Vec<u8>) -> Result<()> {
        ChunkCompute::<T>::rows_to_bytes(&attn_ring::chunk_ring::CpuChunks::default(), rows, out)
    }
    fn rows_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<HostRows<T>> {
        ChunkCompute::<T>::rows_from_bytes(&attn_ring::chunk_ring::CpuChunks::default(), shape, bytes)
    }
    fn acc_to_bytes(&self, acc: &Flat, out: &mut Vec<u8>) -> Result<()> {
        acc.data.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        Ok(())
    }
    fn acc_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<Flat> {
        bytes_to_f32(shape, bytes)
    }
    fn acc_bytes(&self, acc: &Flat) -> usize {
        acc.data.len() * 4
    }
    fn slice_rows(&self, src: &HostRows<T>, rows: std::ops::Range<usize>) -> Result<HostRows<T>> {
        src.slice_rows(rows)
    }
    fn zero_rows(&self, shape: Shape4) -> Result<HostRows<T>> {
        Ok(HostRows::zeros(shape))
    }
    fn write_rows(&self, dst: &mut HostRows<T>, at: usize, src: &HostRows<T>) -> Result<()> {
        dst.write_rows(at, src)
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    fn take_heads(&self, src: &HostRows<T>, heads: std::ops::Range<usize>) -> Result<HostRows<T>> {
        src.take_heads(heads)
    }
    fn put_heads(&self, dst: &mut HostRows<T>, first: usize, src: &HostRows<T>) -> Result<()> {
        dst.put_heads(first, src)
    }
    fn take_acc_heads(&self, src: &Flat, heads: std::ops::Range<usize>) -> Result<Flat> {
        src.take_heads(heads)
    }
    fn add_acc_heads(&self, dst: &mut Flat, first: usize, src: &Flat) -> Result<()> {
        dst.add_heads(first, src)
    }
    fn stats_as_acc(&self, stats: &Flat) -> Result<Flat> {
        let shape = <Self as ChunkCompute<T>>::stats_shape(self, stats)
            .ok_or_else(|| AttnError::InvalidArgument("per-row values that do not fill their shape".into()))?;
        Ok(Flat { shape, data: stats.data.clone() })
    }
    fn acc_as_stats(&self, acc: &Flat) -> Result<Flat> {
        match acc.shape.head_dim == 1 {
            true => Ok(acc.clone()),
            false => Err(AttnError::InvalidArgument(format!("an accumulator of head_dim {}", acc.shape.head_dim))),
        }
    }
    fn finish_forward_slot(&self, problem: &RingProblem, p: &Partial, _slot: HeadSlot) -> Result<(HostRows<T>, Flat)> {
        // Every head of a config takes one output scale, as the CUDA compute's finish.
        <Self as ChunkCompute<T>>::finish_forward(self, problem, p)
    }
}

fn emulated<T>(
    (world, layout): (usize, Layout),
    moves: Moves,
    opts: ChunkOptions,
) -> ChunkBackend<T, impl Fn(usize) -> Result<Vec<ThreadComm>>, EmulatedChunks> {
    ChunkBackend {
        label: "emulated cuda",
        world,
        layout,
        strategy: Strategy::Auto,
        join: |p| ThreadComm::world_with_timeout(p, Duration::from_secs(120)),
        moves,
        opts,
        compute: EmulatedChunks,
        dtype: PhantomData,
    }
}

/// Every block mask file, bf16, world 2, zigzag (each rank's rows in two runs, so blocks
/// start off the mask's block edges), in two rounds; sampled to one layout for CI time
/// (about 25 CPU seconds for both), the CPU chunk ring runs both at every world size.
#[test]
fn emulated_cuda_chunk_ring_block_masks() {
    let opts = ChunkOptions::with_rounds(2).unwrap();
    let runs = chunk_sweep_setups("blocks", 8, &[(2, Layout::Zigzag)], |world, layout| {
        emulated::<bf16>((world, layout), Moves::InProcess, opts)
    });
    assert_eq!(runs, 8);
}

fn sweep<T: CudaElement>(moves: Moves, opts: ChunkOptions, setups: &[(usize, Layout)]) {
    for dir in ["dilated", "features"] {
        let runs = chunk_sweep_setups(dir, 9, setups, |world, layout| emulated::<T>((world, layout), moves, opts));
        assert_eq!(runs, 9 * setups.len(), "{dir}");
    }
}

/// A gradient into the LSE through the CUDA delta kernel: rows that attend nothing (a NaN
/// gradient on them) and a random feature case, bf16, world 2, zigzag, in two rounds.
#[test]
fn emulated_cuda_chunk_ring_lse_gradients() {
    let opts = ChunkOptions::with_rounds(2).unwrap();
    let backend = emulated::<bf16>((2, Layout::Zigzag), Moves::InProcess, opts);
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = attn_testkit::feature_case(8..=32, 8, vec![1, 4]);
    let fits = |c: &attn_testkit::FeatureCase| Layout::Zigzag.check(c.shape.q.seq, 2).is_ok();
    let random = std::iter::repeat_with(|| strategy.new_tree(&mut runner).unwrap().current()).find(fits).unwrap();
    for case in [attn_testkit::unattended_rows_case(), random] {
        assert!(fits(&case), "{case:?} does not fit a zigzag ring of 2");
        if let Err(e) = attn_testkit::judge_lse_gradients(&backend, &case) {
            panic!("{case:?}: {e}");
        }
    }
}

// One test a world size, so that the harness spreads the sweep over the cores.
#[test]
fn emulated_cuda_chunk_ring_bf16_world_2() {
    sweep::<bf16>(Moves::InProcess, ChunkOptions::with_rounds(2).unwrap(), &both_layouts(2));
}

#[test]
fn emulated_cuda_chunk_ring_bf16_world_3() {
    // Worlds 3 and 4 take one layout each (sampled: world 2 runs both).
    sweep::<bf16>(Moves::InProcess, ChunkOptions::with_rounds(2).unwrap(), &[(3, Layout::Contiguous)]);
}

#[test]
fn emulated_cuda_chunk_ring_bf16_world_4() {
    sweep::<bf16>(Moves::InProcess, ChunkOptions::with_rounds(2).unwrap(), &[(4, Layout::Zigzag)]);
}

#[test]
fn emulated_cuda_chunk_ring_f32_host_staged() {
    sweep::<f32>(Moves::HostStaged, ChunkOptions::default(), &both_layouts(2));
}

#[test]
fn emulated_cuda_chunk_ring_f16_host_staged() {
    sweep::<f16>(Moves::HostStaged, ChunkOptions::default(), &both_layouts(2));
}

/// Ulysses and the hybrid on the CUDA compute's steps (blocks over a slot of heads, the
/// kernels given the slot as a head window): every file of `conformance/dilated` and
/// `conformance/features`, buffers handed on in process, judged against the files' bounds;
/// a file with fewer heads than the degree is the typed refusal. Dtypes and layouts sampled
/// across the runs for emulation time (Ulysses P = 2 in bf16 takes both layouts).
#[test]
fn emulated_cuda_chunk_ring_ulysses_world_2_bf16() {
    head_sweep::<bf16>((2, Strategy::Ulysses), &[Layout::Contiguous, Layout::Zigzag]);
}

#[test]
fn emulated_cuda_chunk_ring_ulysses_world_3_f32() {
    head_sweep::<f32>((3, Strategy::Ulysses), &[Layout::Contiguous]);
}

#[test]
fn emulated_cuda_chunk_ring_hybrid_2_of_4_f16() {
    head_sweep::<f16>((4, Strategy::Hybrid { ulysses: 2 }), &[Layout::Zigzag]);
}

fn head_sweep<T: CudaElement>(run: (usize, Strategy), layouts: &[Layout]) {
    let opts = ChunkOptions::default();
    for dir in ["dilated", "features"] {
        let (passed, refused) = golden_dir_through_layouts(dir, &[run], layouts, |world, layout, strategy| {
            ChunkBackend { strategy, ..emulated::<T>((world, layout), Moves::InProcess, opts) }
        });
        let want = 9 * layouts.len();
        assert!(passed > 0 && passed + refused == want, "{dir} {run:?}: {passed} passed, {refused} refused");
    }
}

/// Uneven heads and key/value heads read by several slots (6 over 2 at U = 4, 5 over 1 at
/// U = 3, 6 over 3 in the hybrid (2, 4)), both mixings, forward and backward through the
/// CUDA compute's steps against the float64 reference.
#[test]
fn emulated_cuda_chunk_ring_uneven_heads_equal_the_reference() {
    let mut runs = 0;
    for (heads, kv_heads, world, strategy) in
        [(6, 2, 4, Strategy::Ulysses), (5, 1, 3, Strategy::Ulysses), (6, 3, 4, Strategy::Hybrid { ulysses: 2 })]
    {
        for (mixing, causal, layout) in
            [(Mixing::HeadGroups, false, Layout::Contiguous), (Mixing::LongNet, true, Layout::Zigzag)]
        {
            let backend = ChunkBackend {
                strategy,
                ..emulated::<f32>((world, layout), Moves::InProcess, ChunkOptions::default())
            };
            let v = uneven_heads_case(&backend, (heads, kv_heads), mixing, causal);
            assert!(v.is_ok(), "heads {heads}/{kv_heads} {strategy:?} p={world} {mixing:?}: {}", v.unwrap_err());
            runs += 1;
        }
    }
    assert_eq!(runs, 3 * 2);
}
