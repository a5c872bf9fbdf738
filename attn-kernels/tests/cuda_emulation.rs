//! The CUDA path without a GPU: every golden file of `conformance/dilated`,
//! `conformance/features` and `conformance/wide` (cross-attention, explicit scales, head_dim
//! 64 and 128) through this crate's launch plans (`cuda::launch_plan`) and
//! epilogue launches, executed by the CPU emulation of the `.cu` kernels
//! (`cuda::emulation`), in f32, bf16 and f16, forward and gradients; the forward's direct
//! path (output straight from the kernel) against its partial path, bit for bit; the
//! forward with 64 and with 128 query rows a block, two and three K/V stages
//! (`cuda_three_stages` has the rest of the three-stage checks); the patterns in one launch against
//! one launch each, bit for bit; the backward's pipelined query tiles against its
//! synchronous ones, bit for bit. Needs a C++20 compiler (`$CXX`, default `g++`); without
//! one the test fails, naming it.
#![cfg(feature = "cuda")]

use std::marker::PhantomData;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use attn_core::{DType, Result, Shape4};
use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::ForwardPath;
use attn_kernels::cuda::emulation::{Emulator, HostAccs, HostArgs};
use attn_kernels::cuda::launch_plan::{BlockGeometry, BlockMaskShape, plan_forward, plan_forward_direct};
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKernel, BackwardKeys, BackwardLoads, BackwardOptions, BackwardQueries, BackwardWrites,
    ForwardMma, ForwardOptions, ForwardRows, ForwardStages, PatternFusion, backward_kernel,
};
use attn_kernels::cuda::scratch::ScratchPool;
use attn_testkit::golden::{
    DilatedBackend, Forward32, Gradients32, Problem, assert_attention_dirs_pass, attention_cases,
};
use half::{bf16, f16};

pub(crate) fn emulator() -> &'static Emulator {
    Emulator::shared(Path::new(env!("CARGO_TARGET_TMPDIR")))
        .unwrap_or_else(|e| panic!("the CUDA kernel emulation needs a C++20 compiler ($CXX or g++): {e}"))
}

/// A fresh emulator of the shared library (default options, grid order), for tests that set
/// their own options and block order.
pub(crate) fn fresh_emulator() -> Emulator {
    emulator();
    Emulator::load(&Emulator::library_path(Path::new(env!("CARGO_TARGET_TMPDIR")))).unwrap()
}

/// The emulator planning the forward with `opts` and the backward with `bwd` (the shared
/// library, loaded again, whatever `ATTN_CUDA_FWD_*` and `ATTN_CUDA_BWD_*` say).
pub(crate) fn emulator_for(opts: ForwardOptions, bwd: BackwardOptions) -> &'static Emulator {
    const N: usize = ForwardRows::ALL.len() * PatternFusion::ALL.len();
    static EMULATORS: [OnceLock<Emulator>; 128 * N] = [const { OnceLock::new() }; 128 * N];
    let rows = ForwardRows::ALL.iter().position(|&r| r == opts.rows).unwrap_or(0);
    let fusion = PatternFusion::ALL.iter().position(|&f| f == opts.fusion).unwrap_or(0);
    let slot = rows
        + ForwardRows::ALL.len() * fusion
        + N * usize::from(bwd.loads == BackwardLoads::Pipelined)
        + 2 * N * usize::from(bwd.keys == BackwardKeys::K128)
        + 4 * N * usize::from(bwd.dq == BackwardDq::Deterministic)
        + 8 * N * usize::from(opts.stages == ForwardStages::Three)
        + 16 * N * usize::from(bwd.writes == BackwardWrites::Direct)
        + 32 * N * usize::from(bwd.queries == BackwardQueries::Q64)
        + 64 * N * usize::from(opts.mma == ForwardMma::Wgmma);
    EMULATORS[slot].get_or_init(|| {
        emulator();
        let lib = Emulator::library_path(Path::new(env!("CARGO_TARGET_TMPDIR")));
        Emulator::load(&lib)
            .unwrap()
            .with_forward_rows(opts.rows)
            .with_pattern_fusion(opts.fusion)
            .with_forward_stages(opts.stages)
            .with_forward_mma(opts.mma)
            .with_backward_loads(bwd.loads)
            .with_backward_keys(bwd.keys)
            .with_backward_dq(bwd.dq)
            .with_backward_writes(bwd.writes)
            .with_backward_queries(bwd.queries)
    })
}

/// The emulator with the forward's `opts` and the default backward.
fn emulator_with(opts: ForwardOptions) -> &'static Emulator {
    emulator_for(opts, BackwardOptions::default())
}

/// The emulator with the default forward and the backward's query-tile `loads`.
fn emulator_loading(loads: BackwardLoads) -> &'static Emulator {
    emulator_for(ForwardOptions::default(), BackwardOptions { loads, ..BackwardOptions::default() })
}

/// The whole-sequence CUDA call (`CudaBackend`'s steps) on the emulation, in `T`, the
/// forward's tensor-core blocks planned with `opts`.
pub(crate) struct Emulated<T> {
    opts: ForwardOptions,
    bwd: BackwardOptions,
    dtype: PhantomData<T>,
    /// The scratch the whole calls reuse, as a device's stream keeps it.
    pool: Mutex<ScratchPool<Vec<f32>>>,
}

impl<T> Emulated<T> {
    pub(crate) fn new(rows: ForwardRows) -> Self {
        let opts = ForwardOptions { rows, ..ForwardOptions::default() };
        Emulated { opts, bwd: BackwardOptions::default(), dtype: PhantomData, pool: Mutex::default() }
    }

    pub(crate) fn fused(rows: ForwardRows) -> Self {
        Self::new(rows).with_fusion(PatternFusion::Fused)
    }

    /// The same backend, the forward's patterns launched as `fusion` says.
    pub(crate) fn with_fusion(self, fusion: PatternFusion) -> Self {
        Emulated { opts: ForwardOptions { fusion, ..self.opts }, ..self }
    }

    /// The same backend, the forward with `stages` K/V stages.
    pub(crate) fn with_stages(self, stages: ForwardStages) -> Self {
        Emulated { opts: ForwardOptions { stages, ..self.opts }, ..self }
    }

    /// The same backend, the f16/bf16 forward's instructions as `mma` says (`Wgmma`: an
    /// emulated sm_90a device).
    pub(crate) fn with_mma(self, mma: ForwardMma) -> Self {
        Emulated { opts: ForwardOptions { mma, ..self.opts }, ..self }
    }

    /// The forward's options.
    pub(crate) fn options(&self) -> ForwardOptions {
        self.opts
    }

    /// The same forward, the backward planned with `bwd`.
    pub(crate) fn with_backward(self, bwd: BackwardOptions) -> Self {
        Emulated { bwd, ..self }
    }
}

/// The geometry of a whole call whose output is contiguous.
pub(crate) fn call_geometry<'a>(p: &Problem<'a>) -> BlockGeometry<'a> {
    geometry(p, Some(p.shape.q.contiguous_strides()))
}

pub(crate) fn conv<T: CudaElement>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

fn geometry<'a>(p: &Problem<'a>, g_strides: Option<[usize; 4]>) -> BlockGeometry<'a> {
    let (sq, skv) = (p.shape.q, p.shape.kv);
    BlockGeometry {
        cfg: p.cfg,
        q: (sq, sq.contiguous_strides()),
        q_start: 0,
        k: (skv, skv.contiguous_strides()),
        v_strides: skv.contiguous_strides(),
        k_start: 0,
        g_strides,
        band: p.cfg.band(),
        kpad_seq: p.masks.key_padding.map(|m| m.seq()),
        packing: p.masks.packing,
        block_mask: p.masks.block.map(BlockMaskShape::from),
    }
}

/// The block mask's entries, where the problem has one.
fn block_keep<'a>(p: &Problem<'a>) -> Option<&'a [u8]> {
    p.masks.block.map(|m| m.keep())
}

fn flags(p: &Problem<'_>) -> Option<Vec<u8>> {
    p.masks.key_padding.map(|m| m.flags().iter().map(|&f| u8::from(f)).collect())
}

impl<T: CudaElement> Emulated<T> {
    /// out (in `T`) and lse.
    fn run_forward(&self, p: &Problem<'_>, q: &[T], k: &[T], v: &[T]) -> Result<(Vec<T>, Vec<f32>)> {
        self.forward_on(p, [q, k, v], ForwardPath::Direct)
    }

    /// The whole-call forward on `path`: out (in `T`) and lse.
    pub(crate) fn forward_on(&self, p: &Problem<'_>, qkv: [&[T]; 3], path: ForwardPath) -> Result<(Vec<T>, Vec<f32>)> {
        self.forward_with(emulator_with(self.opts), p, qkv, path)
    }

    /// [`Self::forward_on`] on `emu` (its own options and block order), the scratch from
    /// this backend's pool.
    pub(crate) fn forward_with(
        &self,
        emu: &Emulator,
        p: &Problem<'_>,
        [q, k, v]: [&[T]; 3],
        path: ForwardPath,
    ) -> Result<(Vec<T>, Vec<f32>)> {
        let sq = p.shape.q;
        let kpad = flags(p);
        let args = HostArgs { q, k, v, g: None, lse: None, delta: None, kpad: kpad.as_deref(), bmask: block_keep(p) };
        let (mut out, mut lse) = (vec![T::default(); sq.numel()], vec![0.0f32; sq.lse_len()]);
        let mut pool = self.pool.lock().unwrap();
        emu.forward_call(&call_geometry(p), &args, path, (&mut out, &mut lse), &mut pool)?;
        Ok((out, lse))
    }

    /// The backward's f32 accumulators dq, dk, dv on `emu` (inputs rounded to `T`).
    fn backward_accs(
        &self,
        emu: &Emulator,
        p: &Problem<'_>,
        [q, k, v]: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<[Vec<f32>; 3]> {
        let (sq, skv) = (p.shape.q, p.shape.kv);
        let (q, k, v, go): (Vec<T>, Vec<T>, Vec<T>, Vec<T>) = (conv(q), conv(k), conv(v), conv(grad_out));
        let (out, lse) = self.run_forward(p, &q, &k, &v)?;
        let delta = emu.delta(sq, &go, &out, grad_lse.map(|g| (g, &lse[..])))?;
        let kpad = flags(p);
        let args = HostArgs {
            q: &q,
            k: &k,
            v: &v,
            g: Some(&go),
            lse: Some(&lse),
            delta: Some(&delta),
            kpad: kpad.as_deref(),
            bmask: block_keep(p),
        };
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; sq.numel()], vec![0.0f32; skv.numel()], vec![0.0f32; skv.numel()]);
        let acc = HostAccs { q_acc: &mut dq, lse: None, dk: Some(&mut dk), dv: Some(&mut dv) };
        emu.backward_block(&geometry(p, Some(sq.contiguous_strides())), &args, acc)?;
        Ok([dq, dk, dv])
    }

    /// Whether the direct path applies to `p` (one pattern per head, the tensor-core kernel).
    fn direct_applies(&self, p: &Problem<'_>) -> bool {
        plan_forward_direct(&call_geometry(p), T::DTYPE, T::SUFFIX, self.opts).is_ok_and(|x| x.is_some())
    }
}

fn f32s<T: CudaElement>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

impl<T: CudaElement> DilatedBackend for Emulated<T> {
    fn name(&self) -> String {
        let (f, b) = (self.opts, self.bwd);
        let (dtype, rows, stages, mma) = (T::DTYPE.as_str(), f.rows.name(), f.stages.name(), f.mma.name());
        format!("cuda-emulation {dtype} {mma} rows {rows} {:?} stages {stages}, backward {b:?}", f.fusion)
    }

    fn dtype(&self) -> DType {
        T::DTYPE
    }

    fn forward(&self, p: &Problem<'_>, [q, k, v]: [&[f32]; 3]) -> Result<Forward32> {
        let (out, lse) = self.run_forward(p, &conv(q), &conv(k), &conv(v))?;
        Ok(Forward32 { out: f32s(&out), lse })
    }

    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        self.gradients(p, qkv, grad_out, None)
    }

    fn backward_lse(&self, p: &Problem<'_>, qkv: [&[f32]; 3], go: &[f32], grad_lse: &[f32]) -> Result<Gradients32> {
        self.gradients(p, qkv, go, Some(grad_lse))
    }
}

impl<T: CudaElement> Emulated<T> {
    /// The gradients stored in `T`, with an optional gradient into the LSE.
    fn gradients(
        &self,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<Gradients32> {
        self.gradients_on(emulator_for(self.opts, self.bwd), p, qkv, grad_out, grad_lse)
    }

    /// [`Self::gradients`] with the backward on `emu` (its own options and block order).
    pub(crate) fn gradients_on(
        &self,
        emu: &Emulator,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<Gradients32> {
        let (sq, skv) = (p.shape.q, p.shape.kv);
        let [q, k, v, go]: [Vec<T>; 4] = [qkv[0], qkv[1], qkv[2], grad_out].map(conv);
        let (out, lse) = self.run_forward(p, &q, &k, &v)?;
        let kpad = flags(p);
        let args = HostArgs {
            q: &q,
            k: &k,
            v: &v,
            g: Some(&go),
            lse: Some(&lse),
            delta: None,
            kpad: kpad.as_deref(),
            bmask: block_keep(p),
        };
        // Gradients that start as garbage: the call must write every element.
        let seven = T::from_f32(7.0);
        let (mut dq, mut dk, mut dv) = (vec![seven; sq.numel()], vec![seven; skv.numel()], vec![seven; skv.numel()]);
        let g = geometry(p, Some(sq.contiguous_strides()));
        let mut pool = self.pool.lock().unwrap();
        emu.backward_call(&g, &args, (&out, grad_lse), &mut pool, [&mut dq, &mut dk, &mut dv])?;
        Ok(Gradients32 { dq: f32s(&dq), dk: f32s(&dk), dv: f32s(&dv) })
    }

    /// Scratch buffers this backend's whole calls have allocated.
    pub(crate) fn scratch_allocations(&self) -> u64 {
        self.pool.lock().unwrap().allocations()
    }
}

#[test]
fn the_emulation_runs_every_kernel_of_the_source() {
    use attn_kernels::cuda::source::{kernel_names, sm90a_kernel_names_for};
    let sm90a = ["f16", "bf16"].map(|t| sm90a_kernel_names_for(t).len()).iter().sum::<usize>();
    assert_eq!(emulator().kernel_count().unwrap(), kernel_names().len() + sm90a);
}

/// Every golden file where the direct path applies: its output and lse equal the partial
/// path's bit for bit (the same arithmetic, without the f32 round trip's merge), in bf16
/// and f16. Also counts the files, so the check cannot pass by finding none.
pub(crate) fn direct_equals_partial<T: CudaElement>(emulated: &Emulated<T>) {
    let mut compared = Vec::new();
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        if !emulated.direct_applies(&p) {
            continue;
        }
        let [q, k, v]: [Vec<T>; 3] = ["q", "k", "v"].map(|t| conv(&case.tensor(t).unwrap().data));
        let direct = emulated.forward_on(&p, [&q, &k, &v], ForwardPath::Direct).unwrap();
        let partial = emulated.forward_on(&p, [&q, &k, &v], ForwardPath::Partial).unwrap();
        let out_bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
        let lse_bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (what, d, p) in
            [("output", out_bits(&direct.0), out_bits(&partial.0)), ("lse", lse_bits(&direct.1), lse_bits(&partial.1))]
        {
            let differ: Vec<usize> = (0..d.len()).filter(|&i| d[i] != p[i]).collect();
            assert!(
                differ.is_empty() && d.len() == p.len(),
                "{}: {what}: {} of {} values differ, the first at {:?}",
                case.name,
                differ.len(),
                d.len(),
                differ.first()
            );
        }
        compared.push(case.name.clone());
    }
    println!("direct = partial bit for bit: {} files ({})", compared.len(), compared.join(", "));
    assert!(compared.len() >= 12, "only {} golden files take the direct path", compared.len());
}

#[test]
fn direct_forward_equals_the_partial_path_bf16() {
    direct_equals_partial(&Emulated::<bf16>::new(ForwardRows::M64));
}

#[test]
fn direct_forward_equals_the_partial_path_f16() {
    direct_equals_partial(&Emulated::<f16>::new(ForwardRows::M64));
}

/// The 128-row forward: every golden file (its direct path where it applies, the partial
/// path for the rest), and direct equal to partial.
#[test]
fn emulated_cuda_golden_bf16_rows_128() {
    let emulated = Emulated::<bf16>::new(ForwardRows::M128);
    direct_equals_partial(&emulated);
    assert_attention_dirs_pass(&emulated);
}

/// The 128-row forward over 4 warps (two row tiles a warp): every golden file, and direct
/// equal to partial.
#[test]
fn emulated_cuda_golden_f16_rows_128w4() {
    let emulated = Emulated::<f16>::new(ForwardRows::M128W4);
    direct_equals_partial(&emulated);
    assert_attention_dirs_pass(&emulated);
}

/// Every golden file whose forward fuses its patterns into fewer launches (the 64-row
/// fused kernel): the fused forward equals one launch a pattern bit for bit (each row is
/// still computed by one block with the same arithmetic), on the direct and the partial
/// path. Counts the files, so it cannot pass by fusing none.
fn fused_equals_per_pattern<T: CudaElement>() {
    let (fused, apart) = (Emulated::<T>::fused(ForwardRows::M64), Emulated::<T>::new(ForwardRows::M64));
    let mut compared = Vec::new();
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let launches = |e: &Emulated<T>| plan_forward(&call_geometry(&p), T::DTYPE, T::SUFFIX, e.opts).unwrap();
        let (nf, na) = (launches(&fused), launches(&apart));
        if nf.len() == na.len() {
            continue;
        }
        assert!(nf.iter().any(|l| l.params.fused > 1), "{}: fewer launches without a fused one", case.name);
        let [q, k, v]: [Vec<T>; 3] = ["q", "k", "v"].map(|t| conv(&case.tensor(t).unwrap().data));
        for path in [ForwardPath::Direct, ForwardPath::Partial] {
            let a = fused.forward_on(&p, [&q, &k, &v], path).unwrap();
            let b = apart.forward_on(&p, [&q, &k, &v], path).unwrap();
            let bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
            let lbits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a.0) == bits(&b.0), "{} {path:?}: fused output differs", case.name);
            assert!(lbits(&a.1) == lbits(&b.1), "{} {path:?}: fused lse differs", case.name);
        }
        compared.push(format!("{} ({} -> {} launches)", case.name, na.len(), nf.len()));
    }
    println!("fused = per pattern bit for bit: {}", compared.join(", "));
    assert!(compared.len() >= 8, "only {} golden files fuse their patterns", compared.len());
}

#[test]
fn fused_patterns_equal_one_launch_a_pattern_bf16() {
    fused_equals_per_pattern::<bf16>();
}

#[test]
fn fused_patterns_equal_one_launch_a_pattern_f16() {
    fused_equals_per_pattern::<f16>();
}

/// The backward of `p` with pipelined query tiles: its dq, dk and dv accumulators equal the
/// synchronous loads' bit for bit (the same arithmetic in the same order; only when the
/// tiles arrive differs).
fn assert_pipelined_equals_sync<T: CudaElement>(name: &str, p: &Problem<'_>, [q, k, v, go]: [&[f32]; 4]) {
    let emulated = Emulated::<T>::new(ForwardRows::M64);
    let run = |loads| emulated.backward_accs(emulator_loading(loads), p, [q, k, v], go, None).unwrap();
    let (a, b) = (run(BackwardLoads::Pipelined), run(BackwardLoads::Sync));
    for (grad, x, y) in [("dq", &a[0], &b[0]), ("dk", &a[1], &b[1]), ("dv", &a[2], &b[2])] {
        let bits = |z: &[f32]| z.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(bits(x) == bits(y), "{name}: pipelined {grad} differs");
    }
}

/// Every golden file whose backward runs the tensor-core kernel: pipelined = sync, bit for
/// bit. Counts the files, so it cannot pass by comparing none.
fn pipelined_equals_sync<T: CudaElement>() {
    let mut compared = Vec::new();
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let pipelined = BackwardOptions { loads: BackwardLoads::Pipelined, ..BackwardOptions::default() };
        let kernel = backward_kernel(T::DTYPE, T::SUFFIX, p.shape.q.head_dim, pipelined);
        if !matches!(kernel, BackwardKernel::Mma { .. }) {
            continue;
        }
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.clone());
        assert_pipelined_equals_sync::<T>(&case.name, &p, [&q, &k, &v, &go]);
        compared.push(case.name.clone());
    }
    println!("pipelined backward = sync bit for bit: {}", compared.join(", "));
    assert!(compared.len() >= 12, "only {} golden files run the tensor-core backward", compared.len());
}

#[test]
fn pipelined_backward_equals_sync_bf16() {
    pipelined_equals_sync::<bf16>();
}

#[test]
fn pipelined_backward_equals_sync_f16() {
    pipelined_equals_sync::<f16>();
}

/// A backward block whose keys no query of the block attends (causal, keys after every
/// query): with pipelined loads it issues its K/V copy, runs no query tile and must still
/// wait for the copy (the emulator fails a launch that leaves one in flight); the
/// gradients stay zero.
#[test]
fn a_backward_block_with_no_query_tile_waits_for_its_kv_copy() {
    let cfg = attn_core::DilatedConfig::builder().segments(&[128]).dilations(&[1]).causal().build().unwrap();
    let s = Shape4::new(1, 64, 2, 32).unwrap();
    let g = BlockGeometry {
        cfg: &cfg,
        q: (s, s.contiguous_strides()),
        q_start: 0,
        k: (s, s.contiguous_strides()),
        v_strides: s.contiguous_strides(),
        k_start: 64,
        g_strides: Some(s.contiguous_strides()),
        band: cfg.band(),
        kpad_seq: None,
        packing: None,
        block_mask: None,
    };
    let x: Vec<bf16> = (0..s.numel()).map(|i| bf16::from_f32((i % 7) as f32 * 0.1)).collect();
    let (lse, delta) = (vec![0.5f32; s.lse_len()], vec![0.25f32; s.lse_len()]);
    let args =
        HostArgs { q: &x, k: &x, v: &x, g: Some(&x), lse: Some(&lse), delta: Some(&delta), kpad: None, bmask: None };
    for loads in BackwardLoads::ALL {
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; s.numel()], vec![0.0f32; s.numel()], vec![0.0f32; s.numel()]);
        let acc = HostAccs { q_acc: &mut dq, lse: None, dk: Some(&mut dk), dv: Some(&mut dv) };
        emulator_loading(loads).backward_block(&g, &args, acc).unwrap();
        assert!([&dq, &dk, &dv].iter().all(|x| x.iter().all(|&v| v == 0.0)), "{loads:?}");
    }
}

/// A block whose keys no query may attend (causal, keys after every query): each
/// tensor-core block issues its Q copy, runs no key tile and must still wait for the copy
/// before it ends (the emulator fails a launch that leaves one in flight); the partial
/// stays empty.
#[test]
fn a_block_with_no_key_tile_waits_for_its_q_copy() {
    let cfg = attn_core::DilatedConfig::builder().segments(&[128]).dilations(&[1]).causal().build().unwrap();
    let (sq, sk) = (Shape4::new(1, 64, 2, 32).unwrap(), Shape4::new(1, 64, 2, 32).unwrap());
    let g = BlockGeometry {
        cfg: &cfg,
        q: (sq, sq.contiguous_strides()),
        q_start: 0,
        k: (sk, sk.contiguous_strides()),
        v_strides: sk.contiguous_strides(),
        k_start: 64,
        g_strides: None,
        band: cfg.band(),
        kpad_seq: None,
        packing: None,
        block_mask: None,
    };
    let x: Vec<bf16> = (0..sq.numel()).map(|i| bf16::from_f32((i % 7) as f32 * 0.1)).collect();
    let args = HostArgs { q: &x, k: &x, v: &x, g: None, lse: None, delta: None, kpad: None, bmask: None };
    for rows in ForwardRows::ALL {
        for stages in ForwardStages::ALL {
            let (mut o, mut lse) = (vec![0.0f32; sq.numel()], vec![f32::NEG_INFINITY; sq.lse_len()]);
            let acc = HostAccs { q_acc: &mut o, lse: Some(&mut lse), dk: None, dv: None };
            emulator_with(ForwardOptions { rows, stages, ..ForwardOptions::default() })
                .forward_block(&g, &args, acc)
                .unwrap();
            let untouched = o.iter().all(|&v| v == 0.0) && lse.iter().all(|&l| l == f32::NEG_INFINITY);
            assert!(untouched, "{rows:?} {stages:?}");
        }
    }
}

#[test]
fn emulated_cuda_golden_f32() {
    assert_attention_dirs_pass(&Emulated::<f32>::new(ForwardRows::M64));
}

#[test]
fn emulated_cuda_golden_bf16() {
    assert_attention_dirs_pass(&Emulated::<bf16>::new(ForwardRows::M64));
}

#[test]
fn emulated_cuda_golden_f16() {
    assert_attention_dirs_pass(&Emulated::<f16>::new(ForwardRows::M64));
}

/// Forward and gradients of `problem` on the emulation in `T` with every block shape,
/// judged against the float64 reference on the inputs rounded to `T` (panics naming the
/// failing check); the reference and each shape's gradients for further checks.
fn judge_every_shape<T: CudaElement>(
    problem: &Problem<'_>,
    [q, k, v, go]: [&[f32]; 4],
) -> (attn_testkit::judge::Expected, Vec<Gradients32>) {
    use attn_testkit::judge::{Expected, judge_backward, judge_forward, round_to, verdict};
    let r = [q, k, v, go].map(|x| round_to(T::DTYPE, x).into_iter().map(f64::from).collect::<Vec<_>>());
    let want = Expected::for_problem(problem, [&r[0], &r[1], &r[2]], Some(&r[3])).unwrap();
    let mut runs = Vec::new();
    for (rows, stages) in ForwardRows::ALL.into_iter().flat_map(|r| ForwardStages::ALL.map(|s| (r, s))) {
        let emulated = Emulated::<T>::new(rows).with_stages(stages);
        let got = emulated.forward(problem, [q, k, v]).unwrap();
        let g = emulated.backward(problem, [q, k, v], go).unwrap();
        let mut checks = judge_forward(&want, &got.out, &got.lse, T::DTYPE);
        checks.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], T::DTYPE));
        if let Err(e) = verdict(&checks) {
            panic!("{}: {e}", emulated.name());
        }
        runs.push(g);
    }
    (want, runs)
}

/// Key tiles the forward loads (and query tiles the pipelined backward loads) by stepped
/// pointers (inside one segment, no padding) with dilation rates 2 and 4 and 128 selected
/// keys a segment, and a ragged last segment whose final key tile is cut at the end of
/// the keys (no padding, not causal): forward and gradients against the float64
/// reference, every block shape, bf16; the pipelined backward equal to the synchronous.
#[test]
fn dilated_affine_tiles_and_a_ragged_end_match_the_reference() {
    let cfg = attn_core::DilatedConfig::builder().segments(&[256, 512]).dilations(&[2, 4]).build().unwrap();
    let shape = attn_core::AttnShape::self_attn(Shape4::new(1, 1000, 2, 128).unwrap());
    let n = shape.q.numel();
    let [q, k, v, go] = [0, 1, 2, 3].map(|i| attn_testkit::rng::random_vec(2026 + i, n));
    let p = Problem::new(&cfg, shape);
    judge_every_shape::<bf16>(&p, [&q, &k, &v, &go]);
    assert_pipelined_equals_sync::<bf16>("affine tiles", &p, [&q, &k, &v, &go]);
}

/// The backward with 128 keys a block, whose instances start at head dim 64 (no golden
/// file has one): gradients against the float64 reference with both query-tile loads,
/// beside 64 keys a block, on `wide_head_cases` (affine tiles, grouped heads, padding,
/// packed sequences, a causal window). The plan must name the 128-key kernel, so the
/// check cannot pass on the 64-key one.
#[test]
fn backward_with_128_keys_a_block_matches_the_reference() {
    for (name, case) in attn_testkit::wide_head_cases() {
        for loads in BackwardLoads::ALL {
            for keys in BackwardKeys::ALL {
                let bwd = BackwardOptions { loads, keys, ..BackwardOptions::default() };
                let BackwardKernel::Mma { name: kernel, .. } =
                    backward_kernel(DType::BF16, "bf16", case.shape.q.head_dim, bwd)
                else {
                    panic!("{name}: expected the tensor-core backward")
                };
                assert_eq!(kernel.contains("_k128_"), keys == BackwardKeys::K128, "{name}: {kernel}");
                let emulated = Emulated::<bf16>::new(ForwardRows::M64).with_backward(bwd);
                if let Err(e) = attn_testkit::judge_gradients(&emulated, &case) {
                    panic!("{name}, {kernel}: {e}");
                }
            }
        }
    }
}

/// A gradient into the LSE reaches dq and dk through the delta kernel that every
/// backward kernel reads: the tensor-core backward (bf16) and the row kernels (f32) on the
/// wide-head cases (grouped heads, key padding, packed sequences, a window) and on rows
/// that attend nothing, whose NaN gradient into the LSE must not reach dk.
#[test]
fn lse_gradients_match_the_reference() {
    let cases =
        attn_testkit::wide_head_cases().into_iter().chain([("unattended rows", attn_testkit::unattended_rows_case())]);
    for (name, case) in cases {
        let backends: [Box<dyn DilatedBackend>; 2] =
            [Box::new(Emulated::<bf16>::new(ForwardRows::M64)), Box::new(Emulated::<f32>::new(ForwardRows::M64))];
        for b in backends {
            if let Err(e) = attn_testkit::judge_lse_gradients(b.as_ref(), &case) {
                panic!("{name}, {}: {e}", b.name());
            }
        }
    }
}

/// f16 gradients near f16's subnormals (a proptest case the H200 failed under the old
/// bound: dk rows of about 1e-6 from score gradients the backward rounds to f16
/// subnormals) within the bound that counts that rounding; twice the dk fails it.
#[test]
fn f16_gradients_from_subnormal_score_gradients_are_judged_by_their_quantum() {
    use attn_testkit::judge::{judge_backward, verdict};
    let cfg = attn_core::DilatedConfig::builder()
        .segments(&[51, 101, 69])
        .dilations(&[1, 3, 3])
        .causal()
        .maybe_scale(Some(1.776_137_378_522_022_5))
        .build()
        .unwrap();
    let shape = attn_core::AttnShape::self_attn(Shape4::new(1, 100, 3, 8).unwrap());
    let case = attn_testkit::FeatureCase { cfg, shape, padding: None, cu_seqlens: None, seed: 54_300_709_845_078_333 };
    let [q, k, v, go] = case.inputs();
    let (want, runs) = judge_every_shape::<f16>(&case.problem(), [&q, &k, &v, &go]);
    for g in runs {
        let doubled: Vec<f32> = g.dk.iter().map(|x| 2.0 * x).collect();
        assert!(verdict(&judge_backward(&want, [&g.dq, &doubled, &g.dv], DType::F16)).is_err());
    }
}
